"""learner.policy_losses (GSPO, CISPO) against numbers worked out by hand and against references
written from each paper's formula, values and gradients, under the learner's aggregations.

e^x to 6 decimals: e^0.1 = 1.105171, e^0.2 = 1.221403, e^0.3 = 1.349859, e^0.5 = 1.648721,
e^-0.3 = 0.740818.
"""

from __future__ import annotations

import pytest
import torch

from learner.losses import seq_mean_token_mean, token_mean
from learner.policy_losses import cispo_loss, gspo_loss

F64 = torch.float64


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


# ---------------------------------------------------------------- GSPO


def test_gspo_by_hand() -> None:
    # three sequences, band [0.8, 1.28] to keep the arithmetic readable
    seq = torch.tensor([0, 0, 1, 1, 1, 2])
    log_ratio = t(0.1, 0.3, 0.4, 0.2, 0.3, -0.3)
    adv = t(1.0, 1.0, 2.0, 2.0, 2.0, -1.0)
    old = torch.full((6,), -1.0, dtype=F64)
    lp = (old + log_ratio).requires_grad_()

    loss, low, high = gspo_loss(lp, old, adv, seq, 3, clip_low=0.2, clip_high=0.28)

    # seq 0: s = e^mean(0.1, 0.3) = e^0.2 = 1.221403 inside the band, A=1: -1.221403 on each token
    # seq 1: s = e^0.3 = 1.349859 > 1.28, A=2: clipped, -1.28*2 = -2.56 on each token
    # seq 2: s = e^-0.3 = 0.740818 < 0.8, A=-1: clipped, 0.8 on its token
    assert torch.allclose(loss, t(-1.221403, -1.221403, -2.56, -2.56, -2.56, 0.8), atol=1e-6)
    assert low.tolist() == [False] * 5 + [True] and high.tolist() == [False, False, True, True, True, False]

    # the paper's aggregation: (1/G) sum_i (1/|y_i|) sum_t; G = 3 sequences of weight 1
    seq_mean_token_mean(loss, torch.ones(6), seq, torch.ones(3, dtype=F64), total_weight=3.0).backward()
    # seq 0's tokens: d/d lp_t of (1/3)(1/2) sum_t -s A = -(1/3)(1/2) * s * A = -1.221403 / 6 = -0.203567
    assert lp.grad is not None
    assert torch.allclose(lp.grad, t(-0.203567, -0.203567, 0, 0, 0, 0), atol=1e-6)


def gspo_objective_from_the_paper(lp: torch.Tensor, old: torch.Tensor, adv_seq: torch.Tensor,
                                  seqs: list[torch.Tensor], rollout_of: list[int], rollout_segments: list[int],
                                  eps_low: float, eps_high: float) -> torch.Tensor:
    """Zheng et al. 2025, eq. 5-7, sequence by sequence: s_i = (prod_t pi/pi_old)^(1/|y_i|),
    J = mean over rollouts of the mean over its segments of min(s_i A_i, clip(s_i) A_i)."""
    terms = []
    for i, idx in enumerate(seqs):
        s_i = torch.prod(torch.exp(lp[idx] - old[idx])) ** (1.0 / len(idx))
        terms.append(torch.minimum(s_i * adv_seq[i], torch.clamp(s_i, 1 - eps_low, 1 + eps_high) * adv_seq[i])
                     / rollout_segments[i])
    return torch.stack(terms).sum() / len(set(rollout_of))


def test_gspo_matches_the_paper_with_a_fanned_out_rollout() -> None:
    # rollouts: A is one sequence, B fanned out into two segments (each is its own sequence, the
    # rollout counts once), C one sequence; lengths differ
    g = torch.Generator().manual_seed(7)
    lengths, rollout_of = [5, 3, 4, 2], [0, 1, 1, 2]
    segments = [2 if r == 1 else 1 for r in rollout_of]
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    n = int(seq.numel())
    old = -torch.rand(n, generator=g, dtype=F64) * 2
    lp = (old + torch.randn(n, generator=g, dtype=F64) * 0.05).requires_grad_()
    adv_seq = t(1.0, -0.5, -0.5, 2.0)  # a rollout's advantage on each of its segments
    adv = adv_seq[seq]
    eps_low, eps_high = 0.01, 0.02

    loss, _, _ = gspo_loss(lp, old, adv, seq, 4, clip_low=eps_low, clip_high=eps_high)
    ours = seq_mean_token_mean(loss, torch.ones(n), seq, 1.0 / torch.tensor(segments, dtype=F64), total_weight=3.0)
    (grad,) = torch.autograd.grad(ours, lp)
    seqs = [(seq == i).nonzero().squeeze(1) for i in range(4)]
    ref = -gspo_objective_from_the_paper(lp, old, adv_seq, seqs, rollout_of, segments, eps_low, eps_high)
    (ref_grad,) = torch.autograd.grad(ref, lp)
    assert ours.item() == pytest.approx(ref.item(), abs=1e-12)
    assert torch.allclose(grad, ref_grad, atol=1e-12)
    assert (grad != 0).any() and (grad == 0).any()  # some sequences clipped, some not: both branches checked


def test_gspo_on_policy_is_the_sequence_mean_policy_gradient() -> None:
    # lp == old: every s_i = 1, nothing clipped; each token's gradient is -A / |y_i| under the paper's mean
    lp = t(-0.5, -2.0, -0.1).requires_grad_()
    seq = torch.tensor([0, 0, 1])
    loss, low, high = gspo_loss(lp, lp.detach(), t(1.0, 1.0, -3.0), seq, 2)
    seq_mean_token_mean(loss, torch.ones(3), seq, torch.ones(2, dtype=F64), total_weight=2.0).backward()
    assert not (low | high).any()
    assert lp.grad is not None and torch.allclose(lp.grad, t(-0.25, -0.25, 1.5))


def test_gspo_validates() -> None:
    with pytest.raises(ValueError, match="GSPO paper"):
        gspo_loss(torch.zeros(2), torch.zeros(2), torch.zeros(2), torch.zeros(2, dtype=torch.long), 1, clip_low=1.0)


# ---------------------------------------------------------------- CISPO


def test_cispo_by_hand() -> None:
    old = t(-1.0, -1.0, -1.0, -1.0)
    lp = (old + t(0.1, 0.5, -0.3, 0.0)).requires_grad_()  # lp = [-0.9, -0.5, -1.3, -1]
    adv = t(1.0, 1.0, -1.0, 0.5)
    loss, low, high = cispo_loss(lp, old, adv, clip_low=0.2, clip_high=0.28)
    # w = [1.105171, 1.28 (clipped from 1.648721), 0.8 (clipped from 0.740818), 1]
    # loss = -w*A*lp = [0.994654, 0.64, -1.04, 0.5]
    assert torch.allclose(loss, t(0.994654, 0.64, -1.04, 0.5), atol=1e-6)
    assert low.tolist() == [False, False, True, False] and high.tolist() == [False, True, False, False]
    loss.sum().backward()
    # unlike PPO, clipped tokens keep a gradient: -w*A = [-1.105171, -1.28, 0.8, -0.5]
    assert lp.grad is not None and torch.allclose(lp.grad, t(-1.105171, -1.28, 0.8, -0.5), atol=1e-6)


def test_cispo_matches_the_paper_values_and_gradients() -> None:
    # MiniMax-M1 eq. 4: J = 1/sum|o_i| * sum_i sum_t sg(r_hat) A log pi, r_hat = clip(r, 1 - eps_low, 1 + eps_high)
    g = torch.Generator().manual_seed(9)
    old = -torch.rand(50, generator=g, dtype=F64) * 3
    lp = (old + torch.randn(50, generator=g, dtype=F64) * 0.5).requires_grad_()
    adv = torch.randn(50, generator=g, dtype=F64)
    mask = torch.rand(50, generator=g) > 0.2  # masked (prompt, tool) tokens take no part

    loss, _, _ = cispo_loss(lp, old, adv, clip_low=0.2, clip_high=0.28)
    ours = token_mean(loss, mask, total_tokens=float(mask.sum()))
    (grad,) = torch.autograd.grad(ours, lp)
    r_hat = torch.clamp(torch.exp(lp - old), 0.8, 1.28).detach()
    ref = -(r_hat * adv * lp)[mask].sum() / mask.sum()
    (ref_grad,) = torch.autograd.grad(ref, lp)
    assert ours.item() == pytest.approx(ref.item(), abs=1e-12)
    assert torch.allclose(grad, ref_grad, atol=1e-12)
    assert (grad[~mask] == 0).all() and (grad[mask] != 0).all()
