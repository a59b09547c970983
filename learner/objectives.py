"""The choices of `learn --loss`, `--kl-estimator` and `--reject`, one visible dict each, and
the step's corrections and statistics around them.

Every loss maps the same `LossInputs` (one micro-batch's trainable tokens) and the settings to
a `TokenLoss`: the per-token loss (N,) before aggregation and the tokens whose clip is active
on each side (reported as clip_fraction_low / clip_fraction_high). The math lives in pure
functions (`learner.losses`, `learner.policy_losses`, `learner.distill`, `learner.correction`);
this module only wires the settings to them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from learner.correction import icepop_keep, reject_geometric, reject_k3, sequence_log_ratio
from learner.distill import distill_loss
from learner.errors import LearnerError
from learner.losses import LossStats, kl_k1, kl_k2, kl_k3_clamped, ppo_clip_loss, tis_pg_loss
from learner.policy_losses import cispo_loss, gspo_loss
from learner.settings import LearnSettings


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch's trainable tokens, flat (N,), and its sample count S."""

    logprobs: torch.Tensor  # (N,) differentiable: the policy being trained
    behaviour: torch.Tensor  # (N,) what the sampler recorded
    advantages: torch.Tensor  # (N,) the sample's (rollout's) advantage on each of its tokens
    seq: torch.Tensor  # (N,) int64 sample index 0..S-1
    samples: int  # S
    teacher: torch.Tensor | None = None  # (N,) the teacher's logprobs (loss "distill")


@dataclass(frozen=True)
class TokenLoss:
    loss: torch.Tensor  # (N,) per-token loss, before aggregation
    clipped_low: torch.Tensor  # (N,) bool: a clip is active below the band (ratio < 1 side)
    clipped_high: torch.Tensor  # (N,) bool: ... above it (ratio > 1 side)
    reverse_kl: torch.Tensor | None = None  # (N,) distill: log pi - log T per token


def _sides(clipped: torch.Tensor, x: LossInputs) -> tuple[torch.Tensor, torch.Tensor]:
    above = x.logprobs.detach() > x.behaviour
    return clipped & ~above, clipped & above


def _ppo(x: LossInputs, s: LearnSettings) -> TokenLoss:
    loss, clipped = ppo_clip_loss(x.logprobs, x.behaviour, x.advantages, clip_low=s.clip_low,
                                  clip_high=s.clip_high, dual_clip=s.dual_clip)
    return TokenLoss(loss, *_sides(clipped, x))


def _tis(x: LossInputs, s: LearnSettings) -> TokenLoss:
    truncated = (x.logprobs.detach() - x.behaviour) > math.log(s.is_cap)  # the weight's cap binds: high side
    return TokenLoss(tis_pg_loss(x.logprobs, x.behaviour, x.advantages, cap=s.is_cap),
                     torch.zeros_like(truncated), truncated)


def _gspo(x: LossInputs, s: LearnSettings) -> TokenLoss:
    return TokenLoss(*gspo_loss(x.logprobs, x.behaviour, x.advantages, x.seq, x.samples,
                                clip_low=s.seq_clip_low, clip_high=s.seq_clip_high))


def _cispo(x: LossInputs, s: LearnSettings) -> TokenLoss:
    return TokenLoss(*cispo_loss(x.logprobs, x.behaviour, x.advantages, clip_low=s.clip_low, clip_high=s.clip_high))


def _distill(x: LossInputs, s: LearnSettings) -> TokenLoss:
    if x.teacher is None:
        raise LearnerError("--loss distill needs the teacher's logprobs of every sample; annotate the store "
                           "first with `trajstore annotate --teacher-model DIR --name NAME` and pass --teacher NAME")
    loss, reverse_kl = distill_loss(x.logprobs, x.behaviour, x.teacher, x.advantages,
                                    reward_coef=s.distill_reward_coef, cap=s.is_cap)
    truncated = (x.logprobs.detach() - x.behaviour) > math.log(s.is_cap)
    return TokenLoss(loss, torch.zeros_like(truncated), truncated, reverse_kl)


LOSSES: dict[str, Callable[[LossInputs, LearnSettings], TokenLoss]] = {
    "ppo": _ppo, "tis": _tis, "gspo": _gspo, "cispo": _cispo, "distill": _distill,
}

# per-token KL(pi || reference) as a loss term: (logprobs (N,), ref_logprobs (N,)) -> (N,)
KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": kl_k1, "k2": kl_k2, "k3": kl_k3_clamped,
}

# (inputs, settings) -> rejected (S,) bool
REJECTIONS: dict[str, Callable[[LossInputs, LearnSettings], torch.Tensor]] = {
    "none": lambda x, s: torch.zeros(x.samples, dtype=torch.bool, device=x.seq.device),
    "geo": lambda x, s: reject_geometric(x.logprobs, x.behaviour, x.seq, x.samples, low=s.reject_low,
                                         high=s.reject_high),
    "k3": lambda x, s: reject_k3(x.logprobs, x.behaviour, x.seq, x.samples, bound=s.reject_high),
}


def kept_tokens(x: LossInputs, s: LearnSettings) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Which tokens stay in the loss: (keep (N,), masked (N,) by IcePop, rejected (S,) samples)."""
    if s.mask_ratio is not None:
        masked = ~icepop_keep(x.logprobs, x.behaviour, low=s.mask_ratio[0], high=s.mask_ratio[1])
    else:
        masked = torch.zeros_like(x.seq, dtype=torch.bool)
    rejected = REJECTIONS[s.reject](x, s)
    return ~masked & ~rejected[x.seq], masked, rejected


@torch.no_grad()
def objective_stats(x: LossInputs, out: TokenLoss, masked: torch.Tensor, rejected: torch.Tensor) -> LossStats:
    """The loss choice's sums for the metrics: clip sides, IcePop-masked tokens, rejected samples and
    their tokens, the samples' geometric-mean ratios to the behaviour policy, distill's reverse KL."""
    seq_ratio = sequence_log_ratio(x.logprobs, x.behaviour, x.seq, x.samples).double().exp()
    tokens_per_sample = torch.bincount(x.seq, minlength=x.samples)
    return LossStats(
        clipped_low=float(out.clipped_low.sum()), clipped_high=float(out.clipped_high.sum()),
        masked_tokens=float(masked.sum()), rejected_samples=float(rejected.sum()),
        rejected_tokens=float(tokens_per_sample[rejected].sum()),
        seq_samples=float(x.samples), seq_ratio_sum=float(seq_ratio.sum()),
        seq_ratio_min=float(seq_ratio.min()) if x.samples else math.inf,
        seq_ratio_max=float(seq_ratio.max()) if x.samples else -math.inf,
        distill_kl_sum=float(out.reverse_kl.double().sum()) if out.reverse_kl is not None else 0.0,
        distill_tokens=float(out.reverse_kl.numel()) if out.reverse_kl is not None else 0.0,
    )
