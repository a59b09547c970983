"""On-policy distillation's loss: per-token reverse KL to a teacher on the student's own samples.

Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated
Mistakes" (GKD, arXiv 2306.13649), with the per-token reverse-KL form Thinking Machines'
"On-Policy Distillation" (2025, tinker-cookbook) popularized: the student samples, a teacher
scores the sampled tokens (`trajstore annotate` appends its logprobs to the store), and the
student minimizes

    KL(pi || T) = E_{y ~ pi} [ log pi(y) - log T(y) ]

one token at a time. Its gradient on the student's own samples is
E[(log pi(y_t) - log T(y_t)) grad log pi(y_t)]: a REINFORCE step whose per-token advantage is
-(log pi - log T), detached. The samples come from the behaviour policy mu (the recorded
logprobs), so each token carries the truncated importance weight min(pi / mu, cap), detached,
as `learner.losses.tis_pg_loss` does. A task reward can be mixed in with `reward_coef`: the
per-token advantage becomes -(log pi - log T) + reward_coef * A.

Shapes as in `learner.losses`: flat (N,) tensors over trainable tokens.
"""

from __future__ import annotations

import torch

from learner.losses import _check_same_shape, truncated_is_weights


def distill_loss(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                 advantages: torch.Tensor, *, reward_coef: float = 0.0,
                 cap: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
    """-w_t * (sg[log T(y_t) - log pi(y_t)] + reward_coef * A_t) * log pi(y_t), w_t = sg[min(pi / mu, cap)].

    d loss_t / d logprobs_t = w_t * (log pi(y_t) - log T(y_t) - reward_coef * A_t).
    logprobs (N,) differentiable; behaviour_logprobs, teacher_logprobs, advantages (N,).
    Returns loss (N,) and reverse_kl (N,) = logprobs - teacher_logprobs, detached: the k1
    estimate of the per-token reverse KL on the student's samples, for the metrics.
    """
    _check_same_shape(logprobs=logprobs, behaviour_logprobs=behaviour_logprobs,
                      teacher_logprobs=teacher_logprobs, advantages=advantages)
    weights = truncated_is_weights(logprobs, behaviour_logprobs, cap=cap)
    reverse_kl = logprobs.detach() - teacher_logprobs
    advantage = -reverse_kl + reward_coef * advantages.detach()
    return -weights * advantage * logprobs, reverse_kl
