"""The policy-server contract every collector talks to: token ids in, sampled ids and logprobs out.

`PolicyClient` is a Protocol with two implementations (the embedded server and vLLM), both
speaking vLLM's `/v1/completions` with token-id prompts. A collector never re-tokenizes
what the model returned: `Sample.output_ids` are the engine's ids, `Sample.output_logprobs`
the logprobs of the distribution each was drawn from, and `Sample.policy_version` the
checkpoint version that sampled the first of them; when the server loaded new weights while
the call ran, `version_starts`/`version_values` say from which output index on each version
sampled (`collectors.policy.versions`; None: one version sampled all). `stream` yields the same tokens as they are
sampled (`Chunk`s, joined by `StreamedSample` into the `Sample` that `complete` would return).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from trajstore.announcement import MAX_POLICY_VERSION, LoadRequest
from trajstore.events import SUPPORT_IDS_CAP

SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)

# The ranges every edge checks (the embedded server, the proxy's wire protocols), so a value that
# would overflow a tensor or a stored column is refused with a 400 and never reaches a batch.
TOP_K_MAX = 2**31 - 1  # far above any vocabulary: top_k beyond the vocabulary keeps every token
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # vLLM's: a 64-bit integer


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion: what a collector asks for and what the embedded engine applies.

    Field names, defaults and meanings are vLLM's `SamplingParams`. Off switches: `top_k` 0
    (the edges read vLLM's older -1 as 0 too) and `top_p` 1. The first six fields are recorded
    with every turn (`as_json`, the `sampling` column); the rest shape a completion's text and
    alternatives, never its tokens.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # how many top alternatives to report per token (the sampled one always is)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def problems(self) -> list[str]:
        """Values outside the ranges above (the edges refuse them first; the engine checks again)."""
        out = []
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            out.append(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            out.append(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            out.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0 <= self.top_k <= TOP_K_MAX:
            out.append(f"top_k must be 0 (off) to {TOP_K_MAX}, got {self.top_k!r}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            out.append(f"seed must be a 64-bit integer, got {self.seed!r}")
        return out

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def truncated(self) -> bool:
        """Draws from a truncated distribution (top-k or top-p): each token's kept set is recorded."""
        return self.top_k > 0 or self.top_p < 1.0

    def as_json(self) -> dict[str, object]:
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "seed": self.seed, "stop": list(self.stop)}


@dataclass(frozen=True)
class Sample:
    """One completion, exactly as the engine produced it."""

    prompt_ids: Sequence[int]  # as sent: a list, or `TokenIds` (a session's ids with their JSON, read-only)
    output_ids: list[int]
    output_logprobs: list[float]
    text: str
    finish_reason: str  # stop | length | abort
    policy_version: int
    stop_reason: str | int | None = None
    # per output token, when `SamplingParams.logprobs` asked for N: the top N alternatives and the sampled
    # token, {token text: logprob} as vLLM returns them (tokens with the same text share one entry)
    top_logprobs: list[dict[str, float]] | None = None
    # mixture-of-experts servers: (tokens fed, layers, top_k) int16, the experts of each token of prompt + output
    # as the model's input (vLLM's `routed_experts`); None when the server reports none
    routed_experts: np.ndarray | None = None
    # truncated draws: each token's kept-set size m, and the kept ids of the sets of m <= SUPPORT_IDS_CAP,
    # concatenated (the turn's `support_sizes` / `support_ids`); None: no truncation recorded
    support_sizes: list[int] | None = None
    support_ids: list[int] | None = None
    # weights changed mid-call: version_values[k] sampled the tokens from version_starts[k] on; None: one version
    version_starts: list[int] | None = None
    version_values: list[int] | None = None


@dataclass(frozen=True)
class Chunk:
    """A piece of a streamed sample: the tokens sampled since the previous piece, in order.

    The last piece of a stream has `finish_reason` set (and may hold no tokens)."""

    output_ids: list[int]
    output_logprobs: list[float]
    text: str
    policy_version: int
    top_logprobs: list[dict[str, float]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    routed_experts: np.ndarray | None = None  # MoE: the whole stream's routes, on its last chunk (`Sample`'s)
    # kept sets (as in `Sample`) of the stream's tokens not covered by an earlier chunk's, in token order: a
    # server may send them with each chunk, as vLLM does, or all with the last one, as the embedded server does
    support_sizes: list[int] | None = None
    support_ids: list[int] | None = None
    # the server's spans over the whole output (vLLM sends them on the last chunk only), when it sends them
    version_starts: list[int] | None = None
    version_values: list[int] | None = None


@dataclass
class StreamedSample:
    """The chunks of one stream joined into the `Sample` they make up (`add` each, then `sample()`).

    Version spans come from the chunks' versions as they change, unless a chunk carries the server's spans."""

    prompt_ids: Sequence[int]
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] | None = None
    text: str = ""
    policy_version: int | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    routed_experts: np.ndarray | None = None
    support_sizes: list[int] | None = None
    support_ids: list[int] | None = None
    version_starts: list[int] = field(default_factory=list)
    version_values: list[int] = field(default_factory=list)

    def add(self, chunk: Chunk) -> None:
        if chunk.support_sizes is not None and chunk.support_ids is not None:
            self.support_sizes = (self.support_sizes or []) + chunk.support_sizes
            self.support_ids = (self.support_ids or []) + chunk.support_ids
        if chunk.version_starts is not None and chunk.version_values is not None:
            self.version_starts, self.version_values = list(chunk.version_starts), list(chunk.version_values)
        elif chunk.output_ids and (not self.version_values or self.version_values[-1] != chunk.policy_version):
            self.version_starts.append(len(self.output_ids))
            self.version_values.append(chunk.policy_version)
        self.output_ids.extend(chunk.output_ids)
        self.output_logprobs.extend(chunk.output_logprobs)
        if chunk.top_logprobs is not None:
            self.top_logprobs = (self.top_logprobs or []) + chunk.top_logprobs
        self.text += chunk.text
        if self.policy_version is None:
            self.policy_version = chunk.policy_version
        if chunk.finish_reason is not None:
            self.finish_reason, self.stop_reason = chunk.finish_reason, chunk.stop_reason
        if chunk.routed_experts is not None:
            self.routed_experts = chunk.routed_experts

    def sample(self) -> Sample:
        """The joined sample; a stream that ended without a finish reason was cut short: `abort`."""
        mixed = len(self.version_values) > 1
        first = self.version_values[0] if self.version_values else self.policy_version
        return Sample(prompt_ids=self.prompt_ids, output_ids=self.output_ids, output_logprobs=self.output_logprobs,
                      text=self.text, finish_reason=self.finish_reason or "abort",
                      policy_version=first if first is not None else -1,
                      stop_reason=self.stop_reason, top_logprobs=self.top_logprobs, routed_experts=self.routed_experts,
                      version_starts=self.version_starts if mixed else None,
                      version_values=self.version_values if mixed else None, **self._support())

    def _support(self) -> dict[str, list[int] | None]:
        """The kept sets when the stream brought one for every token; else none (a partial record is no record)."""
        whole = self.support_sizes is not None and len(self.support_sizes) == len(self.output_ids)
        return {"support_sizes": self.support_sizes if whole else None,
                "support_ids": self.support_ids if whole else None}


def support_from_sets(sets: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """Kept sets, one per sampled token (vLLM's `sampling_mask`), as (support_sizes, support_ids): the ids of
    sets of at most SUPPORT_IDS_CAP ids, sorted; a larger set by its size alone (see `trajstore.events`)."""
    sizes, ids = [], []
    for kept in sets:
        sizes.append(len(kept))
        if len(kept) <= SUPPORT_IDS_CAP:
            ids.extend(sorted(kept))
    return sizes, ids


@runtime_checkable
class PolicyClient(Protocol):
    """A policy server. Implementations: `EmbeddedClient` (collectors.policy.embedded_client) and `VLLMClient`
    (collectors.policy.vllm_client).
    `EmbeddedClient` is also a `PublishedLoader`."""

    base_url: str

    async def complete(self, prompt_ids: Sequence[int], sampling: SamplingParams, *,
                       session_id: str | None = None) -> Sample:
        """Sample a continuation of `prompt_ids`. `session_id` keeps a session on one server
        behind vLLM's router (the X-Session-ID header)."""
        ...

    def stream(self, prompt_ids: Sequence[int], sampling: SamplingParams, *,
               session_id: str | None = None) -> AsyncIterator[Chunk]:
        """Sample like `complete`, yielding the tokens as the server produces them; the last chunk has
        the finish reason. Closing the iterator early (`aclose`) stops the request on the server."""
        ...

    async def models(self) -> list[str]:
        """The served model names."""
        ...

    async def load_weights(self, path: str, version: int) -> None:
        """Hot-reload a checkpoint; later samples report `version`."""
        ...

    async def aclose(self) -> None:
        ...


@runtime_checkable
class PublishedLoader(Protocol):
    """A policy server that fetches a published checkpoint itself (`trajstore serve`; not vLLM).

    A collector names the version as the learner announced it; the server loads `path` when its
    own disk holds the announced directory there, else fetches `uri` into its own checkpoint
    cache and checks it against `digest` (`trajstore.artifacts.local_copy`). So a server on
    another host than the collector's, or than the learner's, needs no shared disk.
    """

    async def load_published(self, request: LoadRequest) -> str:
        """Load the version published at `request.uri` (manifest sha256 `request.digest`); returns the directory
        the server loaded."""
        ...
