"""Shared parts of the capture-proxy tests: upstream clients, a proxy in front of them, store reads.

- `Recording`: wraps a PolicyClient (the real `EmbeddedClient` in front of the embedded server)
  and keeps every (ids sent, Sample) pair: the engine's ids, logprobs and version as the client
  parsed them from the server's JSON (which checks the echoed prompt ids), to compare with what
  the proxy stored.
- `Scripted`: an honest fake upstream that "samples" given texts (tokenized, plus `<|im_end|>`),
  for tool-call replies a random tiny model will not write; it streams them token by token
  (optionally paced), and counts the streams its caller closed before their end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from collectors.policy import Chunk, PolicyClient, Sample, SamplingParams, StreamedSample
from collectors.proxy.app import ProxyConfig, RunningProxy, serve_proxy_in_thread
from tests.collectors import http
from trajstore import Store, open_store
from trajstore.requests import resolve

MODEL = "tiny"  # accepted by every test proxy besides the upstream's own name


@dataclass
class Recording:
    """Keeps every call an upstream answered: `calls[i] = (ids sent, Sample)`, the sample's prompt ids as a list: a
    kept view of a session's `TokenLog` would keep that log from being freed when its rollout closes (`drain`)."""

    inner: PolicyClient
    calls: list[tuple[list[int], Sample]] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return self.inner.base_url

    @property
    def prefix_stats(self) -> Any:
        """The inner client's, where it has them (the proxy's /stats shows them)."""
        return getattr(self.inner, "prefix_stats", None)

    async def complete(self, prompt_ids: Sequence[int], sampling: SamplingParams, *,
                       session_id: str | None = None) -> Sample:
        sample = await self.inner.complete(prompt_ids, sampling, session_id=session_id)
        self.calls.append((list(prompt_ids), dataclasses.replace(sample, prompt_ids=list(sample.prompt_ids))))
        return sample

    async def stream(self, prompt_ids: Sequence[int], sampling: SamplingParams, *,
                     session_id: str | None = None) -> AsyncIterator[Chunk]:
        joined = StreamedSample(list(prompt_ids))
        async for chunk in self.inner.stream(prompt_ids, sampling, session_id=session_id):
            joined.add(chunk)
            yield chunk
        self.calls.append((list(prompt_ids), joined.sample()))

    async def models(self) -> list[str]:
        return await self.inner.models()

    async def load_weights(self, path: str, version: int) -> None:
        await self.inner.load_weights(path, version)

    async def aclose(self) -> None:
        await self.inner.aclose()


@dataclass
class Scripted:
    """A fake upstream that answers each call with the next scripted text, as sampled tokens."""

    tokenizer: Any
    replies: list[str] = field(default_factory=list)
    base_url: str = "scripted://"
    version: int = 7
    token_delay_s: float = 0.0  # between streamed tokens
    sent: list[list[int]] = field(default_factory=list)  # the prompt ids of every call, in order
    streams_closed_early: int = 0
    yielded: int = 0  # tokens streamed so far, all calls
    gate: threading.Event | None = None  # when set up: a stream holds after `gate_after` tokens until it is set
    gate_after: int = 0
    stops: tuple[str, ...] = ("<|im_end|>",)  # the model family's stop tokens; the first ends a text without one

    async def complete(self, prompt_ids: Sequence[int], sampling: SamplingParams, *,
                       session_id: str | None = None) -> Sample:
        self.sent.append(list(prompt_ids))
        text = self.replies.pop(0) if self.replies else "ok"
        ends = {self.tokenizer.convert_tokens_to_ids(t) for t in self.stops}
        ids = self.tokenizer.encode(text, add_special_tokens=False)  # a text may end with its own stop token
        ids = (ids + ([] if ids and ids[-1] in ends else [self.tokenizer.convert_tokens_to_ids(self.stops[0])])
               )[:sampling.max_tokens]
        finish = "stop" if len(ids) and ids[-1] in ends else "length"
        return Sample(prompt_ids=list(prompt_ids), output_ids=ids, output_logprobs=[-0.25] * len(ids),
                      text=self.tokenizer.decode(ids, skip_special_tokens=True), finish_reason=finish,
                      policy_version=self.version)

    async def stream(self, prompt_ids: Sequence[int], sampling: SamplingParams, *,
                     session_id: str | None = None) -> AsyncIterator[Chunk]:
        sample = await self.complete(prompt_ids, sampling, session_id=session_id)
        finished = False
        try:
            for i, token in enumerate(sample.output_ids):
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                while self.gate is not None and i == self.gate_after and not self.gate.is_set():
                    await asyncio.sleep(0.005)
                self.yielded += 1
                last = i == len(sample.output_ids) - 1
                yield Chunk([token], [sample.output_logprobs[i]], self.tokenizer.decode([token]), sample.policy_version,
                            finish_reason=sample.finish_reason if last else None)
            finished = True
        finally:
            self.streams_closed_early += not finished

    async def models(self) -> list[str]:
        return ["scripted"]

    async def load_weights(self, path: str, version: int) -> None:
        self.version = version

    async def aclose(self) -> None:
        pass


def call(url: str, payload: Any = None, *, key: str | None = None, data: bytes | None = None,
         headers: dict[str, str] | None = None, method: str | None = None) -> http.Reply:
    """One HTTP call with an optional Bearer key; the reply's body is decoded JSON."""
    if payload is not None:
        data = json.dumps(payload).encode()
    head = {"Content-Type": "application/json", **(headers or {})}
    if key:
        head["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, headers=head, method=method or ("POST" if data is not None else "GET"))
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    return http.Reply(status, {}, json.loads(raw) if raw else None)


@dataclass
class Harness:
    """A running proxy, the store it writes, and what its upstream answered."""

    proxy: RunningProxy
    store: Store
    upstream: Any

    @property
    def url(self) -> str:
        return self.proxy.url

    def open(self, **body: Any) -> dict[str, Any]:
        r = http.post(self.url + "/rollouts", body)
        assert r.status == 201, r.body
        return r.body

    def close(self, rollout: dict[str, Any], **body: Any) -> http.Reply:
        body = body or {"status": "completed", "reward": 1.0}
        return call(f"{self.url}/rollouts/{rollout['rollout_id']}/close", body, key=rollout["api_key"])

    def turns(self, rollout_id: str) -> list[dict[str, Any]]:
        sql = "SELECT * FROM turns WHERE rollout_id = ? ORDER BY time, writer_seq"
        return self.store.query(sql, [rollout_id]).to_pylist()

    def requests(self, rollout_id: str) -> list[Any]:
        """The rollout's turns' requests whole, as values, in `turns` order (a request stored as a delta of its
        session's previous call's is resolved: `trajstore.requests`)."""
        turns = self.turns(rollout_id)
        full = resolve(self.store, [t["event_id"] for t in turns])
        return [json.loads(full[t["event_id"]]) for t in turns]

    def count(self, kind: str = "turn") -> int:
        return self.store.query("SELECT count(*) AS n FROM events WHERE kind = ?", [kind]).to_pylist()[0]["n"]


@contextmanager
def running_proxy(upstream: Any, store_dir: Path, model_dir: Path, **config: Any) -> Iterator[Harness]:
    """A proxy on a loopback port in front of `upstream` (a Recording is given its client in the loop)."""
    def factory() -> PolicyClient:
        return upstream

    settings = ProxyConfig(model_dir=str(model_dir), run="test", model_names=(MODEL,), **config)
    store = open_store(store_dir)
    with serve_proxy_in_thread(factory, store, settings) as proxy:
        yield Harness(proxy, store, upstream)


def openai_client(rollout: dict[str, Any], **kw: Any) -> openai.OpenAI:
    """The real OpenAI SDK pointed at one rollout: only its base URL and key."""
    return openai.OpenAI(base_url=rollout["base_urls"]["openai"], api_key=rollout["api_key"], max_retries=0, **kw)


def async_openai_client(rollout: dict[str, Any]) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=rollout["base_urls"]["openai"], api_key=rollout["api_key"], max_retries=0)


def anthropic_client(rollout: dict[str, Any], **kw: Any) -> anthropic.Anthropic:
    """The real Anthropic SDK pointed at one rollout: only its base URL and key."""
    return anthropic.Anthropic(base_url=rollout["base_urls"]["anthropic"], api_key=rollout["api_key"], max_retries=0,
                               **kw)


def assert_exact(h: Harness, rollout_id: str, turns: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Stored turns == the server's samples, and each segment's tokens chain to the ids sent upstream."""
    turns = h.turns(rollout_id) if turns is None else turns
    by_output = {tuple(s.output_ids): (sent, s) for sent, s in h.upstream.calls}
    held: dict[str, list[int]] = {}
    for t in turns:
        sent, sample = by_output[tuple(t["output_ids"])]
        assert t["output_ids"] == sample.output_ids
        assert t["output_logprobs"] == pytest.approx(sample.output_logprobs, rel=1e-6, abs=1e-6)
        assert t["policy_version"] == sample.policy_version
        assert t["output_version_starts"] == sample.version_starts  # spans when the weights changed mid-call
        assert t["output_version_values"] == sample.version_values
        prefix = held.get(t["segment_id"], []) if t["turn_index"] else []
        assert prefix + t["prompt_ids"] == sent == sample.prompt_ids
        held[t["segment_id"]] = sent + t["output_ids"]
    return turns
