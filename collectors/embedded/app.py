"""The embedded policy server (`trajstore serve`): vLLM's completions API subset over aiohttp.

Routes (request and response JSON in `collectors.embedded.protocol`):

    POST /v1/completions    one prompt (text, token ids, or packed token ids) -> sampled tokens, logprobs,
                            version (streamed too)
    GET  /v1/models         the served model, vLLM's model card shape
    GET  /health            200 while the engine runs
    GET  /stats             the engine's counters (requests, prefill/decode steps, batch peak)
    POST /v1/load_weights   {"path": DIR, "version": N}: hot reload; loopback callers only, or, when the
                            server has a control token, callers sending `Authorization: Bearer TOKEN`;
                            or {"uri": URI, "digest": SHA256, "version": N[, "path": DIR]}: a published
                            version by its checkpoint event's location, fetched by the server itself

Every response carries `X-Policy-Version`; a completion's is the version that sampled its
tokens, elsewhere the version being served. Errors are OpenAI-style bodies with a message
that names the problem; no request can stop the server, and none can fail another: every
field is range-checked before a request joins a batch.

Limits: a body of at most `MAX_BODY` bytes (a 100k-token prompt is under 1 MB of JSON),
decoded, and a long text prompt tokenized, off the event loop (`collectors.serving`);
`load_weights` takes JSON only, no other site's `Origin`, and versions up to 2^63 - 1 (they
are stored as int64 with every turn). Without a control token it answers loopback callers only;
with one (`trajstore serve --control-token`, for collectors on other machines reloading a
policy-server host) it answers any caller that sends the token, and no caller without it,
loopback included. The token is compared in constant time; it travels in clear over HTTP,
so keep the control route on a private network.

A version named by `uri` + `digest` (a collector on another host than this server, or than the
learner) is resolved with `trajstore.artifacts.local_copy`: `path` when this host's disk holds
the announced directory there, else a copy fetched from `uri` into this server's checkpoint
cache (`serve --checkpoint-cache`) and checked file by file against the manifest `digest` names.
Only then is anything loaded: a malformed uri or digest is a 400, an unfinished, damaged or
replaced upload a 422, an unreachable store a 502, a version not above the served one a 409 (before
any download), and after each the server keeps serving the version it had. A caller holding the
token can make the server read any location its credentials reach (as `path` already lets it
load any directory on its disk).

`serve_in_thread` (tests, notebooks) and `start_server` (inside a running event loop) start
it in-process on a loopback port of the OS's choosing; `run` is the blocking CLI entry.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import ipaddress
import json
import logging
import time
import uuid
from collections.abc import Iterator
from contextlib import aclosing, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from collectors.embedded.engine import Completion, Engine
from collectors.embedded.prefix_cache import DEFAULT_BUDGET, PrefixCache
from collectors.embedded.protocol import (
    PACKED_FIELD,
    PREFIX_FIELD,
    CompletionJob,
    RequestError,
    check_prompt,
    completion_logprobs,
    completion_response,
    error_body,
    parse_completion_request,
    remember,
    stream_event,
    usage_event,
    with_prefix,
)
from collectors.errors import EngineError, VersionConflict, WeightLoadError
from collectors.model.detokenize import IncrementalText
from collectors.serving import (
    BadRequest,
    ClientGone,
    app_in_thread,
    bearer_token,
    check_control,
    read_json,
    run_until_interrupted,
    start_app,
)
from trajstore import ArtifactError, artifacts
from trajstore.announcement import BadLoadRequest, LoadRequest

log = logging.getLogger(__name__)
ENGINE = web.AppKey("engine", Engine)
MODEL_NAME = web.AppKey("model_name", str)
CONTROL_TOKEN = web.AppKey("control_token", str)  # "" when none: loopback callers only
CHECKPOINT_CACHE = web.AppKey("checkpoint_cache", Path)  # copies of versions fetched by URI
PREFIX_CACHE = web.AppKey("prefix_cache", PrefixCache)  # sessions' ids for `prompt_prefix` (budget 0: off)
MIN_TOKEN_CHARS = 16
MAX_BODY = 8 << 20
TOKENIZE_OFF_LOOP_CHARS = 64 << 10  # longer text prompts are tokenized on a worker thread


def _json(data: Any, status: int = 200, version: int | None = None) -> web.Response:
    headers = {"X-Policy-Version": str(version)} if version is not None else None
    return web.json_response(data, status=status, headers=headers, dumps=lambda d: json.dumps(d, allow_nan=False))


def _error(exc: RequestError, version: int) -> web.Response:
    return _json(exc.body(), status=exc.status, version=version)


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Route, size and unexpected failures become OpenAI-style JSON errors; the server keeps serving."""
    version = request.app[ENGINE].policy_version
    try:
        return await handler(request)
    except RequestError as exc:
        return _error(exc, version)
    except BadRequest as exc:
        return _error(RequestError(exc.message, status=exc.status), version)
    except ClientGone as exc:  # nobody is left to answer
        log.info("%s", exc)
        return _error(RequestError(str(exc)), version)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = {404: "NotFoundError", 405: "MethodNotAllowed", 413: "RequestTooLarge"}.get(exc.status, "BadRequestError")
        message = f"{request.method} {request.path}: {exc.reason}"
        if exc.status == 404:
            message += "; routes: POST /v1/completions, GET /v1/models, GET /health, GET /stats, POST /v1/load_weights"
        return _json(error_body(message, kind, None, exc.status), status=exc.status, version=version)
    except Exception as exc:  # noqa: BLE001 - a bug in one request must not stop the server
        log.exception("unexpected error serving %s %s", request.method, request.path)
        return _json(error_body(f"internal error: {type(exc).__name__}: {exc}", "InternalServerError", None, 500),
                     status=500, version=version)


async def completions(request: web.Request) -> web.Response:
    engine, model_name = request.app[ENGINE], request.app[MODEL_NAME]
    job = parse_completion_request(await read_json(request, MAX_BODY))
    if job.model is not None and job.model != model_name:
        raise RequestError(f"The model `{job.model}` does not exist; this server serves `{model_name}` "
                           "(see GET /v1/models)", param="model", status=404, kind="NotFoundError")
    cache = request.app[PREFIX_CACHE]
    job = with_prefix(job, cache)
    if isinstance(job.prompt, str):
        encode = functools.partial(engine.tokenizer.encode, job.prompt, add_special_tokens=True)
        prompt_ids = await asyncio.to_thread(encode) if len(job.prompt) > TOKENIZE_OFF_LOOP_CHARS else encode()
    else:
        prompt_ids = job.prompt
    check_prompt(prompt_ids, job.params, vocab_size=engine.vocab_size, max_model_len=engine.max_model_len,
                 max_id=job.prompt_max_id, param=job.prompt_field)
    if job.stream:
        return await _stream(request, engine, job, prompt_ids, model_name)
    try:
        result = await engine.agenerate(prompt_ids, job.params)
    except EngineError as exc:
        raise RequestError(str(exc), status=503, kind="ServiceUnavailableError") from exc
    if result.finish_reason != "abort":
        remember(job, cache, prompt_ids, result.output_ids)
    tokenizer = engine.tokenizer
    body = completion_response(job, result, model_name=model_name,
                               decode_one=lambda t: tokenizer.decode([t], skip_special_tokens=False))
    return _json(body, version=result.policy_version)


def _sse(data: Any) -> bytes:
    return f"data: {json.dumps(data, allow_nan=False)}\n\n".encode()


async def _stream(request: web.Request, engine: Engine, job: CompletionJob, prompt_ids: list[int],
                  model_name: str) -> web.StreamResponse:
    """A streamed completion: one event per token as the engine samples it (see `collectors.embedded.protocol`).

    The response starts with the first token, so its X-Policy-Version header is the version that
    sampled it; each event's `policy_version` is that of its tokens. A client that goes away stops the request: the engine drops its row."""
    params, tokenizer = job.params, engine.tokenizer
    decode_one = lambda t: tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
    detok = IncrementalText(lambda ids: tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens))
    hold_chars = max(map(len, params.stop), default=1) - 1  # text that may still become a stop string
    maybe_stop = set(params.stop_token_ids) | (set() if params.ignore_eos else engine.eos_ids)
    request_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    response: web.StreamResponse | None = None
    sent_text, sent_tokens, sampled = "", 0, []  # sampled: (id, logprob, top) in order
    pushed = 0  # sampled[:pushed] are in `detok`

    async def send(version: int, text: str, final: Completion | None = None) -> None:
        nonlocal response, sent_text, sent_tokens
        first = response is None
        if response is None:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                                   "X-Policy-Version": str(version)})
            await response.prepare(request)
        upto = len(sampled)  # ids go out at once; only their text may wait
        new = sampled[sent_tokens:upto]
        ids = [t for t, _, _ in new]
        logprobs = completion_logprobs(ids, [lp for _, lp, _ in new], [top or [] for _, _, top in new], decode_one,
                                       offset=len(sent_text)) if params.logprobs is not None else None
        event = stream_event(job, request_id, created, model_name, version, text, ids, logprobs,
                             prompt_ids=prompt_ids if first else None,
                             finish_reason=final.finish_reason if final else None,
                             stop_reason=final.stop_reason if final else None, final=final)
        await response.write(_sse(event))
        sent_text, sent_tokens = sent_text + text, upto

    try:
        async with aclosing(engine.astream(prompt_ids, params)) as tokens:
            async for item in tokens:
                if isinstance(item, Completion):
                    rest = item.text[len(sent_text):] if item.text.startswith(sent_text) else ""
                    await send(item.spans()[1][-1], rest, item)  # the last tokens' version
                    if item.finish_reason != "abort":  # what the caller got: the ids of every event
                        remember(job, request.app[PREFIX_CACHE], prompt_ids, [t for t, _, _ in sampled])
                    if job.include_usage:
                        await response.write(_sse(usage_event(request_id, created, model_name, len(prompt_ids),
                                                              len(item.output_ids))))
                    break
                token, logprob, top, version = item
                sampled.append((token, logprob, top))
                # the newest token may be the last (a stop token, or the end of a stop string): the next one shows
                releasable = len(sampled) - (1 if params.stop or token in maybe_stop else 0)
                for held, _, _ in sampled[pushed:releasable]:
                    detok.push(held)
                pushed = releasable
                text = detok.text[:max(len(sent_text), len(detok.text) - hold_chars)][len(sent_text):]
                await send(version, text)
    except EngineError as exc:
        if response is None:
            raise RequestError(str(exc), status=503, kind="ServiceUnavailableError") from exc
        await response.write(_sse(error_body(str(exc), "ServiceUnavailableError", None, 503)))
    except ConnectionResetError:
        log.info("the client of a streamed completion went away; its request was stopped")
        return response or web.Response(status=499)
    assert response is not None
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def models(request: web.Request) -> web.Response:
    engine, name = request.app[ENGINE], request.app[MODEL_NAME]
    card = {"id": name, "object": "model", "created": int(time.time()), "owned_by": "trajstore", "root": engine.model_dir,
            "parent": None, "max_model_len": engine.max_model_len, "permission": [],
            "policy_version": engine.policy_version, **_forms(request)}
    return _json({"object": "list", "data": [card]}, version=engine.policy_version)


def _forms(request: web.Request) -> dict[str, bool]:
    """The prompt forms taken besides vLLM's (`collectors.embedded.protocol`), announced for clients to ask."""
    return {PACKED_FIELD: True, **({PREFIX_FIELD: True} if request.app[PREFIX_CACHE].budget else {})}


async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    return _json({"status": "ok", "policy_version": engine.policy_version, **_forms(request)},
                 version=engine.policy_version)


async def stats(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    body = {**asdict(engine.stats), "running": engine.running, "waiting": engine.waiting,
            "reload_pending": engine.reload_pending, "policy_version": engine.policy_version,
            "device": str(engine.device), "max_batch": engine.max_batch,
            "prefix_cache": request.app[PREFIX_CACHE].as_json()}
    return _json(body, version=engine.policy_version)


def _is_loopback(remote: str | None) -> bool:
    try:
        return remote is not None and ipaddress.ip_address(remote.split("%")[0]).is_loopback
    except ValueError:
        return False


async def load_weights(request: web.Request) -> web.Response:
    engine, token = request.app[ENGINE], request.app[CONTROL_TOKEN]
    if token:
        given = bearer_token(request)
        if given is None or not hmac.compare_digest(given.encode(), token.encode()):
            raise RequestError("load_weights needs this server's control token: send `Authorization: Bearer TOKEN` "
                               "(the --control-token the server was started with; `trajstore collect` sends its "
                               "--control-token)", status=401, kind="AuthenticationError")
    elif not _is_loopback(request.remote):
        raise RequestError(f"load_weights is served to loopback callers only (this call came from {request.remote}); "
                           "call it on the server's machine, or start the server with --control-token TOKEN and "
                           "send that token", status=403, kind="PermissionDeniedError")
    check_control(request)
    try:
        load = LoadRequest.from_body(await read_json(request, MAX_BODY))
    except BadLoadRequest as exc:
        raise RequestError(str(exc), param=exc.param) from exc
    if load.published:
        loaded = await _load_published(engine, request.app[CHECKPOINT_CACHE], load)
    else:
        loaded = await _load(engine, str(load.path), load.version)  # from_body: without a uri, a path
    return _json({"status": "ok", "policy_version": engine.policy_version, "path": loaded},
                 version=engine.policy_version)


async def _load(engine: Engine, path: str, version: int) -> str:
    """Load directory `path` of this host as `version`; a refusal is a RequestError, the old weights keep serving."""
    try:
        await asyncio.get_running_loop().run_in_executor(None, engine.load_weights, path, version)
    except VersionConflict as exc:
        raise RequestError(str(exc), param="version", status=409, kind="ConflictError") from exc
    except WeightLoadError as exc:
        raise RequestError(str(exc), param="path") from exc
    except EngineError as exc:
        raise RequestError(str(exc), status=503, kind="ServiceUnavailableError") from exc
    return path


async def _load_published(engine: Engine, cache: Path, load: LoadRequest) -> str:
    """Load the version published at `load.uri`: `load.path` when this host holds the announced directory there,
    else a verified copy fetched into `cache` (`trajstore.artifacts.local_copy`)."""
    uri, version = str(load.uri), load.version
    try:
        engine.check_newer(version)  # before any download
    except VersionConflict as exc:
        raise RequestError(str(exc), param="version", status=409, kind="ConflictError") from exc
    still = f"still serving version {engine.policy_version}"
    try:
        local = await asyncio.to_thread(artifacts.local_copy, load.path, uri, str(load.digest), cache)
    except ValueError as exc:
        raise RequestError(f"{exc}; {still}", param="uri") from exc
    except ArtifactError as exc:
        raise RequestError(f"{exc}; {still}", param="uri", status=422, kind="UnprocessableEntityError") from exc
    except OSError as exc:  # the object store is unreachable or refuses, or the cache cannot be written
        raise RequestError(f"could not fetch {uri} into this server's checkpoint cache {cache}: {exc}; {still}",
                           param="uri", status=502, kind="BadGatewayError") from exc
    return await _load(engine, str(local), version)


def check_token(token: str | None) -> None:
    if token is not None and (len(token) < MIN_TOKEN_CHARS or not token.isprintable() or " " in token):
        raise ValueError(f"the control token must be at least {MIN_TOKEN_CHARS} printable characters without spaces "
                         "(e.g. `python -c 'import secrets; print(secrets.token_urlsafe())'`)")


def create_app(engine: Engine, model_name: str | None = None, control_token: str | None = None,
               checkpoint_cache: str | Path | None = None,
               prefix_cache_tokens: int = DEFAULT_BUDGET) -> web.Application:
    """The server's routes over `engine`; versions named by URI are fetched into `checkpoint_cache`
    (default `trajstore.artifacts.default_cache()`); sessions' ids are held up to `prefix_cache_tokens` ids."""
    check_token(control_token)
    app = web.Application(middlewares=[_errors], client_max_size=MAX_BODY)
    app[ENGINE] = engine
    app[CONTROL_TOKEN] = control_token or ""
    app[CHECKPOINT_CACHE] = Path(checkpoint_cache) if checkpoint_cache is not None else artifacts.default_cache()
    app[MODEL_NAME] = model_name or engine.model_dir
    app[PREFIX_CACHE] = PrefixCache(prefix_cache_tokens)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/stats", stats)
    app.router.add_post("/v1/load_weights", load_weights)
    return app


async def start_server(engine: Engine, host: str = "127.0.0.1", port: int = 0, model_name: str | None = None,
                       control_token: str | None = None, checkpoint_cache: str | Path | None = None,
                       prefix_cache_tokens: int = DEFAULT_BUDGET) -> tuple[web.AppRunner, str]:
    """Serve `engine` from the running event loop; port 0 takes a free one. Returns (runner, base URL)."""
    # a caller that went away (an agent stopped or timed out) frees its row in the batch at once
    return await start_app(create_app(engine, model_name, control_token, checkpoint_cache, prefix_cache_tokens),
                           host, port,
                           cancel_on_disconnect=True)


@dataclass
class RunningServer:
    url: str
    engine: Engine


@contextmanager
def serve_in_thread(model_dir: str | Path, *, host: str = "127.0.0.1", port: int = 0, model_name: str | None = None,
                    control_token: str | None = None, checkpoint_cache: str | Path | None = None,
                    prefix_cache_tokens: int = DEFAULT_BUDGET, **engine_options: Any) -> Iterator[RunningServer]:
    """Run the server on its own event-loop thread; yields the base URL and the engine.

        with serve_in_thread("tiny-model") as server:
            requests.post(server.url + "/v1/completions", json={"prompt": "hi"})
    """
    engine = Engine(model_dir, **engine_options)
    try:
        with app_in_thread(lambda: start_server(engine, host, port, model_name, control_token, checkpoint_cache,
                                                prefix_cache_tokens), name="trajstore-serve") as (_, url):
            yield RunningServer(url=url, engine=engine)
    finally:
        engine.close()


def run_server(model_dir: str | Path, *, host: str = "127.0.0.1", port: int = 8000, model_name: str | None = None,
               control_token: str | None = None, checkpoint_cache: str | Path | None = None,
               prefix_cache_tokens: int = DEFAULT_BUDGET, **engine_options: Any) -> None:
    """Serve until interrupted (the `trajstore serve` command)."""
    check_token(control_token)  # before the model loads
    engine = Engine(model_dir, **engine_options)
    try:
        run_until_interrupted(
            lambda: start_server(engine, host, port, model_name, control_token, checkpoint_cache, prefix_cache_tokens),
            lambda _, url: f"serving {engine.model_dir} (policy version {engine.policy_version}) on {url} "
                           f"[device {engine.device}, max batch {engine.max_batch}]",
        )
    finally:
        engine.close()
