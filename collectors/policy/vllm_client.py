"""`VLLMClient`: vLLM's OpenAI-compatible server, every sample stamped with the version that produced it.

vLLM's completions do not say which weights sampled them, so the version comes from what the
server reports beside them. Three ways to reload, one per role (`reload=`):

- `"weights"` (vLLM with VLLM_SERVER_DEV_MODE=1 and --enable-scale-out): this client reloads the
  server's full weights: POST /pause?mode=keep (vLLM freezes every caller's in-flight requests
  between two steps, keeping their KV cache, and holds new ones), /collective_rpc
  `reload_weights`, /update_weight_version with the new version, /reset_prefix_cache (it
  succeeds only when no kept request holds cache blocks), then /resume: the frozen requests go
  on with the new weights. Nothing is aborted, drained or sampled again. The server's
  weight-version label (vLLM's own, GET /weight_info) changes only while nothing is sampled,
  always together with the weights. One client per server reloads; a second would pause it
  behind the first one's back.
- `"follow"`: another process (the collector with `reload="weights"`) reloads this server;
  `load_weights(path, N)` only waits until the server's label reaches N.
- `"lora"` (VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, --enable-lora): each version is its own
  adapter `{lora_prefix}-v{N}`, loaded by whichever client gets there first (a second load of
  the same name is a no-op), and every request names its adapter in `model`; vLLM echoes the
  name back, which fixes the version exactly. Nothing is paused.

Stamping in "weights" and "follow": calls go to vLLM's `POST /inference/v1/generate`
(`collectors.policy.vllm_generate`), whose every choice carries `weight_versions`, the spans of
output tokens each label sampled; vLLM changes the label only between steps, together with the
weights. So each token is stamped with the version that sampled it (`Sample.version_starts`/
`version_values`, `policy_version` the first token's), streamed calls included (the spans come
with the last event). A label of "default" (a server nobody reloaded yet) is the
`policy_version` the client was given; a server without the dev routes cannot be reloaded, so
its version is that one too. No call is sent again because of a reload.

Retries: a 503 (vLLM's queue limit, `--max-num-queued-reqs`; also hit while a reload holds
requests) is retried with backoff, see `collectors.policy.http`. While paused for a reload,
vLLM 0.32 holds new requests until /resume rather than refusing them (measured), so callers
ride through a reload on either path.

Full-weight reloads check the checkpoint on this machine before vLLM sees it, because vLLM
0.32 does not survive a bad one: a `reload_weights` that fails (a missing directory, no
weights) kills its engine, and every later request fails with 500 (measured). So the path must
be a checkpoint directory here too (collectors and their vLLM share the checkpoint directory),
with config.json and safetensors weights. A checkpoint whose config ties the LM head to the
input embedding is refused as well: vLLM 0.32's in-place reload loads the embedding but puts
the old LM head back (measured on its CPU backend; read in its layerwise reload code, which is
not CPU-specific), so the server would sample from a mix of two versions. Reload such models
as LoRA adapters.

Run vLLM >= 0.10.2 (`return_token_ids`) with `--logprobs-mode processed_logprobs`: by default
vLLM returns logprobs of the raw model output, not of the temperature/top-k/top-p
distribution the token was drawn from, and no HTTP route reveals the mode, so the client
cannot check it. `collectors.policy.vllm_server.start_vllm` starts one configured this way.

Sampling support: vLLM 0.32 returns each sampled token's kept set (`sampling_mask`) only on its
token-in/token-out route and only from its Model Runner V2, which needs Triton; the CPU build's
Triton has no CPU backend, so it refuses `--return-sampling-mask` ("Model Runner V2 requires
Triton", tests/cli/test_sampling_replay.py). The response parser maps a `sampling_mask` to the
turn's support columns wherever one arrives; samples without one are stored with none, and the
learner rebuilds the support of their truncated tokens from the recorded top_k / top_p.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from collectors.errors import VersionConflict, WeightLoadError
from collectors.policy.contract import Chunk, Sample, SamplingParams
from collectors.policy.http import (
    Http,
    PolicyServerBadResponse,
    PolicyServerError,
    PolicyServerFailed,
    PolicyServerRejected,
    completion_body,
    list_models,
    parse_chunk,
    parse_completion,
    port_of,
    prompt_list,
    session_headers,
)
from collectors.policy.versions import Label
from collectors.policy.vllm_generate import ROUTE as GENERATE
from collectors.policy.vllm_generate import SCALE_OUT_HINT, as_completion, generate_body

Reload = Literal["weights", "follow", "lora"]
_DEV_ROUTES = ("/pause", "/resume", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version")


class VLLMClient:
    """vLLM's OpenAI-compatible server. See the module docstring for how versions are stamped.

        policy = VLLMClient("http://127.0.0.1:8000", model="Qwen/Qwen3-8B", policy_version=0)
        await policy.load_weights("ckpt/v1", 1)   # pause, reload_weights, label, reset_prefix_cache, resume
    """

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, model: str | None = None, policy_version: int = 0,
                 reload: Reload = "weights", lora_prefix: str = "policy", timeout_s: float = 600.0,
                 reload_timeout_s: float = 1800.0, follow_timeout_s: float = 30.0, connect_retries: int = 2,
                 retry_backoff_s: float = 0.25, max_connections: int = 0) -> None:
        if reload not in ("weights", "follow", "lora"):
            raise ValueError(f"reload must be 'weights', 'follow' or 'lora', got {reload!r}")
        self.base_url = base_url.rstrip("/")
        self.policy_version = policy_version  # the newest version this client has seen the server serve
        self.reload = reload
        self._initial, self._model, self._lora_prefix = policy_version, model, lora_prefix
        self._reload_timeout_s, self._follow_timeout_s = reload_timeout_s, follow_timeout_s
        self._label: int | None = None  # the server's weight-version label as last read
        self._labelled = True  # False once the server showed it has no /weight_info (no dev routes)
        self._reload_lock = asyncio.Lock()
        self._broken: str | None = None  # set when a reload failed half-way: the server stays paused
        self._http = Http(self.base_url, hint=f"check that vLLM is running there (`vllm serve MODEL --port "
                                                f"{port_of(self.base_url)}`) and that the URL is right",
                           timeout_s=timeout_s, connect_retries=connect_retries, retry_backoff_s=retry_backoff_s,
                           max_connections=max_connections)

    @property
    def model(self) -> str | None:
        """The served model name this client's requests carry (None: the server's only model)."""
        return self._model

    @property
    def http(self) -> Http:
        """This client's connection to vLLM, for its other routes (`collectors.proxy.vllm_render`)."""
        return self._http

    @property
    def unavailable_retries(self) -> int:
        """How many 503s ("try again later") this client has retried."""
        return self._http.unavailable_retries

    async def complete(self, prompt_ids: Sequence[int], sampling: SamplingParams, *,
                       session_id: str | None = None, sampling_extra: Mapping[str, Any] | None = None) -> Sample:
        """One sample; `sampling_extra` adds vLLM request fields (`collectors.policy.vllm_generate.generate_body`)."""
        if self._broken:
            raise WeightLoadError(self._broken)
        ids = prompt_list(prompt_ids)
        if self.reload == "lora":  # the adapter named in the request fixes the version
            _no_extra(sampling_extra)
            model, version = self._model, self.policy_version
            body = completion_body(ids, sampling, self._model)
            return self._sample(await self._post_completion(body, session_id), ids, model, version, sampling)
        known = self._label if self._label is not None else await self.served_label()
        reply = await self._post(GENERATE, generate_body(ids, sampling, self._model, known, extra=sampling_extra),
                                 session_id)
        sample = self._sample(as_completion(reply), ids, self._model, known, sampling, label=self._version_of)
        self._saw(sample.version_values or [sample.policy_version])
        return sample

    async def stream(self, prompt_ids: Sequence[int], sampling: SamplingParams, *,
                     session_id: str | None = None,
                     sampling_extra: Mapping[str, Any] | None = None) -> AsyncIterator[Chunk]:
        """Like `complete`, streamed (`stream: true`, each event's `token_ids` and `logprobs`). Chunks carry the
        label known before the request; if the label moved by the time the stream ended, the tokens already
        went out and cannot be drawn again, so the stream fails (PolicyServerError) instead of ending, and
        nothing of it is stored (see the module docstring on stamping)."""
        if self._broken:
            raise WeightLoadError(self._broken)
        ids = prompt_list(prompt_ids)
        lora = self.reload == "lora"
        before = self.policy_version if lora else (
            self._label if self._label is not None else await self.served_label())
        if lora:
            _no_extra(sampling_extra)
            route, body = "/v1/completions", {**completion_body(ids, sampling, self._model), "stream": True}
        else:
            route, body = GENERATE, generate_body(ids, sampling, self._model, before, stream=True, extra=sampling_extra)
        n_before = 0
        async for _, event in self._http.events(route, body=body, headers=session_headers(session_id)):
            if lora:  # the generate route's events name no model
                self._check_model(event, self._model)
            chunk = parse_chunk(event if lora else as_completion(event), ids, policy_version=before,
                                url=self.base_url, top_logprobs=bool(sampling.logprobs),
                                label=None if lora else self._version_of, n_before=n_before)
            if chunk is not None:
                n_before += len(chunk.output_ids)
                if chunk.version_values:
                    self._saw(chunk.version_values)
                yield chunk

    async def _post_completion(self, body: dict[str, Any], session_id: str | None) -> Any:
        return await self._post("/v1/completions", body, session_id)

    async def _post(self, route: str, body: dict[str, Any], session_id: str | None) -> Any:
        try:
            reply = await self._http.call("POST", route, body=body, headers=session_headers(session_id),
                                          retry_unavailable=True)
        except PolicyServerRejected as exc:
            route_missing = exc.status == 404 and exc.server_message in ("Not Found", "")
            if route == GENERATE and (exc.status == 403 or route_missing):
                raise PolicyServerRejected(f"vLLM at {self.base_url} refused POST {route} ({exc.status}: "
                                           f"{exc.server_message}); {SCALE_OUT_HINT}", url=self.base_url,
                                           status=exc.status, server_message=exc.server_message) from exc
            raise
        return self._http.json(reply, route)

    def _sample(self, body: Any, ids: Sequence[int], model: str | None, version: int, sampling: SamplingParams,
                label: Label | None = None) -> Sample:
        self._check_model(body, model)
        return parse_completion(body, ids, policy_version=version, url=self.base_url,
                                top_logprobs=bool(sampling.logprobs), label=label)

    def _version_of(self, label: str) -> int:
        """The policy version vLLM's weight-version `label` stands for (ValueError when none)."""
        if label == "default":
            return self._initial
        if not label.isdigit():
            raise ValueError(label)
        return int(label)

    def _saw(self, versions: list[int]) -> None:
        """Versions the server reported sampling with: labels only go up."""
        newest = max(versions)
        self._label = newest if self._label is None else max(self._label, newest)
        self.policy_version = max(self.policy_version, newest)

    def _check_model(self, body: Any, model: str | None) -> None:
        if model is not None and isinstance(body, dict) and body.get("model") != model:
            raise PolicyServerBadResponse(f"the policy server at {self.base_url} answered for model "
                                          f"{body.get('model')!r} but the request named {model!r}", url=self.base_url)

    async def served_label(self) -> int:
        """The version whose weights vLLM serves now, from its weight-version label (GET /weight_info)."""
        if not self._labelled:
            return self._initial
        try:
            reply = await self._http.call("GET", "/weight_info", idempotent=True)
        except PolicyServerRejected as exc:
            if exc.status != 404:
                raise
            self._labelled = False  # no dev routes: nobody can reload these weights through the API
            return self._initial
        body = self._http.json(reply, "/weight_info")
        label = body.get("weight_version") if isinstance(body, dict) else None
        if label == "default":
            version = self._initial
        elif isinstance(label, str) and label.isdigit():
            version = int(label)
        else:
            raise PolicyServerBadResponse(
                f"vLLM at {self.base_url} labels its weights {label!r}, which is not a policy version; something "
                "other than trajstore's collectors reloads this server: give the collectors a vLLM of their own",
                url=self.base_url)
        self._label = version if self._label is None else max(self._label, version)
        self.policy_version = max(self.policy_version, version)
        return version

    async def models(self) -> list[str]:
        return await list_models(self._http)

    async def load_weights(self, path: str, version: int) -> None:
        """Load checkpoint (or LoRA adapter) `path` as `version` (in "follow": wait for it to be loaded)."""
        async with self._reload_lock:
            if version <= self.policy_version:
                raise VersionConflict(f"cannot load {path} as policy version {version}: this client already serves "
                                      f"version {self.policy_version} and versions only go up")
            if self.reload == "lora":
                await self._load_adapter(str(path), version)
            elif self.reload == "follow":
                await self._await_version(str(path), version)
            else:
                await self._reload_weights(str(path), version)

    async def _reload_weights(self, path: str, version: int) -> None:
        _check_checkpoint(path)
        try:
            served = await self.served_label()
        except PolicyServerError as exc:
            raise WeightLoadError(f"cannot ask vLLM at {self.base_url} which version it serves: {exc}") from exc
        if self._labelled and served >= version:
            raise VersionConflict(f"vLLM at {self.base_url} already serves version {served}; not loading {path} "
                                  f"as version {version}")
        # keep: requests in flight freeze between two steps and go on with the new weights after /resume
        await self._control("/pause", params={"mode": "keep", "clear_cache": "false"})
        try:  # reload_weights(weights_path=...) points the model config at `path` and loads it layer by layer
            await self._control("/collective_rpc", body={"method": "reload_weights", "kwargs": {"weights_path": path}},
                                timeout_s=self._reload_timeout_s)
            await self._control("/update_weight_version", body={"new_version": str(version)})
        except (PolicyServerError, WeightLoadError) as exc:
            self._broken = (f"reloading {path} into vLLM at {self.base_url} failed ({exc}); the server stays "
                            "paused so that no token is sampled from partly loaded weights: call load_weights "
                            "again with a good checkpoint, or restart vLLM")
            raise WeightLoadError(self._broken) from exc
        self._broken, self._label, self.policy_version = None, version, version
        await self._control("/reset_prefix_cache")
        await self._control("/resume")

    async def _await_version(self, path: str, version: int) -> None:
        deadline = time.monotonic() + self._follow_timeout_s
        while True:
            try:
                served = await self.served_label()
            except PolicyServerError as exc:
                raise WeightLoadError(f"cannot ask vLLM at {self.base_url} which version it serves: {exc}") from exc
            if served >= version:
                return
            if not self._labelled:
                raise WeightLoadError(f"vLLM at {self.base_url} has no GET /weight_info, so this client cannot "
                                      "follow another collector's reloads: start vLLM with VLLM_SERVER_DEV_MODE=1")
            if time.monotonic() > deadline:
                raise WeightLoadError(
                    f"vLLM at {self.base_url} still serves version {served}, not {version} ({path}), after "
                    f"{self._follow_timeout_s:g} s; this client follows the reloads of the collector that owns the "
                    "server (reload='weights'): is it running and does it see the checkpoint?")
            await asyncio.sleep(0.2)

    async def _load_adapter(self, path: str, version: int) -> None:
        name = f"{self._lora_prefix}-v{version}"
        try:
            await self._control("/v1/load_lora_adapter", body={"lora_name": name, "lora_path": path},
                                idempotent=False)
        except WeightLoadError as exc:  # another collector on this server loaded the same version first
            if "has already been loaded" not in str(exc):
                raise
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


def _check_checkpoint(path: str) -> None:
    """WeightLoadError for a directory vLLM could not reload, or would reload only in part (module docstring)."""
    directory = Path(path)
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise WeightLoadError(
            f"{path} is not a checkpoint directory on this machine ({exc}); a failed reload_weights kills vLLM's "
            "engine, so the client only passes it directories it can check: config.json and safetensors weights, "
            "at the same path the vLLM server reads") from exc
    if not any(directory.glob("*.safetensors")):
        raise WeightLoadError(f"{path} has no *.safetensors weights; vLLM reloads full weights from safetensors "
                              "files (a LoRA adapter checkpoint needs VLLMClient(reload='lora'))")
    if config.get("tie_word_embeddings"):
        raise WeightLoadError(
            f"{path} ties its LM head to its input embedding (tie_word_embeddings), and vLLM's in-place weight "
            "reload reloads the embedding but keeps the old LM head, so the server would sample from a mix of two "
            "versions; train LoRA adapters and reload with VLLMClient(reload='lora'), or untie the embeddings")


def _no_extra(extra: Mapping[str, Any] | None) -> None:
    if extra:
        raise ValueError("sampling_extra needs vLLM's generate route, which a LoRA client (reload='lora') does not "
                         "use: its adapter is named on /v1/completions")
