"""learner.losses against numbers worked out by hand, plus autograd checks of the gradients.

Expected values are written out as arithmetic in the comments; e^x values to 6 decimals:
e^0.1 = 1.105171, e^0.2 = 1.221403, e^0.25 = 1.284025, e^0.3 = 1.349859, e^-0.2 = 0.818731,
e^-0.25 = 0.778801, e^-0.3 = 0.740818, e^0.5 = 1.648721, e = 2.718282, e^-1 = 0.367879.
"""

from __future__ import annotations

import math

import pytest
import torch

from learner.losses import (
    KL_K3_MAX,
    LossStats,
    entropy,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_k3_clamped,
    loss_stats,
    ppo_clip_loss,
    seq_mean_token_mean,
    seq_mean_token_sum,
    tis_pg_loss,
    token_logprobs,
    token_mean,
    truncated_is_weights,
)

F64 = torch.float64


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


# ---------------------------------------------------------------- token_logprobs / entropy


def test_token_logprobs_by_hand() -> None:
    # logits [0, ln 3] -> softmax [1/4, 3/4]; logits [0, 0, 0, 0] -> 1/4 each
    logits = torch.tensor([[0.0, math.log(3), -1e4, -1e4], [0.0, 0.0, 0.0, 0.0]], dtype=F64)
    lp = token_logprobs(logits, torch.tensor([1, 2]))
    assert lp.dtype == F64
    assert torch.allclose(lp, t(math.log(0.75), math.log(0.25)))  # -0.287682, -1.386294


@pytest.mark.parametrize("chunk_rows", [None, 1, 3, 100])
def test_token_logprobs_matches_log_softmax_and_its_gradient(chunk_rows: int | None) -> None:
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(7, 11, generator=g, dtype=F64) * 3).requires_grad_()
    targets = torch.randint(0, 11, (7,), generator=g)
    upstream = torch.randn(7, generator=g, dtype=F64)

    lp = token_logprobs(logits, targets, chunk_rows=chunk_rows)
    (grad,) = torch.autograd.grad((lp * upstream).sum(), logits)
    ref = torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).squeeze(1)
    (ref_grad,) = torch.autograd.grad((ref * upstream).sum(), logits)

    assert torch.allclose(lp, ref, atol=1e-12)
    assert torch.allclose(grad, ref_grad, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, targets, chunk_rows=chunk_rows), (logits,))


def test_token_logprobs_bf16_logits_compute_in_float32() -> None:
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(9, 50, generator=g) * 4).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 50, (9,), generator=g)

    lp = token_logprobs(logits, targets, chunk_rows=4)
    lp.sum().backward()

    # the reference upcasts the same bf16 values, so the forward agrees to float32 rounding
    x = logits.detach().float().requires_grad_()
    ref = torch.log_softmax(x, dim=-1).gather(1, targets[:, None]).squeeze(1)
    ref.sum().backward()
    assert lp.dtype == torch.float32
    assert torch.allclose(lp, ref, atol=1e-5)
    # a bf16 parameter gets a bf16 gradient; bf16 keeps ~3 significant digits of values in [-1, 1]
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16
    assert torch.allclose(logits.grad.float(), x.grad, atol=4e-3)


def test_token_logprobs_keeps_no_float32_copy_of_bf16_logits_for_backward() -> None:
    # what autograd stores for the backward pass: only the bf16 logits and (N,) vectors,
    # never an (N, V) float32 tensor (plain log_softmax(logits.float()) would store one)
    saved: list[tuple[torch.dtype, int]] = []

    def pack(x: torch.Tensor) -> torch.Tensor:
        saved.append((x.dtype, x.numel()))
        return x

    logits = torch.randn(8, 64).to(torch.bfloat16).requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        token_logprobs(logits, torch.zeros(8, dtype=torch.long), chunk_rows=2).sum().backward()
    assert (torch.bfloat16, 8 * 64) in saved
    assert all(numel < 8 * 64 for dtype, numel in saved if dtype != torch.bfloat16)

    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        torch.log_softmax(logits.float(), dim=-1).sum().backward()
    assert (torch.float32, 8 * 64) in saved  # the check above can see such a copy


def test_token_logprobs_rejects_unflattened_logits() -> None:
    with pytest.raises(ValueError, match="flatten"):
        token_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long))


def test_entropy_by_hand() -> None:
    logits = torch.tensor([
        [0.0] * 8,  # uniform over 8: ln 8 = 2.079442
        [0.0, math.log(3)] + [-math.inf] * 6,  # p = [1/4, 3/4]: 0.25 ln 4 + 0.75 ln(4/3) = 0.562335
        [0.0, 0.0] + [-math.inf] * 6,  # uniform over 2 (the rest masked out by top-k): ln 2
    ], dtype=F64)
    h = entropy(logits, chunk_rows=2)
    expected = t(math.log(8), 0.25 * math.log(4) + 0.75 * math.log(4 / 3), math.log(2))
    assert torch.allclose(h, expected)
    assert not h.requires_grad


def test_entropy_matches_definition_on_bf16() -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 30, generator=g).to(torch.bfloat16).requires_grad_()
    h = entropy(logits)
    p = torch.softmax(logits.detach().float(), dim=-1)
    assert h.dtype == torch.float32 and not h.requires_grad
    assert torch.allclose(h, -(p * p.log()).sum(-1), atol=1e-5)


# ---------------------------------------------------------------- PPO clip


def test_ppo_clip_loss_by_hand() -> None:
    # clip_low 0.2 -> lower bound 0.8; clip_high 0.28 -> upper bound 1.28
    log_ratio = t(0.1, 0.3, 0.3, -0.3, -0.3, 0.25, 0.2, -0.2, -0.25, 0.5)
    adv = t(1.0, 1.0, -1.0, -1.0, 1.0, 2.0, 2.0, -1.0, -1.0, 0.0)
    old = torch.full((10,), -1.5, dtype=F64)
    lp = (old + log_ratio).requires_grad_()

    loss, clipped = ppo_clip_loss(lp, old, adv, clip_low=0.2, clip_high=0.28)

    expected = t(
        -1.105171,  # r = e^0.1 = 1.105171 < 1.28, A>0: unclipped, -r*A
        -1.28,  # r = e^0.3 = 1.349859 > 1.28, A>0: clipped term 1.28 is smaller -> -1.28
        1.349859,  # r = 1.349859, A<0: min(-1.349859, -1.28) = -1.349859 unclipped: PPO never clips this side
        0.8,  # r = e^-0.3 = 0.740818 < 0.8, A<0: min(-0.740818, -0.8) = -0.8 clipped
        -0.740818,  # r = 0.740818, A>0: min(0.740818, 0.8) unclipped
        -2.56,  # r = e^0.25 = 1.284025 > 1.28 just past the upper bound, A=2: -1.28*2
        -2.442806,  # r = e^0.2 = 1.221403 < 1.28 (a symmetric 0.2 clip would cut it): -1.221403*2
        0.818731,  # r = e^-0.2 = 0.818731 > 0.8, A<0: unclipped
        0.8,  # r = e^-0.25 = 0.778801 < 0.8, A<0: clipped to -0.8*-1
        0.0,  # A = 0: both terms 0, nothing to clip
    )
    assert torch.allclose(loss, expected, atol=1e-6)
    assert clipped.tolist() == [False, True, False, True, False, True, False, False, True, False]

    # d/d lp of -r*A is -A*r (dr/dlp = r); divided by total_tokens through token_mean;
    # clipped tokens get exactly 0
    total = 10.0
    token_mean(loss, torch.ones(10), total_tokens=total).backward()
    ratio = log_ratio.exp()
    expected_grad = torch.where(clipped, torch.zeros_like(ratio), -adv * ratio / total)
    assert lp.grad is not None
    assert torch.allclose(lp.grad, expected_grad)
    assert (lp.grad[clipped] == 0).all()
    # e.g. token 0: -1 * 1.105171 / 10 = -0.1105171; token 2: +1.349859 / 10
    assert lp.grad[0].item() == pytest.approx(-0.1105171, abs=1e-6)
    assert lp.grad[2].item() == pytest.approx(0.1349859, abs=1e-6)


def test_ppo_clip_loss_on_policy_is_plain_policy_gradient() -> None:
    # old == lp: r = 1 everywhere, nothing clipped, loss = -A, gradient = -A
    lp = t(-0.5, -2.0, -0.1).requires_grad_()
    adv = t(1.5, -0.5, 0.0)
    loss, clipped = ppo_clip_loss(lp, lp.detach(), adv)
    loss.sum().backward()
    assert torch.allclose(loss, -adv) and not clipped.any()
    assert lp.grad is not None and torch.allclose(lp.grad, -adv)


def test_ppo_clip_loss_stays_finite_on_garbage_positions() -> None:
    # a prompt position may carry a meaningless behaviour logprob (here -200) next to the
    # model's -1: in float32 exp(199) overflows to inf, inf * A=0 is NaN, and the NaN would
    # reach the gradient through the masked position (0 * inf) even though the aggregation
    # drops its value; neither the loss nor the gradient may become NaN
    lp = torch.tensor([-1.0, -1.0], requires_grad=True)
    old = torch.tensor([-200.0, -1.0])
    loss, _ = ppo_clip_loss(lp, old, torch.tensor([0.0, 1.0]))
    token_mean(loss, torch.tensor([False, True]), total_tokens=1.0).backward()
    assert torch.isfinite(loss).all()
    assert lp.grad is not None and lp.grad.tolist() == [0.0, -1.0]
    k = kl_k3(torch.tensor([-200.0], requires_grad=True), torch.tensor([-1.0]))
    assert torch.isfinite(k).all()


def test_ppo_clip_loss_validates() -> None:
    with pytest.raises(ValueError, match="flat"):
        ppo_clip_loss(torch.zeros(3), torch.zeros(3, 1), torch.zeros(3))
    with pytest.raises(ValueError, match="clip_low"):
        ppo_clip_loss(torch.zeros(3), torch.zeros(3), torch.zeros(3), clip_low=1.0)


# ---------------------------------------------------------------- truncated IS


def test_truncated_is_weights_by_hand() -> None:
    behaviour = t(-1.0, -1.0, -1.0, -1.0)
    lp = (behaviour + t(0.5, 1.0, -1.0, math.log(3))).requires_grad_()
    w = truncated_is_weights(lp, behaviour, cap=2.0)
    # e^0.5 = 1.648721 < 2 kept; e^1 = 2.718282 > 2 -> 2; e^-1 = 0.367879 kept; 3 > 2 -> 2
    assert torch.allclose(w, t(1.648721, 2.0, 0.367879, 2.0), atol=1e-6)
    assert not w.requires_grad


def test_tis_pg_loss_by_hand_and_gradient() -> None:
    behaviour = t(-1.0, -1.0, -2.0, -0.5)
    lp = (behaviour + t(0.5, 1.0, -1.0, 0.0)).requires_grad_()  # lp = [-0.5, 0, -3, -0.5]
    adv = t(1.0, 1.0, -2.0, 0.5)
    loss = tis_pg_loss(lp, behaviour, adv, cap=2.0)
    # w = [1.648721, 2 (capped from 2.718282), 0.367879, 1]
    # loss = -w*A*lp: [-1.648721*1*-0.5, -2*1*0, -0.367879*-2*-3, -1*0.5*-0.5]
    #               = [0.824361, 0, -2.207277, 0.25]
    assert torch.allclose(loss, t(0.824361, 0.0, -2.207277, 0.25), atol=1e-6)
    loss.sum().backward()
    # the weight is a constant: d loss / d lp = -w*A = [-1.648721, -2, 0.735759, -0.5]
    assert lp.grad is not None
    assert torch.allclose(lp.grad, t(-1.648721, -2.0, 0.735759, -0.5), atol=1e-6)


def test_truncated_is_weights_validates_cap() -> None:
    with pytest.raises(ValueError, match="cap"):
        truncated_is_weights(torch.zeros(2), torch.zeros(2), cap=0.0)


# ---------------------------------------------------------------- k3


def test_kl_k3_by_hand_and_gradient() -> None:
    lp = t(-1.0, -1.0, -2.0).requires_grad_()
    ref = t(-1.0, -2.0, -1.0)
    k = kl_k3(lp, ref)
    # d = ref - lp = [0, -1, 1]: e^0-0-1 = 0; e^-1+1-1 = 0.367879; e^1-1-1 = 0.718282
    assert torch.allclose(k, t(0.0, 0.367879, 0.718282), atol=1e-6)
    assert k[0].item() == 0.0 and (k[1:] > 0).all()
    k.sum().backward()
    # d k3 / d lp = -e^d + 1: [0, 1 - 0.367879, 1 - 2.718282] = [0, 0.632121, -1.718282]
    assert lp.grad is not None
    assert torch.allclose(lp.grad, t(0.0, 0.632121, -1.718282), atol=1e-6)


def test_kl_k3_is_never_negative() -> None:
    g = torch.Generator().manual_seed(3)
    lp, ref = torch.randn(200, generator=g, dtype=F64) * 3, torch.randn(200, generator=g, dtype=F64) * 3
    assert (kl_k3(lp, ref) >= 0).all()


# ---------------------------------------------------------------- aggregations

# One step: rollout A fanned out into two samples (seq 0 and 1), rollout B is one sample
# (seq 2), rollout C one sample without trainable tokens (seq 3). Position 0 is a prompt
# token carrying NaN, position 8 a masked-out tool-output token: neither may count.
LOSS = t(math.nan, 2, 3, 4, 6, 10, 20, 30, 40, 99)
SEQ = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3])
MASK = torch.tensor([0, 1, 1, 1, 1, 1, 1, 1, 0, 0], dtype=torch.bool)
SEQ_WEIGHT = t(0.5, 0.5, 1.0, 1.0)  # 1 / segments of the sample's rollout
ROLLOUTS = 3.0


def test_token_mean_by_hand() -> None:
    # trainable: 2+3+4+6+10+20+30 = 75 over 7 tokens
    assert token_mean(LOSS, MASK, total_tokens=7.0).item() == pytest.approx(75 / 7)
    # float masks work too
    assert token_mean(LOSS, MASK.double(), total_tokens=7.0).item() == pytest.approx(75 / 7)


def test_seq_mean_token_mean_by_hand() -> None:
    # sample means: s0 (2+3)/2 = 2.5, s1 (4+6)/2 = 5, s2 (10+20+30)/3 = 20, s3 no tokens -> 0
    # weighted: 0.5*2.5 + 0.5*5 + 1*20 + 1*0 = 23.75; over 3 rollouts = 7.916667
    got = seq_mean_token_mean(LOSS, MASK, SEQ, SEQ_WEIGHT, total_weight=ROLLOUTS)
    assert got.item() == pytest.approx(23.75 / 3)


def test_seq_mean_token_sum_by_hand() -> None:
    # sample sums: 5, 10, 60, 0; / normalizer 10 -> 0.5, 1, 6, 0
    # weighted: 0.25 + 0.5 + 6 + 0 = 6.75; over 3 rollouts = 2.25
    got = seq_mean_token_sum(LOSS, MASK, SEQ, SEQ_WEIGHT, normalizer=10.0, total_weight=ROLLOUTS)
    assert got.item() == pytest.approx(2.25)


def test_fanned_out_rollout_counts_once() -> None:
    # rollout A's two samples with weights 1/2 each contribute the mean of its sample means,
    # (2.5 + 5) / 2 = 3.75: exactly what a one-sample rollout with mean 3.75 contributes
    loss = t(2, 3, 4, 6, 3.75)
    seq = torch.tensor([0, 0, 1, 1, 2])
    mask = torch.ones(5, dtype=torch.bool)
    fanned = seq_mean_token_mean(loss[:4], mask[:4], seq[:4], t(0.5, 0.5), total_weight=1.0)
    single = seq_mean_token_mean(loss[4:], mask[4:], torch.tensor([0]), t(1.0), total_weight=1.0)
    assert fanned.item() == pytest.approx(single.item()) == pytest.approx(3.75)
    # and two rollouts of equal means make the whole step's loss their mean, not 2/3 vs 1/3
    both = seq_mean_token_mean(loss, mask, seq, t(0.5, 0.5, 1.0), total_weight=2.0)
    assert both.item() == pytest.approx(3.75)


def test_aggregation_gradients_by_hand() -> None:
    loss = LOSS.clone().requires_grad_()
    seq_mean_token_mean(loss, MASK, SEQ, SEQ_WEIGHT, total_weight=ROLLOUTS).backward()
    # d / d loss_i = seq_weight[s] / (tokens of s * rollouts): s0, s1: 0.5/(2*3) = 1/12,
    # s2: 1/(3*3) = 1/9; untrainable positions exactly 0 (not NaN, despite the NaN loss)
    expected = t(0, 1 / 12, 1 / 12, 1 / 12, 1 / 12, 1 / 9, 1 / 9, 1 / 9, 0, 0)
    assert loss.grad is not None
    assert torch.allclose(loss.grad, expected)

    loss.grad = None
    seq_mean_token_sum(loss, MASK, SEQ, SEQ_WEIGHT, normalizer=10.0, total_weight=ROLLOUTS).backward()
    # seq_weight[s] / (normalizer * rollouts): s0, s1: 0.5/30 = 1/60; s2: 1/30 — length-independent
    assert torch.allclose(loss.grad, t(0, 1 / 60, 1 / 60, 1 / 60, 1 / 60, 1 / 30, 1 / 30, 1 / 30, 0, 0))


def test_micro_batches_add_up_to_the_step() -> None:
    # the step split into micro-batches [s0, s1] and [s2, s3] (seq renumbered per micro-batch)
    # gives the same total, because the normalizers are the whole step's
    whole = seq_mean_token_mean(LOSS, MASK, SEQ, SEQ_WEIGHT, total_weight=ROLLOUTS)
    first = seq_mean_token_mean(LOSS[:5], MASK[:5], SEQ[:5], SEQ_WEIGHT[:2], total_weight=ROLLOUTS)
    second = seq_mean_token_mean(LOSS[5:], MASK[5:], SEQ[5:] - 2, SEQ_WEIGHT[2:], total_weight=ROLLOUTS)
    assert (first + second).item() == pytest.approx(whole.item())
    tokens = token_mean(LOSS[:5], MASK[:5], total_tokens=7.0) + token_mean(LOSS[5:], MASK[5:], total_tokens=7.0)
    assert tokens.item() == pytest.approx(75 / 7)


def test_all_masked_micro_batch_is_zero_not_nan() -> None:
    loss = t(1.0, 2.0).requires_grad_()
    mask = torch.zeros(2, dtype=torch.bool)
    seq = torch.tensor([0, 1])
    for value in (
        token_mean(loss, mask, total_tokens=5.0),
        seq_mean_token_mean(loss, mask, seq, t(1.0, 1.0), total_weight=2.0),
        seq_mean_token_sum(loss, mask, seq, t(1.0, 1.0), normalizer=4.0, total_weight=2.0),
    ):
        assert value.item() == 0.0


def test_aggregations_validate_normalizers() -> None:
    with pytest.raises(ValueError, match="total_tokens"):
        token_mean(LOSS, MASK, total_tokens=0.0)
    with pytest.raises(ValueError, match="normalizer"):
        seq_mean_token_sum(LOSS, MASK, SEQ, SEQ_WEIGHT, normalizer=0.0, total_weight=1.0)
    with pytest.raises(ValueError, match="flat"):
        seq_mean_token_mean(LOSS, MASK[:3], SEQ, SEQ_WEIGHT, total_weight=1.0)


# ---------------------------------------------------------------- statistics


def test_loss_stats_by_hand() -> None:
    behaviour = t(-1.0, -1.0, -1.0, -1.0)
    lp = behaviour + t(0.0, math.log(2), -math.log(2), 5.0)
    mask = torch.tensor([True, True, True, False])
    clipped = torch.tensor([False, True, False, True])
    ent = t(1.0, 2.0, 3.0, 100.0)
    stats = loss_stats(lp, behaviour, mask, clipped, ent).finalize()
    # over the 3 trainable tokens: r = [1, 2, 0.5]
    assert stats["tokens"] == 3
    assert stats["clip_fraction"] == pytest.approx(1 / 3)
    assert stats["is_weight_mean"] == pytest.approx(3.5 / 3)  # (1 + 2 + 0.5) / 3
    assert stats["is_weight_min"] == pytest.approx(0.5)
    assert stats["is_weight_max"] == pytest.approx(2.0)
    # k1 = mean(behaviour - lp) = (0 - ln 2 + ln 2) / 3 = 0
    assert stats["mismatch_kl_k1"] == pytest.approx(0.0, abs=1e-12)
    # k3 = mean(r - ln r - 1) = (0 + (2 - 0.693147 - 1) + (0.5 + 0.693147 - 1)) / 3
    #    = (0.306853 + 0.193147) / 3 = 0.5 / 3
    assert stats["mismatch_kl_k3"] == pytest.approx(0.5 / 3)
    assert stats["entropy"] == pytest.approx(2.0)  # (1 + 2 + 3) / 3


def test_loss_stats_accumulate_over_micro_batches() -> None:
    g = torch.Generator().manual_seed(4)
    lp, behaviour = -torch.rand(12, generator=g, dtype=F64), -torch.rand(12, generator=g, dtype=F64)
    mask = torch.rand(12, generator=g) > 0.3
    clipped = torch.rand(12, generator=g) > 0.5
    ent = torch.rand(12, generator=g, dtype=F64)
    whole = loss_stats(lp, behaviour, mask, clipped, ent).finalize()
    parts = [loss_stats(lp[i:i + 4], behaviour[i:i + 4], mask[i:i + 4], clipped[i:i + 4], ent[i:i + 4])
             for i in range(0, 12, 4)]
    summed = sum(parts, LossStats()).finalize()
    assert summed.keys() == whole.keys()
    for key in whole:
        assert summed[key] == pytest.approx(whole[key])


def test_loss_stats_without_tokens_or_entropy() -> None:
    empty = loss_stats(t(-1.0), t(-2.0), torch.tensor([False]), torch.tensor([True]))
    assert empty.finalize() == {"tokens": 0.0}
    assert LossStats().finalize() == {"tokens": 0.0}
    assert "entropy" not in loss_stats(t(-1.0), t(-2.0), torch.tensor([True]), torch.tensor([False])).finalize()


# ---------------------------------------------------------------- dual clip


def test_ppo_dual_clip_by_hand() -> None:
    # clip band [0.8, 1.28], dual clip c = 3
    log_ratio = t(1.5, 0.5, 1.5, -0.5)
    adv = t(-1.0, -1.0, 1.0, -2.0)
    old = torch.full((4,), -2.0, dtype=F64)
    lp = (old + log_ratio).requires_grad_()

    loss, clipped = ppo_clip_loss(lp, old, adv, dual_clip=3.0)

    expected = t(
        3.0,  # r = e^1.5 = 4.481689, A<0: PPO's loss 4.481689 is bounded by -c*A = 3 (dual clip)
        1.648721,  # r = e^0.5 = 1.648721 < 3, A<0: PPO's unclipped 1.648721 stays
        -1.28,  # A>0: the dual clip never applies; the upper clip does: -1.28
        1.6,  # r = e^-0.5 = 0.606531 < 0.8, A=-2: PPO's lower clip, -0.8*-2 = 1.6 (below -c*A = 6)
    )
    assert torch.allclose(loss, expected, atol=1e-6)
    assert clipped.tolist() == [True, False, True, True]
    loss.sum().backward()
    # only the unclipped token has a gradient: -A * r = 1.648721
    assert lp.grad is not None and torch.allclose(lp.grad, t(0.0, 1.648721, 0.0, 0.0), atol=1e-6)
    # without it, token 0 is PPO's 4.481689 with gradient 4.481689
    plain, _ = ppo_clip_loss(lp, old, adv)
    assert plain[0].item() == pytest.approx(4.481689, abs=1e-6)


def dual_clip_objective_from_the_paper(lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, eps_low: float,
                                       eps_high: float, c: float) -> torch.Tensor:
    """Ye et al. 2020, eq. 5: for A < 0, max(min(r A, clip(r) A), c A); otherwise min(r A, clip(r) A)."""
    r = torch.exp(lp - old)
    ppo = torch.minimum(r * adv, torch.clamp(r, 1 - eps_low, 1 + eps_high) * adv)
    return torch.where(adv < 0, torch.maximum(ppo, c * adv), ppo)


def test_ppo_dual_clip_matches_the_paper_values_and_gradients() -> None:
    g = torch.Generator().manual_seed(5)
    old = -torch.rand(64, generator=g, dtype=F64) * 3
    lp = (old + torch.randn(64, generator=g, dtype=F64) * 0.8).requires_grad_()
    adv = torch.randn(64, generator=g, dtype=F64)
    loss, _ = ppo_clip_loss(lp, old, adv, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    ref = -dual_clip_objective_from_the_paper(lp, old, adv, 0.2, 0.28, 3.0)
    (ref_grad,) = torch.autograd.grad(ref.sum(), lp)
    assert torch.allclose(loss, ref) and torch.allclose(grad, ref_grad)
    neg = adv < 0
    assert (loss.detach()[neg] <= -3.0 * adv[neg] + 1e-12).all()  # bounded where A < 0
    assert (loss.detach()[neg] == -3.0 * adv[neg]).any()  # and the bound is reached by some token here


def test_ppo_dual_clip_validates() -> None:
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        ppo_clip_loss(torch.zeros(2), torch.zeros(2), torch.zeros(2), dual_clip=1.0)


# ---------------------------------------------------------------- k1 / k2 / k3 penalties


def test_kl_estimators_by_hand_and_gradients() -> None:
    lp = t(-1.0, -2.0, -4.0).requires_grad_()
    ref = t(-2.0, -1.0, -1.0)
    # d = ref - lp = [-1, 1, 3]
    k1, k2, k3 = kl_k1(lp, ref), kl_k2(lp, ref), kl_k3_clamped(lp, ref)
    assert torch.allclose(k1, t(1.0, -1.0, -3.0))  # -d
    assert torch.allclose(k2, t(0.5, 0.5, 4.5))  # d^2 / 2
    # e^-1 + 1 - 1 = 0.367879; e - 1 - 1 = 0.718282; e^3 - 3 - 1 = 16.085537 -> clamped to 10
    assert torch.allclose(k3, t(0.367879, 0.718282, KL_K3_MAX), atol=1e-6)
    (g1,) = torch.autograd.grad(k1.sum(), lp)
    (g2,) = torch.autograd.grad(k2.sum(), lp)
    (g3,) = torch.autograd.grad(k3.sum(), lp)
    assert torch.allclose(g1, t(1.0, 1.0, 1.0))
    assert torch.allclose(g2, t(1.0, -1.0, -3.0))  # lp - ref
    # 1 - e^d: [1 - 0.367879, 1 - 2.718282, 0 (past the clamp)]
    assert torch.allclose(g3, t(0.632121, -1.718282, 0.0), atol=1e-6)


def test_kl_estimators_match_schulman_in_expectation() -> None:
    # Schulman 2020: with r = q(x) / p(x), x ~ p: k1 = -log r, k2 = (log r)^2 / 2, k3 = (r - 1) - log r;
    # E_p[k1] = E_p[k3] = KL(p || q), exactly, here as a weighted sum over a small vocabulary
    g = torch.Generator().manual_seed(2)
    p = torch.softmax(torch.randn(7, generator=g, dtype=F64), 0)
    q = torch.softmax(torch.randn(7, generator=g, dtype=F64), 0)
    kl = (p * (p / q).log()).sum()
    r = q / p
    lp, ref = p.log(), q.log()
    assert torch.allclose(kl_k1(lp, ref), -r.log()) and torch.allclose(kl_k2(lp, ref), r.log() ** 2 / 2)
    assert torch.allclose(kl_k3_clamped(lp, ref), (r - 1) - r.log())
    assert (p * kl_k1(lp, ref)).sum().item() == pytest.approx(kl.item(), rel=1e-9)
    assert (p * kl_k3_clamped(lp, ref)).sum().item() == pytest.approx(kl.item(), rel=1e-9)


def test_kl_k2_gradient_is_the_reverse_kl_gradient_on_own_samples() -> None:
    # sum_y pi(y) * grad k2(y) = grad KL(pi || ref) with respect to pi's logits, exactly
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(1, 6, generator=g, dtype=F64).requires_grad_()
    ref = torch.log_softmax(torch.randn(6, generator=g, dtype=F64), 0)
    pi = torch.softmax(logits[0], 0).detach()
    expected = torch.zeros_like(logits)
    for y in range(6):
        lp = token_logprobs(logits, torch.tensor([y]))
        (grad,) = torch.autograd.grad(kl_k2(lp, ref[y:y + 1]).sum(), logits)
        expected += pi[y] * grad
    logp = torch.log_softmax(logits[0], 0)
    (exact,) = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), logits)
    assert torch.allclose(expected, exact, atol=1e-12)
