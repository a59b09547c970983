"""The capture proxy (`trajstore proxy`): OpenAI and Anthropic chat APIs in front of a policy server.

An unmodified agent points its SDK at the proxy; every model call is rendered with the chat
template, sampled upstream from token ids, answered in the agent's protocol and stored as a
token-exact `turn` event (`collectors.proxy.capture`). Routes:

    POST /rollouts                      {run?, group_id?, rollout_id?, group_size?, meta?} -> {rollout_id,
                                        group_id, run, api_key, base_urls: {openai, anthropic}, session_header}
    POST /rollouts/{id}/close           {status, reward? | rewards? {name: value}, error?, meta?}; the rollout's key
    GET  /rollouts/{id}                 its sessions, segments, turns and forks; the rollout's key
    POST /v1/chat/completions           OpenAI Chat Completions (stream too)      \\
    POST /v1/responses                  OpenAI Responses (stream too)              |
    POST /v1/responses/input_tokens     its input token count                      | also under /r/{key}/...
    POST /v1/messages                   Anthropic Messages (stream too)            |
    POST /v1/messages/count_tokens      its input token count                      |
    GET  /v1/models                     the accepted model names (OpenAI and      /
                                        Anthropic list shapes in one)
    GET|HEAD /, /r/{key}                 200 (agents such as Claude Code probe their base URL)
    GET  /stats                         counters: turns, forks by reason, histories by how they were
                                        reconciled, streams the agent left, errors, rollouts, calls
                                        waiting for an unreachable policy server (`upstream`), how
                                        long turns waited to be durable (`durable_wait`, ms), the
                                        piece cache's hits (`piece_cache`, `collectors.proxy.piece_cache`),
                                        and with the embedded server, calls sent as a held prefix
                                        (`prompt_prefix`)
    GET  /health
    POST /seal                          {} -> {sealed}: seal the turns appended so far into the store's table now
                                        (it is done every `--seal-interval` and every 64 MB anyway): other
                                        machines see them, and a benchmark can charge a seal to the calls whose
                                        turns it writes

Point an SDK at one rollout with what `POST /rollouts` returned (see `collectors.proxy.sessions` for
keys and sub-agent sessions):

    OpenAI(base_url=r["base_urls"]["openai"], api_key=r["api_key"])
    Anthropic(base_url=r["base_urls"]["anthropic"], api_key=r["api_key"])
    OPENAI_BASE_URL=... OPENAI_API_KEY=... / ANTHROPIC_BASE_URL=... ANTHROPIC_API_KEY=...  (agent CLIs)

The rollout routes are for the orchestrator: bind the proxy to loopback or a private network.
They take JSON only and no other site's `Origin` (no browser page can open or close a
rollout), and check a whole request before changing anything: a close with a NaN reward or
an empty reward name is a 400 and the rollout stays open for a valid close. Bodies are at most
`MAX_BODY` bytes, decoded off the event loop when large (`collectors.serving`).
A streamed call streams from the policy server: its tokens reach the agent as they are
sampled, and its last event is sent once the turn is durable (see `collectors.proxy.capture`
for what happens when the agent leaves mid-stream). Every failure under a rollout's base URL,
unknown routes included, is answered in the protocol's own error shape (Anthropic's under
/v1/messages or for a client that sends `anthropic-version`, OpenAI's otherwise), and no
message ever repeats a key from the URL.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import re
import time
from collections.abc import Callable, Iterator
from contextlib import aclosing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from collectors.policy import PolicyClient
from collectors.proxy.body_splice import read_session_body
from collectors.proxy.capture import Capture
from collectors.proxy.chat import ChatError, ChatRequest, is_int
from collectors.proxy.protocol import SESSION_HEADER, split_key
from collectors.model.toolcalls import FORMATS
from collectors.proxy.render import ChatRenderer
from collectors.proxy.sessions import Rollout
from collectors.proxy.upstream import OUTAGE_WAIT_S
from collectors.proxy.wire import WIRES, AnthropicMessages, OpenAIChat, WireProtocol
from collectors.proxy.workers import WORKER, WorkerInfo, worker_key_prefix
from collectors.serving import (
    BODY,
    BadRequest,
    ClientGone,
    app_in_thread,
    bearer_token,
    check_control,
    header_text,
    read_json,
    read_json_text,
    run_until_interrupted,
    start_app,
)
from trajstore import Store, open_store
from trajstore.schema import TERMINAL_STATUSES
from trajstore.tokens import INT32_MAX as MAX_GROUP_SIZE  # stored as int32 with every status event

log = logging.getLogger(__name__)
MAX_BODY = 16 << 20  # a whole 128k-token conversation with its tools is a few MB of JSON


@dataclass(frozen=True)
class ProxyConfig:
    """Settings of one proxy; `problems()` lists everything wrong at once."""

    model_dir: str
    run: str = "default"
    writer: str | None = None  # None: `proxy-<host>-<pid>-<spool id>`, unique across machines (trajstore.owner)
    model_names: tuple[str, ...] = ()  # accepted `model` values besides the upstream's names; "*": any
    max_model_len: int | None = None  # default: the checkpoint's max_position_embeddings
    default_max_tokens: int = 4096
    seal_interval: float = 60.0  # seconds before appended turns are sealed (visible to other machines)
    upstream_wait_s: float = OUTAGE_WAIT_S  # how long a call waits for an unreachable policy server
    tool_format: str | None = None  # hermes | llama3 | harmony; None: read from the chat template
    render: str = "local"  # local: the proxy's chat template and parser; vllm: vLLM's (collectors.proxy.vllm_render)
    whole_requests: bool = False  # store every turn's request whole, never as a delta (collectors.proxy.request_delta)

    def check(self) -> None:
        """Raise ValueError naming every problem at once."""
        problems = self.problems()
        if problems:
            raise ValueError("invalid proxy settings: " + "; ".join(problems))

    def problems(self) -> list[str]:
        out = []
        if not (Path(self.model_dir) / "config.json").is_file():
            out.append(f"--model {self.model_dir} is not a Hugging Face checkpoint (no config.json); pass the "
                       "directory the policy server serves")
        if self.max_model_len is not None and self.max_model_len < 2:
            out.append(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.tool_format is not None and self.tool_format not in FORMATS:
            out.append(f"tool_format must be one of {', '.join(FORMATS)} (or unset: read from the chat template), "
                       f"got {self.tool_format!r}")
        if self.default_max_tokens < 1:
            out.append(f"default_max_tokens must be at least 1, got {self.default_max_tokens}")
        if not 0 <= self.upstream_wait_s < float("inf"):
            out.append(f"upstream_wait_s must be zero or a positive number of seconds, got {self.upstream_wait_s}")
        if self.render not in ("local", "vllm"):
            out.append(f"render must be 'local' or 'vllm', got {self.render!r}")
        if not 0 < self.seal_interval < float("inf"):
            out.append(f"seal_interval must be a positive number of seconds, got {self.seal_interval}")
        return out


@dataclass
class ProxyState:
    capture: Capture
    config: ProxyConfig
    names: list[str]  # accepted model names: the configured ones, then the upstream's

    async def check_model(self, model: str | None) -> None:
        if "*" in self.config.model_names or model in self.names:
            return
        if not self.names[len(self.config.model_names):]:
            self.names.extend(await _served_names(self.capture.client))
            if model in self.names:
                return
        served = ", ".join(map(repr, self.names))
        raise ChatError(f"The model `{model}` does not exist here; this proxy serves {served} "
                        "(GET /v1/models). To accept another name, start it with --model-name NAME (or '*').",
                        status=404, kind="not_found", param="model")


STATE = web.AppKey("proxy_state", ProxyState)


def json_answer(value: Any, status: int = 200) -> web.Response:
    """A JSON response written with orjson: a chat reply of a few kB takes the standard library's encoder (what
    `web.json_response` uses) ten times as long. Non-finite numbers are written as null (the standard library
    writes `NaN`, which is not JSON); what orjson refuses (integers past 64 bits) the standard library writes."""
    try:
        body = orjson.dumps(value)
    except TypeError:
        body = json.dumps(value).encode()
    return web.Response(body=body, status=status, content_type="application/json", charset="utf-8")


async def _served_names(client: PolicyClient) -> list[str]:
    try:
        return await asyncio.wait_for(client.models(), 10)
    except Exception as exc:  # noqa: BLE001 - the proxy starts before its upstream; retried per request
        log.warning("could not list the policy server's models at %s: %s", client.base_url, exc)
        return []


WIRE = web.RequestKey("wire", WireProtocol)  # the protocol of the route serving a request
_OPENAI, _ANTHROPIC = OpenAIChat(), AnthropicMessages()
_KEY_IN_PATH = re.compile(r"/r/[^/]+")


def _wire_of(request: web.Request) -> WireProtocol:
    """The protocol a failure is answered in: the route's, else Anthropic's for its paths and clients."""
    if WIRE in request:
        return request[WIRE]
    path = _KEY_IN_PATH.sub("", request.path, count=1)
    if path.startswith("/v1/messages") or "anthropic-version" in request.headers:
        return _ANTHROPIC
    return _OPENAI


def shown_path(request: web.Request) -> str:
    """The request's path as a message may show it: a rollout key in the URL is never repeated."""
    return _KEY_IN_PATH.sub("/r/{key}", request.path, count=1)


def _error(request: web.Request, err: ChatError) -> web.Response:
    if STATE in request.app:
        request.app[STATE].capture.stats.errors[err.status] += 1
    return json_answer(_wire_of(request).error_body(err), status=err.status)


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every failure answers in the protocol of the route: OpenAI's error shape, Anthropic's on /v1/messages."""
    try:
        return await handler(request)
    except ChatError as err:
        return _error(request, err)
    except BadRequest as exc:
        kind = {403: "permission", 413: "invalid_request", 415: "invalid_request"}.get(exc.status, "invalid_request")
        return _error(request, ChatError(exc.message, status=exc.status, kind=kind))
    except ClientGone as exc:  # nobody is left to answer: one line in the log, no traceback
        log.info("%s", exc)
        return _error(request, ChatError(str(exc)))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = {401: "authentication", 404: "not_found"}.get(exc.status, "invalid_request")
        hint = "; the routes under a rollout's base URL are " + ", ".join(
            f"POST {w.path}" for w in WIRES) + " and GET /v1/models" if exc.status in (404, 405) else ""
        return _error(request, ChatError(f"{request.method} {shown_path(request)}: {exc.reason}{hint}",
                                         status=exc.status, kind=kind))
    except Exception as exc:  # noqa: BLE001 - one bad call must not stop the proxy
        log.exception("unexpected error serving %s %s", request.method, shown_path(request))
        return _error(request, ChatError(f"internal error: {type(exc).__name__}: {exc}", status=500, kind="internal"))


async def _body(request: web.Request) -> Any:
    return await read_json(request, MAX_BODY)


async def _chat_request(request: web.Request, parse: Callable[[Any], ChatRequest], rollout: Rollout | None = None,
                        session: str = "", wire: WireProtocol | None = None) -> tuple[ChatRequest, Any]:
    """A chat route's request (parsed by `parse`) and its decoded body; the request knows the body's size, which
    spares `ChatRenderer.check_fits` counting the text of a body too small to be refused, and its text, which
    the turn stores as its `request` without writing the body's value again. With `rollout` (a call to sample),
    the body is decoded onto the session's last one (`collectors.proxy.body_splice`), which it then replaces."""
    if rollout is None or wire is None:
        body, text = await read_json_text(request, MAX_BODY)
        req = parse(body)
    else:
        body, text, last, spliced = await read_session_body(request, MAX_BODY, rollout.last_bodies.get(session),
                                                            wire.conversation)
        req = parse(body)
        if last is not None and not rollout.closed:  # a closed rollout keeps no body (its close dropped them)
            rollout.last_bodies[session] = last
        else:
            rollout.last_bodies.pop(session, None)
        request.app[STATE].capture.stats.bodies["spliced" if spliced else "whole"] += 1
    return dataclasses.replace(req, body_bytes=len(request[BODY]), body_json=text), body


def _header_keys(request: web.Request) -> list[str]:
    keys = [key for key in (bearer_token(request), (header_text(request, "x-api-key") or "").strip()) if key]
    return keys


def chat_route(wire: WireProtocol, *, count: bool = False) -> Callable[[web.Request], Any]:
    """The handler of `wire`'s route (or of its token-counting route): errors come in its own shape."""
    async def handler(request: web.Request) -> web.StreamResponse:
        request[WIRE] = wire
        return await (count_tokens(request, wire) if count else chat(request, wire))
    return handler


async def chat(request: web.Request, wire: WireProtocol) -> web.StreamResponse:
    state = request.app[STATE]
    capture = state.capture
    capture.stats.requests += 1
    rollout, session = capture.registry.resolve(request.match_info.get("key"), _header_keys(request),
                                                request.headers.get(SESSION_HEADER))
    req, body = await _chat_request(request, wire.parse_request, rollout, session, wire)
    await state.check_model(req.model)
    if not req.stream:
        _, answer = await capture.turn(rollout, session, req, body, wire)
        return json_answer(answer)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    async with aclosing(capture.stream_turn(rollout, session, req, body, wire)) as events:
        try:  # a ChatError before the first event is an ordinary error response (the middleware's)
            async for data in events:
                if not response.prepared:
                    await response.prepare(request)
                await response.write(data)
        except ConnectionResetError:  # the agent left: closing `events` stops the upstream, nothing is stored
            return response
    await response.write_eof()
    return response


async def count_tokens(request: web.Request, wire: WireProtocol) -> web.Response:
    """The input tokens of a request as it would be sent in its session now (Anthropic's count_tokens,
    the Responses API's input_tokens); nothing is sampled or stored."""
    state = request.app[STATE]
    rollout, session = state.capture.registry.resolve(request.match_info.get("key"), _header_keys(request),
                                                      request.headers.get(SESSION_HEADER))
    req, _ = await _chat_request(request, wire.parse_count)
    await state.check_model(req.model)
    return json_answer(wire.count_response(await state.capture.count_tokens(rollout, session, req)))


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if not state.names[len(state.config.model_names):]:
        state.names.extend(await _served_names(state.capture.client))
    now = int(time.time())
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))
    data = [{"id": n, "object": "model", "created": now, "owned_by": "trajstore", "type": "model", "display_name": n,
             "created_at": stamp} for n in state.names if n != "*"]
    return json_answer({"object": "list", "data": data, "has_more": False,
                              "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None})


def _optional(body: dict[str, Any], name: str, check: Callable[[Any], bool], expected: str) -> Any:
    value = body.get(name)
    if value is not None and not check(value):
        raise ChatError(f"`{name}` must be {expected}, got {value!r}", param=name)
    return value


_TEXT = (lambda v: isinstance(v, str) and 0 < len(v) <= 200, "a string of 1 to 200 characters")


async def open_rollout(request: web.Request) -> web.Response:
    capture = request.app[STATE].capture
    if request.can_read_body:
        check_control(request)
    body = await _body(request) if request.can_read_body else {}
    if not isinstance(body, dict):
        raise ChatError("the body must be a JSON object such as {\"group_id\": \"task-7\", \"group_size\": 8}")
    rollout = await capture.open_rollout(
        run=_optional(body, "run", *_TEXT), group_id=_optional(body, "group_id", *_TEXT),
        rollout_id=_optional(body, "rollout_id", *_TEXT),
        group_size=_optional(body, "group_size", lambda v: is_int(v) and 1 <= v <= MAX_GROUP_SIZE,
                             f"an integer from 1 to {MAX_GROUP_SIZE}"),
        meta=_optional(body, "meta", lambda v: isinstance(v, dict), "a JSON object"))
    origin = f"{request.scheme}://{request.host}"
    if WORKER in request.app:  # one of `--workers N`: the agent talks to this worker's own port, no hop
        _count_open(request.app)
        origin = str(request.url.with_port(request.app[WORKER].port).origin())
    return json_answer({
        "rollout_id": rollout.rollout_id, "group_id": rollout.group_id, "run": rollout.run, "api_key": rollout.key,
        "base_urls": {"openai": f"{origin}/r/{rollout.key}/v1", "anthropic": f"{origin}/r/{rollout.key}"},
        "session_header": SESSION_HEADER}, status=201)


def _count_open(app: web.Application) -> None:
    """A worker of `--workers N` tells the others how many rollouts it holds (new ones go to the least loaded)."""
    if WORKER in app:
        app[WORKER].board.set(app[WORKER].index, app[STATE].capture.registry.open_count)


def _owned_rollout(request: web.Request) -> Rollout:
    """The rollout in the path, if the caller holds its key."""
    registry, rollout_id = request.app[STATE].capture.registry, request.match_info["rollout_id"]
    for key in _header_keys(request):
        rollout = registry.by_key.get(split_key(key)[0])
        if rollout is not None and rollout.rollout_id == rollout_id:
            return rollout
    raise ChatError(f"send rollout {rollout_id}'s api_key (Authorization: Bearer KEY or x-api-key: KEY) to manage it",
                    status=401, kind="authentication")


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


async def close_rollout(request: web.Request) -> web.Response:
    """Validate the whole close first: nothing about the rollout changes for a request that is refused."""
    check_control(request)
    rollout = _owned_rollout(request)
    if rollout.closed:
        raise ChatError(f"rollout {rollout.rollout_id} is already closed (status {rollout.status})", status=409,
                        kind="conflict")
    body = await _body(request)
    if not isinstance(body, dict):
        raise ChatError('the body must be a JSON object such as {"status": "completed", "reward": 1.0}')
    rewards = dict(_optional(body, "rewards", lambda v: isinstance(v, dict) and all(
        _TEXT[0](k) and _finite(x) for k, x in v.items()),
        "an object of reward name (1 to 200 characters) -> finite number") or {})
    reward = _optional(body, "reward", _finite, "a finite number")
    if reward is not None:
        rewards["reward"] = reward
    status = body.get("status")
    if status not in TERMINAL_STATUSES:
        raise ChatError(f"`status` must be one of {', '.join(sorted(TERMINAL_STATUSES))}, got {status!r}",
                        param="status")
    summary = await request.app[STATE].capture.close_rollout(
        rollout, status=status, rewards={k: float(v) for k, v in rewards.items()},
        error=_optional(body, "error", lambda v: isinstance(v, str), "a string"),
        meta=_optional(body, "meta", lambda v: isinstance(v, dict), "a JSON object"))
    _count_open(request.app)
    return json_answer(summary)


async def get_rollout(request: web.Request) -> web.Response:
    return json_answer(_owned_rollout(request).summary())


async def stats(request: web.Request) -> web.Response:
    capture = request.app[STATE].capture
    return json_answer({**capture.stats.as_json(capture.registry.open_count),
                        "piece_cache": capture.renderer.piece_stats(),
                        "ascii_tokenizing": capture.renderer.ascii_stats()})


async def seal(request: web.Request) -> web.Response:
    """Seal this process's write-ahead log into the table now (on a thread: it writes Parquet and commits)."""
    check_control(request)
    writer = request.app[STATE].capture.writer
    try:
        sealed = await asyncio.to_thread(writer.seal)
    except Exception as exc:  # noqa: BLE001 - the object store failing, say: the log stays, the next seal retries
        log.warning("POST /seal failed: %s", exc)
        raise ChatError(f"sealing failed ({type(exc).__name__}: {exc}); every acknowledged turn stays in the "
                        "write-ahead log and the next seal retries", status=503, kind="overloaded") from exc
    return json_answer({"sealed": sealed})


async def health(request: web.Request) -> web.Response:
    if WORKER in request.app:  # this worker alone (the shared address merges every worker's)
        w = request.app[WORKER]
        return json_answer({"status": "ok", "worker": {"index": w.index, "generation": w.generation,
                                                             "pid": os.getpid(), "port": w.port}})
    return json_answer({"status": "ok"})


async def base_url(request: web.Request) -> web.Response:
    """GET or HEAD on a base URL: agents probe it before their first call (Claude Code sends HEAD)."""
    return json_answer({"status": "ok", "service": "trajstore capture proxy"})


def create_app(client_factory: Callable[[], PolicyClient], store: Store, config: ProxyConfig, *,
               worker: WorkerInfo | None = None) -> web.Application:
    """The proxy's aiohttp app; the upstream client is made inside the serving event loop. `worker`: this
    process is one of `proxy --workers N` (`collectors.proxy.workers`)."""
    from transformers import AutoTokenizer

    config.check()
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(config.model_dir), config.tool_format)
    max_len = config.max_model_len or int(json.loads((Path(config.model_dir) / "config.json").read_text())
                                          ["max_position_embeddings"])
    app = web.Application(middlewares=[_errors], client_max_size=MAX_BODY)
    if worker is not None:
        app[WORKER] = worker

    async def startup(app: web.Application) -> None:
        client = client_factory()
        kind: Any = Capture
        if config.render == "vllm":  # vLLM renders, samples and parses (checked before anything is opened)
            from collectors.proxy.vllm_render import vllm_capture
            kind = await vllm_capture(client)
        writer = store.writer(config.writer or store.unique_writer_name("proxy-"), seal_interval=config.seal_interval)
        capture = kind(client, renderer, writer, run=config.run, max_model_len=max_len,
                       default_max_tokens=config.default_max_tokens, stored=store.holds_rollout,
                       upstream_wait_s=config.upstream_wait_s, whole_requests=config.whole_requests)
        if worker is not None:
            capture.registry.key_prefix = worker_key_prefix(worker.index, worker.generation)
        names = [*config.model_names, *await _served_names(client)]
        app[STATE] = ProxyState(capture, config, names)

    async def cleanup(app: web.Application) -> None:
        capture = app[STATE].capture
        capture.close()
        await capture.client.aclose()
        await asyncio.to_thread(capture.writer.close)

    app.on_startup.append(startup)
    app.on_cleanup.append(cleanup)
    for prefix in ("", "/r/{key}"):
        for wire in WIRES:
            app.router.add_post(prefix + wire.path, chat_route(wire))
            if wire.count_path:
                app.router.add_post(prefix + wire.count_path, chat_route(wire, count=True))
        app.router.add_get(prefix + "/v1/models", models)
        app.router.add_get(prefix or "/", base_url)
    app.router.add_post("/rollouts", open_rollout)
    app.router.add_post("/rollouts/{rollout_id}/close", close_rollout)
    app.router.add_get("/rollouts/{rollout_id}", get_rollout)
    app.router.add_get("/stats", stats)
    app.router.add_get("/health", health)
    app.router.add_post("/seal", seal)
    return app


async def start_proxy(client_factory: Callable[[], PolicyClient], store: Store, config: ProxyConfig,
                      host: str = "127.0.0.1", port: int = 0) -> tuple[web.AppRunner, str]:
    """Serve from the running event loop; port 0 takes a free one. Returns (runner, base URL)."""
    return await start_app(create_app(client_factory, store, config), host, port)


@dataclass
class RunningProxy:
    url: str
    app: web.Application

    @property
    def capture(self) -> Capture:
        return self.app[STATE].capture


@contextmanager
def serve_proxy_in_thread(client_factory: Callable[[], PolicyClient], store: Store | str | Path,
                          config: ProxyConfig, *, host: str = "127.0.0.1", port: int = 0) -> Iterator[RunningProxy]:
    """Run the proxy on its own event-loop thread (tests, notebooks); yields its URL and state."""
    store = store if isinstance(store, Store) else open_store(store)
    with app_in_thread(lambda: start_proxy(client_factory, store, config, host, port),
                       name="trajstore-proxy") as (runner, url):
        yield RunningProxy(url, runner.app)


def open_rollout_command(url: str) -> str:
    """The shell command that opens a rollout on the proxy at `url` (the rollout routes take JSON only)."""
    return f"curl -s -X POST {url}/rollouts -H 'Content-Type: application/json' -d '{{\"group_id\": \"g1\"}}'"


def run_proxy(client_factory: Callable[[], PolicyClient], store_location: str, config: ProxyConfig, *,
        host: str = "127.0.0.1", port: int = 8100) -> None:
    """Serve until interrupted (the `trajstore proxy` command)."""
    config.check()
    store = open_store(store_location)
    orphans = store.seal_orphans()  # default names never repeat: what an earlier, killed proxy here acknowledged
    if any(orphans.values()):
        log.warning("sealed what stopped writers of this machine had left unsealed: %s", orphans)

    def banner(runner: web.AppRunner, url: str) -> str:
        capture = runner.app[STATE].capture
        return (f"capture proxy on {url} -> policy server {capture.client.base_url}, store {store_location}, "
                f"run {config.run!r}; open a rollout: {open_rollout_command(url)}")

    run_until_interrupted(lambda: start_proxy(client_factory, store, config, host, port), banner)
