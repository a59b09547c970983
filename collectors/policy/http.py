"""The HTTP side of every policy-server client: its connections, vLLM's `/v1/completions` body, named errors.

Requests to a plain-http server go over kept-alive asyncio connections (`collectors.policy.connections`,
a third of aiohttp's CPU per request); streams, and https servers, over one aiohttp session.

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

Bodies are JSON written and read with orjson: a prompt of 80k token ids is 0.4 ms there and
7.5 ms with the standard library (5 ms to read back an echoed prompt), per call. A prompt given
as `TokenIds` (a session's ids with their JSON kept beside them, `collectors.policy.token_ids`)
is written as its ready JSON, so only the ids new since the session's last call are encoded;
nothing per call walks the prompt (the reply is checked against its length). Where a request
or a reply is still large (a prompt of millions of tokens), the encoding or decoding runs on a
thread, so that the event loop the caller serves other work from is never held by one call's size.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import json
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode, urlsplit

import aiohttp
import numpy as np
import orjson
from multidict import CIMultiDict

from collectors.errors import CollectorError
from collectors.policy.connections import (
    ConnectFailed,
    Connections,
    Disconnected,
    Malformed,
)
from collectors.policy.contract import Chunk, Sample, SamplingParams, support_from_sets
from collectors.policy.token_ids import PACKED_FIELD, PackedIds, TokenIds
from collectors.policy.versions import Label, Spans, parse_spans
from trajstore.events import SUPPORT_IDS_CAP


class PolicyServerError(CollectorError):
    """A policy server could not serve a call. `status` and `server_message` when it answered."""

    def __init__(self, message: str, *, url: str, status: int | None = None,
                 server_message: str | None = None, server_code: str | None = None) -> None:
        super().__init__(message)
        self.url, self.status, self.server_message = url, status, server_message
        self.server_code = server_code  # the error body's `code` where it is a name, not the status


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


OFF_LOOP_BYTES = 1 << 20  # a body past this is encoded or decoded on a thread (tens of ms of CPU at the sizes seen)
OFF_LOOP_TOKENS = OFF_LOOP_BYTES // 6  # a token id takes about 6 bytes of JSON


def _ready(value: Any) -> Any:
    """What orjson writes for a value it does not know: token ids' ready JSON (see the module docstring)."""
    if isinstance(value, (TokenIds, PackedIds)):
        return value.fragment()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _plain(value: Any) -> Any:
    if isinstance(value, PackedIds):
        return value.text()
    return list(value) if isinstance(value, TokenIds) else int(value)


def dumps(body: Any) -> bytes:
    """JSON of a request body (orjson; the standard library for what orjson refuses, such as huge integers)."""
    try:
        return orjson.dumps(body, default=_ready)
    except TypeError:  # numbers orjson cannot write: past 64 bits, or numpy's
        return json.dumps(body, default=_plain).encode()


def loads(data: bytes | str) -> Any:
    """Parse JSON (orjson; the standard library for what orjson refuses, such as NaN); ValueError if not JSON."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


async def encoded(body: Any) -> bytes:
    """`dumps(body)`, on a thread when its token-id prompt is long."""
    prompt = body.get("prompt", body.get(PACKED_FIELD)) if isinstance(body, dict) else None
    if isinstance(prompt, TokenIds):  # only the tail is encoded
        prompt = prompt.tail
    if isinstance(prompt, PackedIds):  # only what its log has not packed yet
        if prompt.pending > OFF_LOOP_TOKENS:
            return await asyncio.to_thread(dumps, body)
    elif isinstance(prompt, list) and len(prompt) > OFF_LOOP_TOKENS:
        return await asyncio.to_thread(dumps, body)
    return dumps(body)


@dataclass(frozen=True)
class Reply:
    status: int
    headers: CIMultiDict[str]
    raw: bytes

    @property
    def text(self) -> str:
        return self.raw.decode("utf-8", errors="replace")


def server_code(text: str) -> str | None:
    """The `code` of vLLM's error body `{"error": {"code"}}` where it is a string (a refusal to act on)."""
    try:
        body = loads(text)
    except ValueError:
        return None
    err = body.get("error") if isinstance(body, dict) else None
    code = err.get("code") if isinstance(err, dict) else None
    return code if isinstance(code, str) else None


def server_message(text: str) -> str:
    """The human part of an error body: vLLM's `{"error": {"message"}}`, its older flat
    `{"message"}`, the dev routes' `{"error": "..."}`, FastAPI's `{"detail"}`, or the raw text."""
    try:
        body = loads(text)
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
    """A server's connections: `Connections` for plain-http requests, one aiohttp session for streams and https
    (each created on first use, in the caller's loop); transport failures and HTTP errors become the named
    errors. `unavailable_retries` counts 503s retried."""

    def __init__(self, base_url: str, *, hint: str, timeout_s: float, connect_retries: int,
                 retry_backoff_s: float, max_connections: int) -> None:
        self.base_url, self.hint, self.timeout_s = base_url, hint, timeout_s
        self.connect_retries, self.retry_backoff_s = connect_retries, retry_backoff_s
        self.max_connections = max_connections
        self.unavailable_retries = 0
        self._session: aiohttp.ClientSession | None = None
        url = urlsplit(base_url)
        # plain http goes through `Connections` (a third of aiohttp's CPU per request); https through aiohttp
        self._plain = (url.hostname, url.port or 80, url.netloc.rpartition("@")[2], url.path.rstrip("/")) \
            if url.scheme == "http" and url.hostname else None
        self._conns: tuple[asyncio.AbstractEventLoop, Connections] | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # limit=0: no cap; the collector bounds its own concurrency
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.max_connections))
        return self._session

    def _connections(self) -> Connections | None:
        """The kept-alive connections of this event loop (a loop's connections serve no other), or None for https."""
        if self._plain is None:
            return None
        loop = asyncio.get_running_loop()
        if self._conns is None or self._conns[0] is not loop:
            host, port, host_header, _ = self._plain
            self._conns = (loop, Connections(host, port, host_header, self.max_connections))
        return self._conns[1]

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
            raise self._refused(method, route, reply.status, reply.text)
        return reply

    async def _call_once(self, method: str, route: str, *, body: Any, params: Mapping[str, str] | None,
                         headers: Mapping[str, str] | None, timeout: float, limit: float,
                         idempotent: bool) -> Reply:
        url = self.base_url + route
        data = None if body is None else await encoded(body)
        if data is not None:
            headers = {"Content-Type": "application/json", **(headers or {})}
        attempts = 1 + (self.connect_retries if idempotent else 0)
        attempt, stale_retried = 0, False
        conns = self._connections()
        while True:
            try:
                if conns is not None and self._plain is not None:
                    target = self._plain[3] + route + (f"?{urlencode(params)}" if params else "")
                    async with asyncio.timeout(timeout):
                        status, head, raw = await conns.request(method, target, headers, data)
                    return Reply(status, head, raw)
                async with self._get_session().request(method, url, data=data, params=params, headers=headers,
                                                       timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                    return Reply(resp.status, CIMultiDict(resp.headers), await resp.read())
            except (aiohttp.ClientConnectorError, ConnectFailed) as exc:  # nothing was sent: retry where idempotent
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
            except (aiohttp.ServerDisconnectedError, Disconnected) as exc:
                if not stale_retried:  # an idle pooled connection the server had closed: once more (module doc)
                    stale_retried = True
                    continue
                raise PolicyServerUnreachable(
                    f"the policy server at {self.base_url} closed the connection during {method} {route} "
                    f"({exc}); {self.hint}", url=self.base_url) from exc
            except (aiohttp.ClientError, Malformed) as exc:
                raise PolicyServerUnreachable(
                    f"the connection to the policy server at {self.base_url} failed during {method} {route} "
                    f"({type(exc).__name__}: {exc}); {self.hint}", url=self.base_url) from exc

    def _refused(self, method: str, route: str, status: int, text: str) -> PolicyServerError:
        said = server_message(text)
        kind = PolicyServerFailed if status >= 500 else PolicyServerRejected
        what = "failed" if status >= 500 else "refused"
        return kind(f'the policy server at {self.base_url} {what} {method} {route} ({status}): "{said}"',
                    url=self.base_url, status=status, server_message=said, server_code=server_code(text))

    async def events(self, route: str, *, body: Any,
                     headers: Mapping[str, str] | None = None) -> AsyncIterator[tuple[CIMultiDict[str], Any]]:
        """POST a streamed request; yield (response headers, JSON of each `data:` event) until `data: [DONE]`.

        Each read waits at most the client's timeout (a long generation is fine while tokens keep coming).
        Closing the iterator closes the connection, which stops the request on vLLM and the embedded server.
        A `data: {"error": ...}` event (vLLM's mid-stream failure) raises `PolicyServerFailed`."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout_s, sock_read=self.timeout_s)
        try:
            async with self._get_session().post(self.base_url + route, data=await encoded(body),
                                                headers={"Content-Type": "application/json", **(headers or {})},
                                                timeout=timeout) as resp:
                if resp.status >= 400:
                    raise self._refused("POST", route, resp.status, await resp.text(errors="replace"))
                head, pending = CIMultiDict(resp.headers), b""
                async for received in resp.content.iter_any():  # whatever arrived: often several events at once
                    *lines, pending = (pending + received).split(b"\n")
                    for raw in lines:
                        if not raw.startswith(b"data:"):
                            continue
                        data = raw[5:].strip()
                        if data == b"[DONE]":
                            return
                        yield head, await self._event(route, data)
        except aiohttp.ClientConnectorError as exc:
            raise PolicyServerUnreachable(
                f"cannot connect to the policy server at {self.base_url} ({exc.os_error.strerror or exc}); "
                f"{self.hint}", url=self.base_url) from exc
        except TimeoutError as exc:
            raise PolicyServerTimeout(f"the policy server at {self.base_url} sent nothing on POST {route} for "
                                      f"{self.timeout_s:g} s; it may be overloaded or stuck",
                                      url=self.base_url) from exc
        except aiohttp.ClientError as exc:
            raise PolicyServerUnreachable(
                f"the connection to the policy server at {self.base_url} failed during the stream of POST {route} "
                f"({type(exc).__name__}: {exc}); {self.hint}", url=self.base_url) from exc
        raise PolicyServerUnreachable(f"the stream of POST {route} from the policy server at {self.base_url} ended "
                                      "without `data: [DONE]` (the server went away mid-stream?)", url=self.base_url)

    async def _event(self, route: str, data: bytes) -> Any:
        """One streamed event's JSON; vLLM's mid-stream failure `{"error": ...}` raises `PolicyServerFailed`."""
        try:
            event = await asyncio.to_thread(loads, data) if len(data) > OFF_LOOP_BYTES else loads(data)
        except ValueError:
            text = data.decode("utf-8", errors="replace")
            raise PolicyServerBadResponse(f"the policy server at {self.base_url} streamed an event that is not JSON "
                                          f"on {route}: {text[:200]!r}", url=self.base_url) from None
        if isinstance(event, dict) and event.get("error") is not None:
            said = server_message(data.decode("utf-8", errors="replace"))
            raise PolicyServerFailed(f'the policy server at {self.base_url} failed during the stream of POST {route}: '
                                     f'"{said}"', url=self.base_url, server_message=said)
        return event

    async def parsed(self, reply: Reply, route: str) -> Any:
        """`json(reply, route)`, on a thread when the reply is large (an echoed prompt of millions of tokens)."""
        if len(reply.raw) > OFF_LOOP_BYTES:
            return await asyncio.to_thread(self.json, reply, route)
        return self.json(reply, route)

    def json(self, reply: Reply, route: str) -> Any:
        try:
            return loads(reply.raw)
        except ValueError:
            raise PolicyServerBadResponse(
                f"the policy server at {self.base_url} answered {route} with something that is not JSON "
                f"({reply.headers.get('Content-Type', 'no content type')}): {reply.text[:200]!r}",
                url=self.base_url) from None

    async def close(self) -> None:
        if self._conns is not None:
            self._conns[1].close()
            self._conns = None
        if self._session is not None:
            await self._session.close()
            self._session = None


def completion_body(prompt_ids: Sequence[int], sampling: SamplingParams, model: str | None, *,
                    echo_prompt: bool = True) -> dict[str, Any]:
    """The /v1/completions request for one token-id prompt; `echo_prompt=False` asks a server that knows
    `return_prompt_token_ids` (the embedded one) not to send the prompt's ids back (vLLM ignores it and does)."""
    body: dict[str, Any] = {
        "prompt": prompt_ids, "max_tokens": sampling.max_tokens, "temperature": sampling.temperature,
        "top_p": sampling.top_p, "top_k": sampling.top_k, "stop": list(sampling.stop),
        "logprobs": sampling.logprobs or 0, "return_token_ids": True,
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
    if not echo_prompt:
        body["return_prompt_token_ids"] = False
    return body


def _tokens(choice: dict[str, Any], url: str,
            top: bool) -> tuple[list[int], list[float], list[dict[str, float]] | None]:
    """The sampled ids, their logprobs and (when asked) the top alternatives of one choice, checked."""
    def bad(problem: str) -> PolicyServerBadResponse:
        return PolicyServerBadResponse(f"the policy server at {url} {problem}", url=url)

    ids = choice.get("token_ids")
    if ids is None:
        raise bad("returned no `token_ids` although the request set `return_token_ids: true`; vLLM returns them "
                  "from version 0.10.2 on (older servers ignore the field): pip install -U 'vllm>=0.10.2'")
    lp = choice.get("logprobs")
    logprobs = lp.get("token_logprobs") if isinstance(lp, dict) else None
    if logprobs is None and ids:
        raise bad("returned no `logprobs.token_logprobs` although the request set `logprobs`; a policy server "
                  "must return the logprob of every sampled token (run vLLM with --logprobs-mode processed_logprobs)")
    logprobs = logprobs or []
    if not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
        raise bad(f"returned `token_ids` that are not a list of integers: {str(ids)[:200]}")
    if not (isinstance(logprobs, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                               for x in logprobs)):
        raise bad(f"returned `token_logprobs` that are not a list of numbers: {str(logprobs)[:200]}")
    if len(ids) != len(logprobs):
        raise bad(f"returned {len(ids)} token ids but {len(logprobs)} logprobs; they must pair up one to one")
    alternatives = lp.get("top_logprobs") if top and isinstance(lp, dict) else None
    if top and ids and not (isinstance(alternatives, list) and len(alternatives) == len(ids)
                            and all(isinstance(a, dict) for a in alternatives)):
        raise bad("returned no `logprobs.top_logprobs` (one {token: logprob} per sampled token) although the "
                  "request asked for the top alternatives")
    tops = [{str(k): float(v) for k, v in a.items()} for a in alternatives or []] if top else None
    return ids, [float(x) for x in logprobs], tops


def _support(choice: dict[str, Any], url: str, tokens: int | None) -> tuple[list[int] | None, list[int] | None]:
    """The choice's kept sets as (support_sizes, support_ids), checked: the embedded server's CSR fields, or
    vLLM's `sampling_mask` (one list of kept ids per token); (None, None) when the server sent neither.
    `tokens`: how many sizes there must be (None: a stream's chunk, whose sets may come with a later one)."""
    def bad(problem: str) -> PolicyServerBadResponse:
        return PolicyServerBadResponse(f"the policy server at {url} returned {problem}", url=url)

    def ids_list(value: Any) -> bool:
        return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                               for t in value)

    mask = choice.get("sampling_mask")
    if mask is not None:
        if not (isinstance(mask, list) and all(ids_list(kept) for kept in mask)):
            raise bad(f"a `sampling_mask` that is not a list of lists of token ids: {str(mask)[:200]}")
        sizes, ids = support_from_sets(mask)
    else:
        sizes, ids = choice.get("support_sizes"), choice.get("support_ids")
        if sizes is None and ids is None:
            return None, None
        if not (ids_list(sizes) and ids_list(ids)):
            raise bad("`support_sizes` and `support_ids` that are not both lists of non-negative integers")
        if sum(m for m in sizes if m <= SUPPORT_IDS_CAP) != len(ids):
            raise bad(f"{len(ids)} `support_ids` for kept sets whose sizes of at most {SUPPORT_IDS_CAP} add up to "
                      f"{sum(m for m in sizes if m <= SUPPORT_IDS_CAP)}")
    if tokens is not None and len(sizes) != tokens:
        raise bad(f"kept sets for {len(sizes)} tokens but {tokens} sampled tokens; they must pair up one to one")
    return sizes, ids


def _check_echo(choice: dict[str, Any], prompt_ids: Sequence[int], url: str) -> None:
    echoed = choice.get("prompt_token_ids")
    if echoed is not None and echoed != prompt_ids:
        raise PolicyServerBadResponse(
            f"the policy server at {url} sampled from a different prompt than it was sent ({len(echoed)} tokens "
            f"echoed, {len(prompt_ids)} sent); the stored turn would not match what the model saw", url=url)


def _first_choice(body: Any, url: str) -> dict[str, Any]:
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise PolicyServerBadResponse(f"the policy server at {url} returned a completion without choices: "
                                      f"{json.dumps(body)[:200]}", url=url)
    return choices[0]


def _spans(choice: dict[str, Any], n_tokens: int, label: Label | None, url: str) -> Spans | None:
    """The choice's `weight_versions` when the caller reads them (`label`) and the server sent them."""
    value = choice.get("weight_versions")
    if label is None or value is None:
        return None
    spans = parse_spans(value, n_tokens, label)
    if isinstance(spans, str):
        raise PolicyServerBadResponse(f"the policy server at {url} answered with unusable version spans: {spans}",
                                      url=url)
    return spans


def parse_completion(body: Any, prompt_ids: Sequence[int], *, policy_version: int, url: str,
                     top_logprobs: bool = False, label: Label | None = None) -> Sample:
    """A `Sample` from a /v1/completions response, or `PolicyServerBadResponse` naming what is missing.
    With `label`, the choice's `weight_versions` spans (when sent) stamp the tokens instead of `policy_version`."""
    choice = _first_choice(body, url)
    ids, logprobs, tops = _tokens(choice, url, top_logprobs)
    _check_echo(choice, prompt_ids, url)
    support_sizes, support_ids = _support(choice, url, len(ids))
    usage = body.get("usage")
    counted = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    if choice.get("prompt_token_ids") is None and isinstance(counted, int) and counted != len(prompt_ids):
        raise PolicyServerBadResponse(  # no echo to compare: its count of the prompt is what is left to check
            f"the policy server at {url} sampled from a prompt of {counted} tokens but was sent {len(prompt_ids)}; "
            "the stored turn would not match what the model saw", url=url)
    spans = _spans(choice, len(ids), label, url) if ids else None
    if spans is not None:
        policy_version = spans[1][0]
    mixed = spans is not None and len(spans[1]) > 1
    text, finish = choice.get("text"), choice.get("finish_reason")
    if not isinstance(text, str) or not isinstance(finish, str):
        raise PolicyServerBadResponse(f"the policy server at {url} returned a choice without `text` or "
                                      f"`finish_reason`: {json.dumps(choice)[:200]}", url=url)
    return Sample(prompt_ids=prompt_ids, output_ids=ids, output_logprobs=logprobs, text=text,
                  finish_reason=finish, policy_version=policy_version, stop_reason=choice.get("stop_reason"),
                  top_logprobs=tops, routed_experts=routed_experts(choice, url, len(prompt_ids) + len(ids)),
                  support_sizes=support_sizes, support_ids=support_ids,
                  version_starts=spans[0] if mixed else None, version_values=spans[1] if mixed else None)


def routed_experts(choice: dict[str, Any], url: str, tokens: int | None = None) -> np.ndarray | None:
    """A choice's `routed_experts` (vLLM's, from a server started with --enable-return-routed-experts; the embedded
    server's for MoE models): base64 `.npy` of `[fed tokens, layers, top_k]` expert indices, as int16; None when
    the server sent none. `tokens`: prompt + output, when known (a stream's last event does not know it)."""
    text = choice.get("routed_experts")
    if text is None:
        return None
    try:
        routes = np.load(io.BytesIO(base64.b64decode(text, validate=True)), allow_pickle=False)
    except (TypeError, ValueError, binascii.Error, OSError) as exc:
        raise PolicyServerBadResponse(f"the policy server at {url} returned `routed_experts` that are not base64 "
                                      f".npy bytes ({exc})", url=url) from exc
    if routes.ndim != 3 or routes.dtype.kind not in "iu" or (tokens is not None and len(routes) > tokens):
        raise PolicyServerBadResponse(f"the policy server at {url} returned `routed_experts` of shape {routes.shape} "
                                      f"({routes.dtype}); expected integer expert indices [at most prompt + output "
                                      "tokens, layers, top_k]", url=url)
    if routes.size and routes.max() > np.iinfo(np.int16).max:
        raise PolicyServerBadResponse(f"the policy server at {url} routes to expert {routes.max()}, beyond what "
                                      "the store keeps (int16)", url=url)
    return routes.astype(np.int16, copy=False)


def parse_chunk(event: Any, prompt_ids: Sequence[int], *, policy_version: int, url: str,
                top_logprobs: bool = False, label: Label | None = None, n_before: int = 0) -> Chunk | None:
    """A `Chunk` from one event of a streamed /v1/completions response (vLLM's CompletionStreamResponse);
    None for the usage event, which has no choices."""
    if isinstance(event, dict) and event.get("choices") == []:
        return None
    choice = _first_choice(event, url)
    ids, logprobs, tops = _tokens(choice, url, top_logprobs)
    _check_echo(choice, prompt_ids, url)
    finish = choice.get("finish_reason")
    support_sizes, support_ids = _support(choice, url, None)
    spans = _spans(choice, n_before + len(ids), label, url)  # over the whole output, on the last chunk
    return Chunk(output_ids=ids, output_logprobs=logprobs, text=str(choice.get("text") or ""),
                 policy_version=policy_version, top_logprobs=tops, finish_reason=finish,
                 stop_reason=choice.get("stop_reason"), routed_experts=routed_experts(choice, url),
                 support_sizes=support_sizes, support_ids=support_ids,
                 version_starts=spans[0] if spans else None, version_values=spans[1] if spans else None)


def prompt_list(prompt_ids: Sequence[int]) -> list[int] | TokenIds:
    """The prompt as sent and kept in the `Sample`: `TokenIds` as they are (read-only already), a list copied
    (what a tokenizer gives: ints), anything else (arrays, tensors) converted per item: int() over 80k ids is
    milliseconds per call, the copy a tenth of one."""
    if isinstance(prompt_ids, TokenIds):
        ids: list[int] | TokenIds = prompt_ids
    else:
        ids = prompt_ids[:] if type(prompt_ids) is list else [int(t) for t in prompt_ids]
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
