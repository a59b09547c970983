"""Policy-server clients: `EmbeddedClient` (`trajstore serve`) and `VLLMClient` (vLLM's OpenAI server).

Both implement `collectors.policy.PolicyClient` over one reused aiohttp session. A token-id
prompt goes to POST /v1/completions with `return_token_ids: true` and `logprobs: 0` (vLLM
always returns the logprob of the sampled token; N > 0 would add the top N alternatives,
which nobody here reads), and the engine's own ids, logprobs, text, finish and stop reasons
come back as a `Sample`. Nothing is re-tokenized.

Policy versions. The embedded server reports the version that sampled each response
(`policy_version`, header X-Policy-Version) and the client passes it through. vLLM reports
none, so `VLLMClient` stamps the version it loaded last. That is exact because of how it
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

Errors are the named `PolicyServerError`s below (unreachable, timeout, 4xx, 5xx, malformed
response) and, for reloads, `WeightLoadError` / `VersionConflict`. Connection failures
(nothing was sent) are retried on idempotent control routes only, never on completions.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

import aiohttp
from multidict import CIMultiDict

from collectors.errors import CollectorError, VersionConflict, WeightLoadError
from collectors.policy import Sample, Sampling


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


class _Http:
    """One aiohttp session (created on first use, in the caller's loop); transport failures
    and HTTP errors become the named errors."""

    def __init__(self, base_url: str, *, hint: str, timeout_s: float, connect_retries: int,
                 retry_backoff_s: float, max_connections: int) -> None:
        self.base_url, self.hint, self.timeout_s = base_url, hint, timeout_s
        self.connect_retries, self.retry_backoff_s = connect_retries, retry_backoff_s
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # limit=0: no cap; the collector bounds its own concurrency
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.max_connections))
        return self._session

    async def call(self, method: str, route: str, *, body: Any = None, params: Mapping[str, str] | None = None,
                   headers: Mapping[str, str] | None = None, timeout_s: float | None = None,
                   idempotent: bool = False) -> Reply:
        url, timeout = self.base_url + route, timeout_s or self.timeout_s
        attempts = 1 + (self.connect_retries if idempotent else 0)
        for attempt in range(attempts):
            try:
                async with self._get_session().request(method, url, json=body, params=params, headers=headers,
                                                       timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                    reply = Reply(resp.status, CIMultiDict(resp.headers), await resp.text(errors="replace"))
                break
            except aiohttp.ClientConnectorError as exc:  # nothing was sent: safe to retry where idempotent
                if attempt + 1 < attempts:
                    await asyncio.sleep(self.retry_backoff_s * 2**attempt)
                    continue
                raise PolicyServerUnreachable(
                    f"cannot connect to the policy server at {self.base_url} ({exc.os_error.strerror or exc}); "
                    f"{self.hint}", url=self.base_url) from exc
            except TimeoutError as exc:
                raise PolicyServerTimeout(
                    f"the policy server at {self.base_url} did not answer {method} {route} within {timeout:g} s; "
                    "it may be overloaded or stuck, or the call needs a longer timeout (timeout_s=...)",
                    url=self.base_url) from exc
            except aiohttp.ClientError as exc:
                raise PolicyServerUnreachable(
                    f"the connection to the policy server at {self.base_url} failed during {method} {route} "
                    f"({type(exc).__name__}: {exc}); {self.hint}", url=self.base_url) from exc
        if reply.status >= 400:
            said = server_message(reply.text)
            kind = PolicyServerFailed if reply.status >= 500 else PolicyServerRejected
            what = "failed" if reply.status >= 500 else "refused"
            raise kind(f'the policy server at {self.base_url} {what} {method} {route} ({reply.status}): "{said}"',
                       url=self.base_url, status=reply.status, server_message=said)
        return reply

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


def completion_body(prompt_ids: list[int], sampling: Sampling, model: str | None) -> dict[str, Any]:
    """The /v1/completions request for one token-id prompt."""
    body: dict[str, Any] = {
        "prompt": prompt_ids, "max_tokens": sampling.max_tokens, "temperature": sampling.temperature,
        "top_p": sampling.top_p, "top_k": sampling.top_k, "stop": list(sampling.stop),
        "logprobs": 0, "return_token_ids": True,
    }
    if sampling.seed is not None:
        body["seed"] = sampling.seed
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
                  finish_reason=finish, policy_version=policy_version, stop_reason=choice.get("stop_reason"),
                  raw=body)


def _prompt_list(prompt_ids: Sequence[int]) -> list[int]:
    ids = [int(t) for t in prompt_ids]
    if not ids:
        raise ValueError("prompt_ids is empty; a completion needs at least one prompt token")
    return ids


def _session_headers(session_id: str | None) -> dict[str, str] | None:
    return {"X-Session-ID": session_id} if session_id else None  # vLLM's router: one session, one server


def _port_of(url: str) -> str:
    return str(urlsplit(url).port or 8000)


class EmbeddedClient:
    """The embedded policy server (`trajstore serve`): every response carries the version that sampled it.

        async with EmbeddedClient("http://127.0.0.1:8000") as policy:
            sample = await policy.complete(prompt_ids, Sampling(max_tokens=64, seed=1))
    """

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, model: str | None = None,
                 timeout_s: float = 600.0, reload_timeout_s: float = 600.0, connect_retries: int = 2,
                 retry_backoff_s: float = 0.25, max_connections: int = 0) -> None:
        self.base_url = base_url.rstrip("/")
        self.policy_version: int | None = None  # the newest version the server has reported
        self._model, self._reload_timeout_s = model, reload_timeout_s
        self._http = _Http(self.base_url, hint=f"start it with `trajstore serve --model DIR --port "
                                                f"{_port_of(self.base_url)}`", timeout_s=timeout_s,
                           connect_retries=connect_retries, retry_backoff_s=retry_backoff_s,
                           max_connections=max_connections)

    async def complete(self, prompt_ids: Sequence[int], sampling: Sampling, *,
                       session_id: str | None = None) -> Sample:
        ids = _prompt_list(prompt_ids)
        reply = await self._http.call("POST", "/v1/completions", body=completion_body(ids, sampling, self._model),
                                      headers=_session_headers(session_id))
        body = self._http.json(reply, "/v1/completions")
        version = body.get("policy_version") if isinstance(body, dict) else None
        if version is None and reply.headers.get("X-Policy-Version", "").isdigit():
            version = int(reply.headers["X-Policy-Version"])
        if not isinstance(version, int) or isinstance(version, bool):
            raise PolicyServerBadResponse(
                f"the policy server at {self.base_url} reported no policy version (field `policy_version`, header "
                "X-Policy-Version); is it `trajstore serve`? For vLLM use VLLMClient", url=self.base_url)
        self.policy_version = max(version, self.policy_version or 0)
        return parse_completion(body, ids, policy_version=version, url=self.base_url)

    async def models(self) -> list[str]:
        return await _models(self._http)

    async def load_weights(self, path: str, version: int) -> None:
        """POST /v1/load_weights: the server finishes in-flight requests on the old weights itself."""
        try:
            reply = await self._http.call("POST", "/v1/load_weights", body={"path": str(path), "version": version},
                                          timeout_s=self._reload_timeout_s)
        except PolicyServerRejected as exc:
            if exc.status == 409:
                raise VersionConflict(exc.server_message or str(exc)) from exc
            raise WeightLoadError(f"the policy server at {self.base_url} did not load {path}: "
                                  f"{exc.server_message}") from exc
        except PolicyServerFailed as exc:
            raise WeightLoadError(f"the policy server at {self.base_url} failed loading {path}: "
                                  f"{exc.server_message}; see the server's log") from exc
        body = self._http.json(reply, "/v1/load_weights")
        self.policy_version = body.get("policy_version", version) if isinstance(body, dict) else version

    async def aclose(self) -> None:
        await self._http.close()

    async def __aenter__(self) -> EmbeddedClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def _models(http: _Http) -> list[str]:
    body = http.json(await http.call("GET", "/v1/models", idempotent=True), "/v1/models")
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list) or not all(isinstance(c, dict) and isinstance(c.get("id"), str) for c in data):
        raise PolicyServerBadResponse(f"the policy server at {http.base_url} returned a model list without "
                                      f"`data[].id`: {json.dumps(body)[:200]}", url=http.base_url)
    return [card["id"] for card in data]


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
        self._http = _Http(self.base_url, hint=f"check that vLLM is running there (`vllm serve MODEL --port "
                                                f"{_port_of(self.base_url)}`) and that the URL is right",
                           timeout_s=timeout_s, connect_retries=connect_retries, retry_backoff_s=retry_backoff_s,
                           max_connections=max_connections)

    async def complete(self, prompt_ids: Sequence[int], sampling: Sampling, *,
                       session_id: str | None = None) -> Sample:
        if self._broken:
            raise WeightLoadError(self._broken)
        ids = _prompt_list(prompt_ids)
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
        if model is not None and isinstance(body, dict) and body.get("model") != model:
            raise PolicyServerBadResponse(f"the policy server at {self.base_url} answered for model "
                                          f"{body.get('model')!r} but the request named {model!r}", url=self.base_url)
        return parse_completion(body, ids, policy_version=version, url=self.base_url)

    async def _post_completion(self, ids: list[int], sampling: Sampling, model: str | None,
                               session_id: str | None) -> Reply:
        return await self._http.call("POST", "/v1/completions", body=completion_body(ids, sampling, model),
                                     headers=_session_headers(session_id))

    async def models(self) -> list[str]:
        return await _models(self._http)

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
