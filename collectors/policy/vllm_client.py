"""`VLLMClient`: vLLM's OpenAI-compatible server, with exact version stamping across reloads.

vLLM reports no policy version, so `VLLMClient` stamps the version it loaded last. That is exact because of how it
reloads:

- full weights (`reload="weights"`; vLLM started with VLLM_SERVER_DEV_MODE=1): the client
  stops sending, waits for its own in-flight completions, then POST /pause?mode=wait (vLLM
  drains every other caller's in-flight requests and schedules no new ones),
  /collective_rpc `reload_weights`, /reset_prefix_cache, /resume, and only then stamps the
  new version and sends again. No completion stamped N ever ran on weights other than N.
  One `VLLMClient` must own the reloads of a server: a reload from elsewhere would happen
  behind its back.
- runtime LoRA (`reload="lora"`; VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, --enable-lora): each
  version is loaded as its own adapter `{lora_prefix}-v{N}` and every request names its
  adapter in `model`, so the version is part of the request: in-flight requests keep
  sampling from their adapter while the next one loads, nothing is paused, and vLLM echoes
  the adapter name back, which the client checks.

Run vLLM >= 0.10.2 (`return_token_ids`) with `--logprobs-mode processed_logprobs`: by default
vLLM returns logprobs of the raw model output, not of the temperature/top-k/top-p
distribution the token was drawn from, and no HTTP route reveals the mode, so the client
cannot check it.

Reload failures are `WeightLoadError` / `VersionConflict`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Literal

from collectors.errors import VersionConflict, WeightLoadError
from collectors.policy.contract import Chunk, Sample, SamplingParams
from collectors.policy.http import (
    Http,
    PolicyServerBadResponse,
    PolicyServerError,
    PolicyServerFailed,
    PolicyServerRejected,
    Reply,
    completion_body,
    list_models,
    parse_chunk,
    parse_completion,
    port_of,
    prompt_list,
    session_headers,
)


class _DrainGate:
    """Completions run together; a reload runs alone. `reloading()` closes the gate to new
    completions and waits until the running ones are done. Cancellation-safe: no awaits on exit."""

    def __init__(self) -> None:
        self._open, self._idle, self._running = asyncio.Event(), asyncio.Event(), 0
        self._open.set()
        self._idle.set()

    @asynccontextmanager
    async def sampling(self) -> AsyncIterator[None]:
        while not self._open.is_set():
            await self._open.wait()
        self._running += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._running -= 1
            if self._running == 0:
                self._idle.set()

    @asynccontextmanager
    async def reloading(self) -> AsyncIterator[None]:
        self._open.clear()
        try:
            await self._idle.wait()
            yield
        finally:
            self._open.set()


_DEV_ROUTES = ("/pause", "/resume", "/collective_rpc", "/reset_prefix_cache")


class VLLMClient:
    """vLLM's OpenAI-compatible server. See the module docstring for how versions are stamped.

        policy = VLLMClient("http://127.0.0.1:8000", model="Qwen/Qwen3-8B", policy_version=0)
        await policy.load_weights("ckpt/v1", 1)   # pause, reload_weights, reset_prefix_cache, resume
    """

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, model: str | None = None, policy_version: int = 0,
                 reload: Literal["weights", "lora"] = "weights", lora_prefix: str = "policy",
                 timeout_s: float = 600.0, reload_timeout_s: float = 1800.0, connect_retries: int = 2,
                 retry_backoff_s: float = 0.25, max_connections: int = 0) -> None:
        if reload not in ("weights", "lora"):
            raise ValueError(f"reload must be 'weights' or 'lora', got {reload!r}")
        self.base_url = base_url.rstrip("/")
        self.policy_version = policy_version  # the version every completion sent from now on is stamped with
        self.reload = reload
        self._model, self._lora_prefix, self._reload_timeout_s = model, lora_prefix, reload_timeout_s
        self._gate = _DrainGate()
        self._reload_lock = asyncio.Lock()
        self._broken: str | None = None  # set when a reload failed half-way: the server stays paused
        self._http = Http(self.base_url, hint=f"check that vLLM is running there (`vllm serve MODEL --port "
                                                f"{port_of(self.base_url)}`) and that the URL is right",
                           timeout_s=timeout_s, connect_retries=connect_retries, retry_backoff_s=retry_backoff_s,
                           max_connections=max_connections)

    async def complete(self, prompt_ids: Sequence[int], sampling: SamplingParams, *,
                       session_id: str | None = None) -> Sample:
        if self._broken:
            raise WeightLoadError(self._broken)
        ids = prompt_list(prompt_ids)
        if self.reload == "lora":  # the adapter named in the request fixes the version
            model, version = self._model, self.policy_version
            reply = await self._post_completion(ids, sampling, model, session_id)
        else:
            async with self._gate.sampling():
                if self._broken:  # the reload this call waited for failed: the server is paused
                    raise WeightLoadError(self._broken)
                model, version = self._model, self.policy_version
                reply = await self._post_completion(ids, sampling, model, session_id)
        body = self._http.json(reply, "/v1/completions")
        self._check_model(body, model)
        return parse_completion(body, ids, policy_version=version, url=self.base_url,
                                top_logprobs=bool(sampling.logprobs))

    async def stream(self, prompt_ids: Sequence[int], sampling: SamplingParams, *,
                     session_id: str | None = None) -> AsyncIterator[Chunk]:
        """Like `complete`, streamed (`stream: true`, each event's `token_ids` and `logprobs`); a weight reload
        waits for the stream to end, as it waits for any completion in flight."""
        if self._broken:
            raise WeightLoadError(self._broken)
        ids = prompt_list(prompt_ids)
        if self.reload == "lora":
            async for chunk in self._stream(ids, sampling, self._model, self.policy_version, session_id):
                yield chunk
            return
        async with self._gate.sampling():
            if self._broken:
                raise WeightLoadError(self._broken)
            async for chunk in self._stream(ids, sampling, self._model, self.policy_version, session_id):
                yield chunk

    async def _stream(self, ids: list[int], sampling: SamplingParams, model: str | None, version: int,
                      session_id: str | None) -> AsyncIterator[Chunk]:
        body = {**completion_body(ids, sampling, model), "stream": True}
        async for _, event in self._http.events("/v1/completions", body=body, headers=session_headers(session_id)):
            self._check_model(event, model)
            chunk = parse_chunk(event, ids, policy_version=version, url=self.base_url,
                                top_logprobs=bool(sampling.logprobs))
            if chunk is not None:
                yield chunk

    def _check_model(self, body: Any, model: str | None) -> None:
        if model is not None and isinstance(body, dict) and body.get("model") != model:
            raise PolicyServerBadResponse(f"the policy server at {self.base_url} answered for model "
                                          f"{body.get('model')!r} but the request named {model!r}", url=self.base_url)

    async def _post_completion(self, ids: list[int], sampling: SamplingParams, model: str | None,
                               session_id: str | None) -> Reply:
        return await self._http.call("POST", "/v1/completions", body=completion_body(ids, sampling, model),
                                     headers=session_headers(session_id))

    async def models(self) -> list[str]:
        return await list_models(self._http)

    async def load_weights(self, path: str, version: int) -> None:
        """Load checkpoint (or LoRA adapter) `path` as `version`; later completions are stamped `version`."""
        async with self._reload_lock:
            if version <= self.policy_version:
                raise VersionConflict(f"cannot load {path} as policy version {version}: this client already serves "
                                      f"version {self.policy_version} and versions only go up")
            if self.reload == "lora":
                await self._load_adapter(str(path), version)
            else:
                await self._reload_weights(str(path), version)

    async def _reload_weights(self, path: str, version: int) -> None:
        async with self._gate.reloading():
            await self._control("/pause", params={"mode": "wait", "wait_for_inflight_requests": "true",
                                                  "clear_cache": "true"})
            try:  # reload_weights(weights_path=...) points the model config at `path` and loads it layer by layer
                await self._control("/collective_rpc", body={"method": "reload_weights",
                                                             "kwargs": {"weights_path": path}},
                                    timeout_s=self._reload_timeout_s)
            except (PolicyServerError, WeightLoadError) as exc:
                self._broken = (f"reloading {path} into vLLM at {self.base_url} failed ({exc}); the server stays "
                                "paused so that no token is sampled from partly loaded weights: call load_weights "
                                "again with a good checkpoint, or restart vLLM")
                raise WeightLoadError(self._broken) from exc
            self.policy_version, self._broken = version, None
            await self._control("/reset_prefix_cache")
            await self._control("/resume")

    async def _load_adapter(self, path: str, version: int) -> None:
        name = f"{self._lora_prefix}-v{version}"
        await self._control("/v1/load_lora_adapter", body={"lora_name": name, "lora_path": path}, idempotent=False)
        # vLLM keys cached prefixes by adapter, so a new adapter never reuses old KV; reset when the route exists
        await self._control("/reset_prefix_cache", missing_ok=True)
        self._model, self.policy_version = name, version  # together: a request sees both or neither

    async def _control(self, route: str, *, body: Any = None, params: Mapping[str, str] | None = None,
                       timeout_s: float | None = None, idempotent: bool = True, missing_ok: bool = False) -> None:
        try:
            await self._http.call("POST", route, body=body, params=params, timeout_s=timeout_s, idempotent=idempotent)
        except PolicyServerRejected as exc:
            if exc.status == 404 and exc.server_message in ("Not Found", ""):
                if missing_ok:
                    return
                raise WeightLoadError(self._missing_route(route)) from exc
            raise WeightLoadError(f'vLLM at {self.base_url} refused POST {route} ({exc.status}): '
                                  f'"{exc.server_message}"') from exc
        except PolicyServerFailed as exc:
            raise WeightLoadError(f'vLLM at {self.base_url} failed POST {route} ({exc.status}): '
                                  f'"{exc.server_message}"; see the vLLM log') from exc

    def _missing_route(self, route: str) -> str:
        if route in _DEV_ROUTES:
            return (f"vLLM at {self.base_url} has no POST {route}: it serves the weight-reload routes only when "
                    "started with VLLM_SERVER_DEV_MODE=1 (they are unauthenticated: bind vLLM to loopback), or "
                    "reload through runtime LoRA with VLLMClient(reload='lora')")
        return (f"vLLM at {self.base_url} has no POST {route}: start vLLM with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True "
                "and --enable-lora (with --max-lora-rank at least your adapter's rank)")

    async def aclose(self) -> None:
        await self._http.close()

    async def __aenter__(self) -> VLLMClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
