"""True streaming through the capture proxy: pieces reach the agent while the policy server is still sampling,
the stored turn equals what was streamed, and an agent that leaves mid-stream stops the upstream request
and leaves nothing stored. Each protocol through its own SDK's streaming iterator."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from collectors.embedded.app import RunningServer
from tests.collectors.proxy_harness import (
    MODEL,
    Harness,
    Scripted,
    anthropic_client,
    assert_exact,
    call,
    openai_client,
    running_proxy,
)

REPLY = "<think>\nFirst a thought.\n</think>\n\nThe answer, in a few words, is forty two."


@pytest.fixture(scope="module")
def scripted(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    upstream = Scripted(AutoTokenizer.from_pretrained(tiny_model))
    with running_proxy(upstream, tmp_path_factory.mktemp("store"), tiny_model) as h:
        yield h


def _openai(rollout: dict[str, Any]) -> tuple[Iterator[str], Callable[[], None]]:
    stream = openai_client(rollout).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "q"}], max_tokens=200, stream=True)
    texts = (c.choices[0].delta.content or c.choices[0].delta.model_extra.get("reasoning_content") or ""
             for c in stream if c.choices)
    return texts, stream.close


def _anthropic(rollout: dict[str, Any]) -> tuple[Iterator[str], Callable[[], None]]:
    stream = anthropic_client(rollout).messages.create(
        model=MODEL, max_tokens=200, messages=[{"role": "user", "content": "q"}], stream=True)
    texts = (getattr(e.delta, "text", None) or getattr(e.delta, "thinking", "") for e in stream
             if e.type == "content_block_delta")
    return texts, stream.close


def _responses(rollout: dict[str, Any]) -> tuple[Iterator[str], Callable[[], None]]:
    stream = openai_client(rollout).responses.create(model=MODEL, input="q", max_output_tokens=200, stream=True)
    texts = (e.delta for e in stream if e.type in ("response.output_text.delta", "response.reasoning_text.delta"))
    return texts, stream.close


PROTOCOLS = {"openai": _openai, "anthropic": _anthropic, "responses": _responses}


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_pieces_arrive_while_the_upstream_samples_and_the_turn_equals_the_stream(scripted: Harness,
                                                                               protocol: str) -> None:
    up = scripted.upstream
    up.replies[:] = [REPLY]
    up.gate, up.gate_after = threading.Event(), 8  # the upstream holds after 8 tokens until the agent saw text
    rollout, yielded_before = scripted.open(), up.yielded
    try:
        texts, _ = PROTOCOLS[protocol](rollout)
        first = next(t for t in texts if t)
        total = len(up.tokenizer.encode(REPLY, add_special_tokens=False)) + 1
        # the agent has text while the upstream cannot have finished: it holds at the gate until the agent saw it
        assert 1 <= up.yielded - yielded_before <= up.gate_after < total
        up.gate.set()
        streamed = first + "".join(texts)
    finally:
        up.gate = None
    (turn,) = scripted.turns(rollout["rollout_id"])
    assert streamed == "First a thought.The answer, in a few words, is forty two."
    stored = json.loads(turn["response"])
    text = json.dumps(stored)
    assert "First a thought." in text and "The answer, in a few words, is forty two." in text
    assert json.loads(turn["meta"])["stream"] is True


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_an_agent_that_leaves_mid_stream_stops_the_upstream_and_stores_nothing(scripted: Harness,
                                                                              protocol: str) -> None:
    up = scripted.upstream
    up.replies[:] = [REPLY * 4]
    up.token_delay_s = 0.01
    before_closed, before = up.streams_closed_early, call(scripted.url + "/stats").body["stream_disconnects"]
    rollout = scripted.open()
    try:
        texts, close = PROTOCOLS[protocol](rollout)
        assert next(t for t in texts if t)
        close()
        for _ in range(300):
            if up.streams_closed_early > before_closed:
                break
            asyncio.run(asyncio.sleep(0.01))
    finally:
        up.token_delay_s = 0.0
    assert up.streams_closed_early == before_closed + 1
    assert call(scripted.url + "/stats").body["stream_disconnects"] == before + 1
    assert scripted.turns(rollout["rollout_id"]) == []
    summary = call(f"{scripted.url}/rollouts/{rollout['rollout_id']}", key=rollout["api_key"]).body
    assert summary["turns"] == 0  # the session is as it was: the next call starts it afresh
    up.replies[:] = ["ok"]
    openai_client(rollout).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "q"}])
    (turn,) = scripted.turns(rollout["rollout_id"])
    assert json.loads(turn["meta"])["history"] == "first" and turn["turn_index"] == 0


def test_the_embedded_server_stops_sampling_for_an_agent_that_left(proxy: Harness, server: RunningServer) -> None:
    rollout = proxy.open()
    engine = server.engine
    generated = engine.stats.generated_tokens
    with httpx.Client(timeout=60) as client, client.stream(
            "POST", rollout["base_urls"]["openai"] + "/chat/completions",
            headers={"Authorization": f"Bearer {rollout['api_key']}"},
            json={"model": MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": 1500, "stream": True,
                  "stop": ["never-appears"]}) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
    for _ in range(500):
        if engine.running == 0 and call(proxy.url + "/stats").body["stream_disconnects"]:
            break
        asyncio.run(asyncio.sleep(0.01))
    assert engine.running == 0 and engine.stats.generated_tokens - generated < 1500
    assert proxy.turns(rollout["rollout_id"]) == []


def test_streamed_text_and_logprobs_equal_the_stored_turn(proxy: Harness) -> None:
    rollout = proxy.open()
    chunks = list(openai_client(rollout).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me more."}], max_tokens=24, seed=9, stream=True,
        logprobs=True, top_logprobs=2, stream_options={"include_usage": True}))
    (turn,) = assert_exact(proxy, rollout["rollout_id"])
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    stored = json.loads(turn["response"])["choices"][0]
    assert text == stored["message"]["content"] and chunks[-1].usage.completion_tokens == len(turn["output_ids"])
    assert [e.logprob for e in entries] == pytest.approx(turn["output_logprobs"], abs=1e-6)
    assert [e.token for e in entries] == [e["token"] for e in stored["logprobs"]["content"]]
    assert all(1 <= len(e.top_logprobs) <= 2 for e in entries)
    assert all(a.logprob >= b.logprob for e in entries for a, b in zip(e.top_logprobs, e.top_logprobs[1:]))
