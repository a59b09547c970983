"""The policy-server contract every collector talks to: token ids in, sampled ids and logprobs out.

`PolicyClient` is a Protocol with two implementations (the embedded server and vLLM), both
speaking vLLM's `/v1/completions` with token-id prompts. A collector never re-tokenizes
what the model returned: `Sample.output_ids` are the engine's ids, `Sample.output_logprobs`
the logprobs of the distribution each was drawn from, and `Sample.policy_version` the
checkpoint version that produced all of them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)

# The ranges every edge checks (the embedded server, the proxy's wire protocols), so a value that
# would overflow a tensor or a stored column is refused with a 400 and never reaches a batch.
TOP_K_MAX = 2**31 - 1  # far above any vocabulary: top_k beyond the vocabulary keeps every token
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # vLLM's: a 64-bit integer
MAX_POLICY_VERSION = 2**63 - 1  # versions are stored as int64 with every turn


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

    def as_json(self) -> dict[str, object]:
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "seed": self.seed, "stop": list(self.stop)}


@dataclass(frozen=True)
class Sample:
    """One completion, exactly as the engine produced it."""

    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    text: str
    finish_reason: str  # stop | length | abort
    policy_version: int
    stop_reason: str | int | None = None


@runtime_checkable
class PolicyClient(Protocol):
    """A policy server. Implementations: `EmbeddedClient`, `VLLMClient` (collectors.policy.clients)."""

    base_url: str

    async def complete(self, prompt_ids: Sequence[int], sampling: SamplingParams, *,
                       session_id: str | None = None) -> Sample:
        """Sample a continuation of `prompt_ids`. `session_id` keeps a session on one server
        behind vLLM's router (the X-Session-ID header)."""
        ...

    async def models(self) -> list[str]:
        """The served model names."""
        ...

    async def load_weights(self, path: str, version: int) -> None:
        """Hot-reload a checkpoint; later samples report `version`."""
        ...

    async def aclose(self) -> None:
        ...
