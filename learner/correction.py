"""Train/inference mismatch corrections: token masking (IcePop) and sequence rejection.

The behaviour logprobs a sample was recorded with come from the inference engine (and, past
`max_staleness` 0, an older policy); the trainer's logprobs of the same tokens differ. These
pure functions decide which tokens or whole samples are too far apart to learn from. They
return masks; the learner drops what they flag from the loss (zero gradient) and counts it in
the step's metrics. The step's normalizers are computed before any forward pass, so a dropped
token still counts in the denominator: dropping never rescales the rest of the step.

Shapes as in `learner.losses`: flat (N,) tensors over one micro-batch's trainable tokens,
`seq (N,)` the sample index 0..S-1 of each token. A sample is never split across
micro-batches (`learner.batching.pack`), so its sequence statistics are whole.
"""

from __future__ import annotations

import torch

from learner.losses import MAX_LOG_RATIO, _check_same_shape, kl_k3


def sequence_mean(values: torch.Tensor, seq: torch.Tensor, samples: int) -> torch.Tensor:
    """(S,) mean of `values (N,)` over each sample's tokens; 0 for a sample without tokens.
    Differentiable in `values`."""
    _check_same_shape(values=values, seq=seq)
    zeros = torch.zeros(samples, dtype=values.dtype, device=values.device)
    sums = zeros.index_add(0, seq, values)
    counts = zeros.index_add(0, seq, torch.ones_like(values))
    return sums / counts.clamp(min=1)


@torch.no_grad()
def sequence_log_ratio(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, seq: torch.Tensor,
                       samples: int) -> torch.Tensor:
    """(S,) log of each sample's geometric-mean ratio: mean_t (logprobs - behaviour), detached.

    exp of it is the length-normalized sequence ratio of GSPO and of geometric-mean rejection."""
    _check_same_shape(logprobs=logprobs, behaviour_logprobs=behaviour_logprobs, seq=seq)
    log_ratio = (logprobs.detach() - behaviour_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return sequence_mean(log_ratio, seq, samples)


@torch.no_grad()
def icepop_keep(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, *, low: float,
                high: float) -> torch.Tensor:
    """IcePop's two-sided token mask: keep a token when low <= pi_train / pi_infer <= high.

    Ling Team 2025, "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale
    Thinking Model" (arXiv 2510.18855), IcePop: tokens whose training/inference probability
    ratio k = exp(logprobs - behaviour_logprobs) leaves [low, high] (the paper: [0.5, 5]) are
    dropped from the gradient, on both sides, instead of being reweighted as TIS does.
    logprobs, behaviour_logprobs (N,). Returns keep (N,) bool.
    """
    _check_same_shape(logprobs=logprobs, behaviour_logprobs=behaviour_logprobs)
    if not 0 < low < 1 < high:
        raise ValueError(f"the IcePop ratio band must have 0 < low < 1 < high, got [{low}, {high}] "
                         "(the paper uses 0.5 and 5)")
    log_ratio = logprobs.detach() - behaviour_logprobs
    return (log_ratio >= torch.log(torch.tensor(low, dtype=log_ratio.dtype))) & (
        log_ratio <= torch.log(torch.tensor(high, dtype=log_ratio.dtype)))


@torch.no_grad()
def reject_geometric(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, seq: torch.Tensor,
                     samples: int, *, low: float, high: float) -> torch.Tensor:
    """Sequence rejection by the geometric-mean ratio: reject sample i when
    rho_i = exp(mean_t log(pi / mu)) leaves [low, high].

    The length-normalized ratio of GSPO (Zheng et al. 2025, arXiv 2507.18071), used as a
    rejection test on the train/inference mismatch as verl's rollout correction does
    ("geometric" sequence masking): unlike the plain sequence ratio it does not explode with
    length. Returns rejected (S,) bool; a sample without tokens is never rejected.
    """
    if not 0 < low < 1 < high:
        raise ValueError(f"the geometric-mean rejection band must have 0 < low < 1 < high, got [{low}, {high}]")
    rho = sequence_log_ratio(logprobs, behaviour_logprobs, seq, samples).exp()
    return (rho < low) | (rho > high)


@torch.no_grad()
def reject_k3(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, seq: torch.Tensor,
              samples: int, *, bound: float) -> torch.Tensor:
    """Sequence rejection by the mismatch KL: reject sample i when the mean over its tokens of
    k3 = r - 1 - log r, r = pi / mu (Schulman's k3 estimate of KL(mu || pi) on mu's samples),
    exceeds `bound`. k3 is >= 0 and counts both directions of mismatch, so one bound suffices
    (verl's rollout correction calls this the k3 rejection sampler). Returns rejected (S,) bool.
    """
    if not bound > 0:
        raise ValueError(f"the k3 rejection bound must be > 0, got {bound}")
    k3 = kl_k3(behaviour_logprobs.double(), logprobs.detach().double())
    return sequence_mean(k3, seq, samples) > bound
