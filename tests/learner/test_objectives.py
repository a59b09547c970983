"""learner.objectives: `--loss`, `--mask-ratio` and `--reject` wired to the pure functions, and the
step's counts (clip sides, masked tokens, rejected samples, sequence ratios) they report."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from learner.losses import LossStats, token_mean
from learner.objectives import LOSSES, LossInputs, kept_tokens, objective_stats
from learner.settings import LearnSettings

F64 = torch.float64
BASE = LearnSettings(store="s", run="r", model="m", checkpoints="c", steps=1)


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def inputs(log_ratio: torch.Tensor, adv: torch.Tensor, seq: torch.Tensor, samples: int) -> LossInputs:
    behaviour = torch.full_like(log_ratio, -1.0)
    return LossInputs((behaviour + log_ratio).requires_grad_(), behaviour, adv, seq, samples)


def test_every_loss_name_has_a_function() -> None:
    from typing import get_args

    from learner.settings import LossName

    assert set(LOSSES) == set(get_args(LossName))


def test_icepop_masked_tokens_leave_the_loss_and_are_counted() -> None:
    # token 1's ratio e^-1 = 0.37 and token 3's e^2 = 7.4 leave [0.5, 5]
    x = inputs(t(0.1, -1.0, 0.0, 2.0), t(1.0, 1.0, -1.0, -1.0), torch.tensor([0, 0, 1, 1]), 2)
    s = replace(BASE, mask_ratio=(0.5, 5.0))
    out = LOSSES["ppo"](x, s)
    keep, masked, rejected = kept_tokens(x, s)
    assert masked.tolist() == [False, True, False, True] and not rejected.any()
    loss = token_mean(torch.where(keep, out.loss, torch.zeros_like(out.loss)), torch.ones(4), total_tokens=4.0)
    loss.backward()
    # the kept tokens keep their gradient over the unchanged normalizer 4: -A*r/4
    assert x.logprobs.grad is not None
    assert torch.allclose(x.logprobs.grad, t(-1.105171 / 4, 0.0, 0.25, 0.0), atol=1e-6)
    stats = (LossStats(tokens=4.0) + objective_stats(x, out, masked, rejected)).finalize()
    assert stats["masked_tokens"] == 2.0 and stats["rejected_samples"] == 0.0


def test_rejected_samples_leave_the_loss_and_are_counted() -> None:
    # a rollout fanned out into samples 0 and 1, another rollout is sample 2;
    # geometric-mean ratios: e^0 = 1, e^1 = 2.72 (rejected), e^0.05 = 1.05
    x = inputs(t(0.1, -0.1, 1.0, 1.0, 1.0, 0.05), t(1.0, 1.0, 1.0, 1.0, 1.0, -1.0),
               torch.tensor([0, 0, 1, 1, 1, 2]), 3)
    s = replace(BASE, reject="geo", reject_low=0.5, reject_high=2.0)
    out = LOSSES["cispo"](x, s)
    keep, masked, rejected = kept_tokens(x, s)
    assert rejected.tolist() == [False, True, False]
    assert keep.tolist() == [True, True, False, False, False, True]
    per_token = torch.where(keep, out.loss, torch.zeros_like(out.loss))
    per_token.sum().backward()
    assert x.logprobs.grad is not None and (x.logprobs.grad[2:5] == 0).all() and (x.logprobs.grad[keep] != 0).all()
    stats = (LossStats(tokens=6.0) + objective_stats(x, out, masked, rejected)).finalize()
    assert stats["rejected_samples"] == 1.0 and stats["rejected_tokens"] == 3.0
    assert stats["seq_ratio_max"] == pytest.approx(2.718282, abs=1e-6)
    assert stats["seq_ratio_min"] == pytest.approx(1.0)
    assert stats["seq_ratio_mean"] == pytest.approx((1.0 + 2.718282 + 1.051271) / 3, abs=1e-6)


def test_k3_rejection_uses_the_bound() -> None:
    x = inputs(t(0.0, 1.0), t(1.0, 1.0), torch.tensor([0, 1]), 2)
    _, _, rejected = kept_tokens(x, replace(BASE, reject="k3", reject_high=0.5))
    assert rejected.tolist() == [False, True]  # k3 of log r = 1 is e - 2 = 0.718 > 0.5


def test_clip_sides_add_up_over_micro_batches() -> None:
    s = replace(BASE, clip_low=0.2, clip_high=0.28)
    # ppo: e^0.5 with A>0 clips above, e^-0.5 with A<0 clips below, e^0.1 does not clip
    a = inputs(t(0.5, -0.5, 0.1), t(1.0, -1.0, 1.0), torch.tensor([0, 0, 1]), 2)
    b = inputs(t(0.5,), t(2.0,), torch.tensor([0]), 1)
    total = LossStats()
    for x in (a, b):
        out = LOSSES["ppo"](x, s)
        _, masked, rejected = kept_tokens(x, s)
        total = total + LossStats(tokens=float(len(x.seq))) + objective_stats(x, out, masked, rejected)
    stats = total.finalize()
    assert stats["clip_fraction_high"] == pytest.approx(2 / 4) and stats["clip_fraction_low"] == pytest.approx(1 / 4)


def test_distill_without_teacher_logprobs_says_how_to_get_them() -> None:
    x = inputs(t(0.0), t(0.0), torch.tensor([0]), 1)
    with pytest.raises(Exception, match="trajstore annotate"):
        LOSSES["distill"](x, replace(BASE, loss="distill", teacher="big"))


@pytest.mark.parametrize("over, fragment", [
    ({"dual_clip": 1.0}, "dual_clip must be > 1"),
    ({"mask_ratio": (2.0, 5.0)}, "mask_ratio must be LOW,HIGH"),
    ({"reject": "geo", "reject_low": 0.5, "reject_high": 0.9}, "reject geo needs"),
    ({"reject": "k3", "reject_high": 0.0}, "reject k3 needs a bound"),
    ({"loss": "distill"}, "loss distill needs teacher"),
    ({"teacher": "big"}, "only read by loss distill"),
    ({"seq_clip_low": 1.5}, "seq_clip_low"),
    ({"kl_estimator": "k4"}, "kl_estimator"),
])
def test_settings_report_bad_loss_knobs(over: dict[str, object], fragment: str) -> None:
    assert any(fragment in p for p in replace(BASE, **over).problems())  # type: ignore[arg-type]
