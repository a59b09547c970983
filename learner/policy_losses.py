"""GSPO and CISPO: two policy-gradient losses beyond PPO's token clip, as pure functions.

Shapes as in `learner.losses`: flat (N,) tensors over one micro-batch's trainable tokens,
`seq (N,)` the sample index 0..S-1 of each token; a sample is never split across
micro-batches, so its sequence ratio is whole. Each returns the per-token loss (N,), to be
aggregated like any other (`learner.losses.token_mean`, `seq_mean_token_mean`, ...), and the
tokens whose clip is active on each side.
"""

from __future__ import annotations

import torch

from learner.correction import sequence_mean
from learner.losses import MAX_LOG_RATIO, _check_same_shape


def gspo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, seq: torch.Tensor,
              samples: int, *, clip_low: float = 3e-4,
              clip_high: float = 4e-4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GSPO, in its token-level gradient form (Zheng et al. 2025, "Group Sequence Policy
    Optimization", arXiv 2507.18071, eqs. 5-7 and 13-14).

    The sequence ratio is length-normalized, a geometric mean of the token ratios:
        s_i = exp( (1/|y_i|) sum_t log(pi(y_t) / pi_old(y_t)) )
    and is clipped per sequence: J = (1/G) sum_i min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i).
    GSPO-token writes it per token with s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)]: the value of
    every token's ratio is s_i (so the clip decision is the sequence's), and
        grad s_{i,t} = s_i * grad log pi(y_t),
    so the token mean of -min(s_{i,t} A, clip(s_{i,t}) A) over a sequence has exactly GSPO's
    gradient s_i A_i (1/|y_i|) sum_t grad log pi(y_t) = A_i grad s_i. Aggregate with
    `seq_mean_token_mean` for the paper's (1/G) sum_i (1/|y_i|) sum_t; token_mean weighs
    sequences by length instead. The paper clips at 3e-4 and 4e-4 (sequence ratios sit far
    closer to 1 than token ratios).
    logprobs (N,) differentiable; old_logprobs, advantages, seq (N,); samples = S.
    Returns loss (N,), clipped_low (N,), clipped_high (N,) bool (the sequence's clip is active
    and pushes the ratio below / above the band: zero gradient there).
    """
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, seq=seq)
    if not (0 <= clip_low < 1 and clip_high >= 0):
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got clip_low={clip_low}, "
                         f"clip_high={clip_high} (the GSPO paper uses 3e-4 and 4e-4)")
    log_ratio = (logprobs - old_logprobs.detach()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    log_s = sequence_mean(log_ratio.detach(), seq, samples)[seq]  # (N,) sg[log s_i] on each token
    ratio = (log_s + logprobs - logprobs.detach()).exp()  # value s_i, gradient s_i * grad logprobs
    advantages = advantages.detach()
    unclipped = ratio * advantages
    clipped_term = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    clipped = clipped_term < unclipped
    loss = -torch.where(clipped, clipped_term, unclipped)
    above = log_s.detach() > 0
    return loss, clipped & ~above, clipped & above


def cispo_loss(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, advantages: torch.Tensor, *,
               clip_low: float = 0.2, clip_high: float = 0.28) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning
    Attention", arXiv 2506.13585, eqs. 4-5): clip the importance weight, not the update.

        r_t = pi(y_t) / pi_old(y_t),   w_t = sg[ clip(r_t, 1 - clip_low, 1 + clip_high) ]
        loss_t = -w_t * A_t * log pi(y_t)

    Unlike PPO, a token whose ratio leaves the band keeps its gradient (-w_t A_t on its
    logprob), with the weight held at the band's edge; nothing is dropped, so rare tokens that
    matter for reflection keep contributing. The paper sets no lower bound (a clip_low close to
    1 comes near that) and tunes only the upper one; it aggregates by token_mean.
    logprobs (N,) differentiable; behaviour_logprobs, advantages (N,).
    Returns loss (N,), clipped_low (N,), clipped_high (N,) bool (the weight was clipped).
    """
    _check_same_shape(logprobs=logprobs, behaviour_logprobs=behaviour_logprobs, advantages=advantages)
    if not (0 <= clip_low < 1 and clip_high >= 0):
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got clip_low={clip_low}, "
                         f"clip_high={clip_high}")
    with torch.no_grad():
        ratio = (logprobs - behaviour_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()
        weight = ratio.clamp(1 - clip_low, 1 + clip_high)
    return -weight * advantages.detach() * logprobs, ratio < 1 - clip_low, ratio > 1 + clip_high
