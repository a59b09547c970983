"""The policy-server contract every collector talks to: token ids in, sampled ids and logprobs out.

`PolicyClient` is a Protocol with two implementations (the embedded server and vLLM), both
speaking vLLM's `/v1/completions` with token-id prompts. A collector never re-tokenizes
what the model returned: `Sample.output_ids` are the engine's ids, `Sample.output_logprobs`
the logprobs of the distribution each was drawn from, and `Sample.policy_version` the
checkpoint version that produced all of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)


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
