"""The HTTP side of every policy-server client: one aiohttp session, vLLM's `/v1/completions` body, named errors.

A token-id prompt goes to POST /v1/completions with `return_token_ids: true` and `logprobs: 0`
(vLLM always returns the logprob of the sampled token; N > 0 would add the top N
alternatives, which nobody here reads), and the engine's own ids, logprobs, text, finish and
stop reasons come back as a `Sample`. Nothing is re-tokenized.

Errors are the named `PolicyServerError`s below (unreachable, timeout, 4xx, 5xx, malformed
response). Connection failures (nothing was sent) are retried on idempotent control routes
only, never on completions. A pooled connection the server closed while idle (uvicorn, which
vLLM runs on, drops keep-alive connections after 5 s) can fail a request before any answer;
that is retried once on a fresh connection, completions included (an unanswered completion
was never stored, and a second one is only a new draw). A 503 is retried with exponential backoff (50 ms doubling to 2 s)
until the call's timeout where the caller allows it (completions do): vLLM answers 503 ("try
again later") when admitting a request would pass its queue limit (`--max-num-queued-reqs`),
before the request reaches the engine, so nothing was sampled and a retry is safe.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from multidict import CIMultiDict

from collectors.errors import CollectorError
from collectors.policy.contract import Sample, SamplingParams


class PolicyServerError(CollectorError):
    """A policy server could not serve a call. `status` and `server_message` when it answered."""

    def __init__(self, message: str, *, url: str, status: int | None = None,
                 server_message: str | None = None) -> None:
        super().__init__(message)
        self.url, self.status, self.server_message = url, status, server_message


class PolicyServerUnreachable(PolicyServerError):
    """No connection to the server, or it dropped the connection mid-call."""


class PolicyServerTimeout(PolicyServerError):
    """The server did not answer within the client's timeout."""


class PolicyServerRejected(PolicyServerError):
    """The server refused the request (4xx); `server_message` says why."""


class PolicyServerFailed(PolicyServerError):
    """The server failed (5xx)."""


class PolicyServerBadResponse(PolicyServerError):
    """The server answered 2xx with something that is not a usable completion."""


@dataclass(frozen=True)
class Reply:
    status: int
    headers: CIMultiDict[str]
    text: str


def server_message(text: str) -> str:
    """The human part of an error body: vLLM's `{"error": {"message"}}`, its older flat
    `{"message"}`, the dev routes' `{"error": "..."}`, FastAPI's `{"detail"}`, or the raw text."""
    try:
        body = json.loads(text)
    except ValueError:
        return text.strip()[:500]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        for value in (err, body.get("message"), body.get("detail")):
            if isinstance(value, str):
                return value
    return text.strip()[:500]



UNAVAILABLE_BACKOFF_S = (0.05, 2.0)  # first pause after a 503, and the longest


class Http:
    """One aiohttp session (created on first use, in the caller's loop); transport failures
    and HTTP errors become the named errors. `unavailable_retries` counts 503s retried."""

    def __init__(self, base_url: str, *, hint: str, timeout_s: float, connect_retries: int,
                 retry_backoff_s: float, max_connections: int) -> None:
        self.base_url, self.hint, self.timeout_s = base_url, hint, timeout_s
        self.connect_retries, self.retry_backoff_s = connect_retries, retry_backoff_s
        self.max_connections = max_connections
        self.unavailable_retries = 0
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # limit=0: no cap; the collector bounds its own concurrency
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.max_connections))
        return self._session

    async def call(self, method: str, route: str, *, body: Any = None, params: Mapping[str, str] | None = None,
                   headers: Mapping[str, str] | None = None, timeout_s: float | None = None,
                   idempotent: bool = False, retry_unavailable: bool = False) -> Reply:
        timeout = timeout_s or self.timeout_s
        deadline, pause = time.monotonic() + timeout, UNAVAILABLE_BACKOFF_S[0]
        while True:
            reply = await self._call_once(method, route, body=body, params=params, headers=headers,
                                          timeout=max(deadline - time.monotonic(), 0.001), limit=timeout,
                                          idempotent=idempotent)
            if reply.status != 503 or not retry_unavailable or time.monotonic() + pause > deadline:
                break
            self.unavailable_retries += 1
            await asyncio.sleep(pause)
            pause = min(pause * 2, UNAVAILABLE_BACKOFF_S[1])
        if reply.status >= 400:
            said = server_message(reply.text)
            kind = PolicyServerFailed if reply.status >= 500 else PolicyServerRejected
            what = "failed" if reply.status >= 500 else "refused"
            raise kind(f'the policy server at {self.base_url} {what} {method} {route} ({reply.status}): "{said}"',
                       url=self.base_url, status=reply.status, server_message=said)
        return reply

    async def _call_once(self, method: str, route: str, *, body: Any, params: Mapping[str, str] | None,
                         headers: Mapping[str, str] | None, timeout: float, limit: float,
                         idempotent: bool) -> Reply:
        url = self.base_url + route
        attempts = 1 + (self.connect_retries if idempotent else 0)
        attempt, stale_retried = 0, False
        while True:
            try:
                async with self._get_session().request(method, url, json=body, params=params, headers=headers,
                                                       timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                    return Reply(resp.status, CIMultiDict(resp.headers), await resp.text(errors="replace"))
            except aiohttp.ClientConnectorError as exc:  # nothing was sent: safe to retry where idempotent
                if attempt + 1 < attempts:
                    await asyncio.sleep(self.retry_backoff_s * 2**attempt)
                    attempt += 1
                    continue
                raise PolicyServerUnreachable(
                    f"cannot connect to the policy server at {self.base_url} ({exc.os_error.strerror or exc}); "
                    f"{self.hint}", url=self.base_url) from exc
            except TimeoutError as exc:
                raise PolicyServerTimeout(
                    f"the policy server at {self.base_url} did not answer {method} {route} within {limit:g} s; "
                    "it may be overloaded or stuck, or the call needs a longer timeout (timeout_s=...)",
                    url=self.base_url) from exc
            except aiohttp.ServerDisconnectedError as exc:
                if not stale_retried:  # an idle pooled connection the server had closed: once more (module doc)
                    stale_retried = True
                    continue
                raise PolicyServerUnreachable(
                    f"the policy server at {self.base_url} closed the connection during {method} {route} "
                    f"({exc}); {self.hint}", url=self.base_url) from exc
            except aiohttp.ClientError as exc:
                raise PolicyServerUnreachable(
                    f"the connection to the policy server at {self.base_url} failed during {method} {route} "
                    f"({type(exc).__name__}: {exc}); {self.hint}", url=self.base_url) from exc

    def json(self, reply: Reply, route: str) -> Any:
        try:
            return json.loads(reply.text)
        except ValueError:
            raise PolicyServerBadResponse(
                f"the policy server at {self.base_url} answered {route} with something that is not JSON "
                f"({reply.headers.get('Content-Type', 'no content type')}): {reply.text[:200]!r}",
                url=self.base_url) from None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def completion_body(prompt_ids: list[int], sampling: SamplingParams, model: str | None) -> dict[str, Any]:
    """The /v1/completions request for one token-id prompt."""
    body: dict[str, Any] = {
        "prompt": prompt_ids, "max_tokens": sampling.max_tokens, "temperature": sampling.temperature,
        "top_p": sampling.top_p, "top_k": sampling.top_k, "stop": list(sampling.stop),
        "logprobs": 0, "return_token_ids": True,
    }
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    # the rest only where they differ from vLLM's defaults: the common body stays what it was
    if sampling.stop_token_ids:
        body["stop_token_ids"] = list(sampling.stop_token_ids)
    for name, default in (("ignore_eos", False), ("skip_special_tokens", True), ("include_stop_str_in_output", False)):
        if getattr(sampling, name) != default:
            body[name] = getattr(sampling, name)
    if model is not None:
        body["model"] = model
    return body


def parse_completion(body: Any, prompt_ids: list[int], *, policy_version: int, url: str) -> Sample:
    """A `Sample` from a /v1/completions response, or `PolicyServerBadResponse` naming what is missing."""
    def bad(problem: str) -> PolicyServerBadResponse:
        return PolicyServerBadResponse(f"the policy server at {url} {problem}", url=url)

    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise bad(f"returned a completion without choices: {json.dumps(body)[:200]}")
    choice = choices[0]
    ids = choice.get("token_ids")
    if ids is None:
        raise bad("returned no `token_ids` although the request set `return_token_ids: true`; vLLM returns them "
                  "from version 0.10.2 on (older servers ignore the field): pip install -U 'vllm>=0.10.2'")
    lp = choice.get("logprobs")
    logprobs = lp.get("token_logprobs") if isinstance(lp, dict) else None
    if logprobs is None:
        raise bad("returned no `logprobs.token_logprobs` although the request set `logprobs: 0`; a policy server "
                  "must return the logprob of every sampled token (run vLLM with --logprobs-mode processed_logprobs)")
    if not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
        raise bad(f"returned `token_ids` that are not a list of integers: {str(ids)[:200]}")
    if not (isinstance(logprobs, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                               for x in logprobs)):
        raise bad(f"returned `token_logprobs` that are not a list of numbers: {str(logprobs)[:200]}")
    if len(ids) != len(logprobs):
        raise bad(f"returned {len(ids)} token ids but {len(logprobs)} logprobs; they must pair up one to one")
    echoed = choice.get("prompt_token_ids")
    if echoed is not None and echoed != prompt_ids:
        raise bad(f"sampled from a different prompt than it was sent ({len(echoed)} tokens echoed, "
                  f"{len(prompt_ids)} sent); the stored turn would not match what the model saw")
    text, finish = choice.get("text"), choice.get("finish_reason")
    if not isinstance(text, str) or not isinstance(finish, str):
        raise bad(f"returned a choice without `text` or `finish_reason`: {json.dumps(choice)[:200]}")
    return Sample(prompt_ids=prompt_ids, output_ids=ids, output_logprobs=[float(x) for x in logprobs], text=text,
                  finish_reason=finish, policy_version=policy_version, stop_reason=choice.get("stop_reason"))


def prompt_list(prompt_ids: Sequence[int]) -> list[int]:
    ids = [int(t) for t in prompt_ids]
    if not ids:
        raise ValueError("prompt_ids is empty; a completion needs at least one prompt token")
    return ids


def session_headers(session_id: str | None) -> dict[str, str] | None:
    return {"X-Session-ID": session_id} if session_id else None  # vLLM's router: one session, one server


def port_of(url: str) -> str:
    return str(urlsplit(url).port or 8000)



async def list_models(http: Http) -> list[str]:
    body = http.json(await http.call("GET", "/v1/models", idempotent=True), "/v1/models")
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list) or not all(isinstance(c, dict) and isinstance(c.get("id"), str) for c in data):
        raise PolicyServerBadResponse(f"the policy server at {http.base_url} returned a model list without "
                                      f"`data[].id`: {json.dumps(body)[:200]}", url=http.base_url)
    return [card["id"] for card in data]
