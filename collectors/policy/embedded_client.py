"""`EmbeddedClient`: the embedded policy server (`trajstore serve`), which reports the version of every sample.

The server answers each completion with the policy version that sampled its first token
(`policy_version`, header X-Policy-Version) and, per choice, the spans of every version that
sampled its tokens (`weight_versions`: the server loads new weights between decode steps, so a
call can span a reload); the client passes them through (`Sample.version_starts`/`version_values`).
A streamed call's events each carry their tokens' version. Reloads go through
`POST /v1/load_weights`:
by a directory on the server's disk (`load_weights`), or by the location the learner announced
(`load_published`: the server fetches and verifies it itself, so it may run on any host).

A restarted server serves its start-up weights again, whatever it was loaded with before.
`reported_version()` says what the server serves by its own account: the version of the last
response to a call sent after the last reload, or, once the server could not be reached, its
/health when it answers again. The collector's reloader compares that with what it loaded.

A token-id prompt goes out packed (`prompt_token_ids_b64`, base64 of int32 ids: the server decodes
and checks it in bulk instead of parsing tens of thousands of JSON numbers per call) to a server
that announces it in /health, asked once, before the first completion; to an older server as a
JSON list. A `TokenIds` prompt is packed from its log's kept form (`collectors.policy.token_ids`),
encoding only the ids new since the session's last call.

A server that announces `"prompt_prefix": true` holds a session's ids itself: a `TokenIds` prompt goes
with `session_key` (its log's `key`), and once a call with that key was answered, the next prompt of
the log whose log part has at least `prefix_min_ids` ids names that part (`prompt_prefix`: the key,
its length and crc32) and sends only the tail: per call the cost of the new ids, not of the history.
The log part is the previous prompt and the ids it sampled, what the server holds under the key.
When the server does not hold them as named (restarted, evicted, or the ids differ) it answers a 409
`prefix_not_cached`, and the call is sent again once, whole (`prefix_stats.resent_whole` counts it).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any
from weakref import WeakSet

from multidict import CIMultiDict

from collectors.errors import VersionConflict, WeightLoadError
from collectors.policy.contract import MAX_POLICY_VERSION, Chunk, Sample, SamplingParams
from collectors.policy.http import (
    Http,
    PolicyServerBadResponse,
    PolicyServerError,
    PolicyServerFailed,
    PolicyServerRejected,
    PolicyServerUnreachable,
    completion_body,
    list_models,
    parse_chunk,
    parse_completion,
    port_of,
    prompt_list,
    session_headers,
)
from collectors.policy.token_ids import (
    PACKED_FIELD,
    PREFIX_FIELD,
    PREFIX_NOT_CACHED,
    SESSION_KEY_FIELD,
    PackedIds,
    TokenIds,
    TokenLog,
)
from collectors.policy.versions import int_label
from trajstore.announcement import LoadRequest

PREFIX_MIN_IDS = 2048  # shorter log parts go whole: a prefix saves little there


@dataclass
class PrefixStats:
    """How a client's calls named their prompt (module docstring)."""

    prefix_calls: int = 0  # sent as a held prefix plus the tail
    resent_whole: int = 0  # of those, answered 409 prefix_not_cached and sent again whole

    def as_json(self) -> dict[str, int]:
        return asdict(self)


class EmbeddedClient:
    """The embedded policy server (`trajstore serve`): every response carries the version that sampled it.

        async with EmbeddedClient("http://127.0.0.1:8000") as policy:
            sample = await policy.complete(prompt_ids, SamplingParams(max_tokens=64, seed=1))
    """

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, model: str | None = None,
                 timeout_s: float = 600.0, reload_timeout_s: float = 600.0, connect_retries: int = 2,
                 retry_backoff_s: float = 0.25, max_connections: int = 0, control_token: str | None = None,
                 packed_prompts: bool | None = None, prompt_prefix: bool | None = None,
                 prefix_min_ids: int = PREFIX_MIN_IDS) -> None:
        """`packed_prompts`, `prompt_prefix`: send token ids packed, a session's history as a held prefix (module
        docstring); None asks the server whether it takes them."""
        self.base_url = base_url.rstrip("/")
        self._packed, self._prefix, self._prefix_min = packed_prompts, prompt_prefix, prefix_min_ids
        self._keyed: WeakSet[TokenLog] = WeakSet()  # logs whose key a call answered here was sent with
        self.prefix_stats = PrefixStats()
        self._control = {"Authorization": f"Bearer {control_token}"} if control_token else None
        self.policy_version: int | None = None  # the newest version the server has reported
        self._reported: int | None = None  # the version of the last answer to a call sent after the last reload
        self._loads = 0  # reloads so far: an answer to a call sent before the last one may show the old version
        self._lost = False  # the server could not be reached since the last answer (it may have restarted)
        self._model, self._reload_timeout_s = model, reload_timeout_s
        self._http = Http(self.base_url, hint=f"start it with `trajstore serve --model DIR --port "
                                                f"{port_of(self.base_url)}`", timeout_s=timeout_s,
                           connect_retries=connect_retries, retry_backoff_s=retry_backoff_s,
                           max_connections=max_connections)

    async def complete(self, prompt_ids: Sequence[int], sampling: SamplingParams, *,
                       session_id: str | None = None) -> Sample:
        ids, loads = prompt_list(prompt_ids), self._loads
        try:
            sent = await self._body(ids, sampling)
            try:
                reply = await self._http.call("POST", "/v1/completions", body=sent,
                                              headers=session_headers(session_id))
            except PolicyServerRejected as exc:
                if not self._missed(exc, sent):
                    raise
                sent = await self._body(ids, sampling, whole=True)
                reply = await self._http.call("POST", "/v1/completions", body=sent,
                                              headers=session_headers(session_id))
        except PolicyServerUnreachable:
            self._lost = True
            raise
        self._answered(ids, sent)
        body = await self._http.parsed(reply, "/v1/completions")
        version = self._version(body, reply.headers, loads)
        return parse_completion(body, ids, policy_version=version, url=self.base_url,
                                top_logprobs=bool(sampling.logprobs), label=int_label)

    async def stream(self, prompt_ids: Sequence[int], sampling: SamplingParams, *,
                     session_id: str | None = None) -> AsyncIterator[Chunk]:
        ids, loads = prompt_list(prompt_ids), self._loads
        try:
            sent = {**await self._body(ids, sampling), "stream": True}
            for last_try in (False, True):
                try:
                    async for head, event in self._http.events("/v1/completions", body=sent,
                                                               headers=session_headers(session_id)):
                        chunk = parse_chunk(event, ids, policy_version=self._version(event, head, loads),
                                            url=self.base_url, top_logprobs=bool(sampling.logprobs))
                        if chunk is not None:
                            yield chunk
                    break
                except PolicyServerRejected as exc:  # refused before its first event
                    if last_try or not self._missed(exc, sent):
                        raise
                    sent = {**await self._body(ids, sampling, whole=True), "stream": True}
        except PolicyServerUnreachable:
            self._lost = True
            raise
        self._answered(ids, sent)

    async def _body(self, ids: list[int] | TokenIds, sampling: SamplingParams, *,
                    whole: bool = False) -> dict[str, Any]:
        """The completion request: the embedded server need not echo the prompt back (`return_prompt_token_ids`:
        it counts it in `usage`), and takes it packed, and a session's history as a held prefix, where it says so
        (module docstring); `whole`: never as a prefix."""
        body = completion_body(ids, sampling, self._model, echo_prompt=False)
        if self._packed is None or self._prefix is None:
            try:
                # not retried on a failed connection: the completion would not be either
                health = self._http.json(await self._http.call("GET", "/health", timeout_s=10), "/health")
            except (PolicyServerRejected, PolicyServerBadResponse):  # no such /health: it cannot announce it
                health = None
            said = health if isinstance(health, dict) else {}
            self._packed = said.get(PACKED_FIELD) is True if self._packed is None else self._packed
            self._prefix = said.get(PREFIX_FIELD) is True if self._prefix is None else self._prefix
        tail_only = False
        if self._prefix and isinstance(ids, TokenIds):
            log = ids.log
            body[SESSION_KEY_FIELD] = log.key  # the server holds this prompt and its answer under it
            if not whole and ids.logged >= self._prefix_min and log in self._keyed:
                body[PREFIX_FIELD] = {"key": log.key, "tokens": ids.logged, "crc32": ids.logged_crc32()}
                body["prompt"], tail_only = ids.tail, True
                self.prefix_stats.prefix_calls += 1
        if self._packed:  # packed as the body is written; a tail's bytes are kept for its log to grow by
            prompt = body.pop("prompt")
            body[PACKED_FIELD] = PackedIds(ids, tail_only=True) if tail_only else PackedIds(prompt)
        return body

    def _missed(self, exc: PolicyServerRejected, sent: dict[str, Any]) -> bool:
        """Whether a refusal is the server not holding the prefix `sent` named: then it is sent again whole."""
        missed = PREFIX_FIELD in sent and exc.status == 409 and exc.server_code == PREFIX_NOT_CACHED
        self.prefix_stats.resent_whole += missed
        return missed

    def _answered(self, ids: list[int] | TokenIds, sent: dict[str, Any]) -> None:
        """After a call the server answered: it holds the prompt and its output under the key the call was sent
        with, so the log's next call may name them."""
        if SESSION_KEY_FIELD in sent and isinstance(ids, TokenIds):
            self._keyed.add(ids.log)

    async def reported_version(self) -> int | None:
        """The version the server serves by its own account (module docstring); None while unknown."""
        if self._lost:
            try:
                reply = await self._http.call("GET", "/health", timeout_s=10)
                body = self._http.json(reply, "/health")
            except PolicyServerError:
                return None  # still unreachable: ask again later
            version = body.get("policy_version") if isinstance(body, dict) else None
            if isinstance(version, int) and not isinstance(version, bool):
                self._reported, self._lost = version, False
        return self._reported

    def _version(self, body: Any, headers: CIMultiDict[str], loads: int | None = None) -> int:
        """The version that sampled a response: its `policy_version` field, else its X-Policy-Version header."""
        version = body.get("policy_version") if isinstance(body, dict) else None
        if version is None and headers.get("X-Policy-Version", "").isdigit():
            version = int(headers["X-Policy-Version"])
        if not isinstance(version, int) or isinstance(version, bool):
            raise PolicyServerBadResponse(
                f"the policy server at {self.base_url} reported no policy version (field `policy_version`, header "
                "X-Policy-Version); is it `trajstore serve`? For vLLM use VLLMClient", url=self.base_url)
        if not 0 <= version <= MAX_POLICY_VERSION:
            raise PolicyServerBadResponse(
                f"the policy server at {self.base_url} reported policy version {version}, outside 0..."
                f"{MAX_POLICY_VERSION} (the versions a turn can be stored with)", url=self.base_url)
        self.policy_version = max(version, self.policy_version or 0)
        if loads == self._loads:  # sent after the last reload: what the server serves now
            self._reported, self._lost = version, False
        return version

    async def models(self) -> list[str]:
        return await list_models(self._http)

    async def load_weights(self, path: str, version: int) -> None:
        """POST /v1/load_weights: the server swaps the weights between decode steps; calls in flight go on."""
        await self._load(LoadRequest(version=version, path=str(path)), str(path))

    async def load_published(self, request: LoadRequest) -> str:
        """POST /v1/load_weights with the announced location: the server loads `request.path` if its disk holds
        the announced directory, else fetches `request.uri` into its own cache and verifies it (`PublishedLoader`)."""
        what = str(request.uri or request.path)
        loaded = await self._load(request, what)
        return loaded if isinstance(loaded, str) else what

    async def _load(self, request: LoadRequest, what: str) -> Any:
        """One reload call; returns the directory the server says it loaded."""
        version = request.version
        try:
            reply = await self._http.call("POST", "/v1/load_weights", body=request.to_body(), headers=self._control,
                                          timeout_s=self._reload_timeout_s)
        except PolicyServerRejected as exc:
            if exc.status == 409:  # it serves that version or a newer one (another collector loaded it)
                self._loads, self._reported = self._loads + 1, None  # calls sent before may still show the old one
                raise VersionConflict(exc.server_message or str(exc)) from exc
            raise WeightLoadError(f"the policy server at {self.base_url} did not load {what}: "
                                  f"{exc.server_message}") from exc
        except PolicyServerFailed as exc:
            raise WeightLoadError(f"the policy server at {self.base_url} failed loading {what}: "
                                  f"{exc.server_message}; see the server's log") from exc
        answer = self._http.json(reply, "/v1/load_weights")
        answer = answer if isinstance(answer, dict) else {}
        self.policy_version = answer.get("policy_version", version)
        self._loads += 1
        self._reported = self.policy_version if isinstance(self.policy_version, int) else None
        return answer.get("path")

    async def aclose(self) -> None:
        await self._http.close()

    async def __aenter__(self) -> EmbeddedClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
