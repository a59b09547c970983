"""learner.correction: IcePop's token mask and sequence rejection, by hand and against the formulas.

e^x to 6 decimals: e^0.8 = 2.225541, e^-0.8 = 0.449329.
"""

from __future__ import annotations

import math

import pytest
import torch

from learner.correction import icepop_keep, reject_geometric, reject_k3, sequence_log_ratio, sequence_mean

F64 = torch.float64


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def test_sequence_mean_by_hand() -> None:
    # sample 1 has no tokens here: 0, not NaN
    assert torch.equal(sequence_mean(t(1, 3, 10), torch.tensor([0, 0, 2]), 3), t(2, 0, 10))


def test_icepop_keeps_the_band_on_both_sides() -> None:
    behaviour = torch.full((6,), -2.0, dtype=F64)
    ratio = t(0.4, 0.49, 0.51, 1.0, 4.9, 5.1)
    keep = icepop_keep(behaviour + ratio.log(), behaviour, low=0.5, high=5.0)
    assert keep.tolist() == [False, False, True, True, True, False]


def test_icepop_validates_the_band() -> None:
    with pytest.raises(ValueError, match="0 < low < 1 < high"):
        icepop_keep(torch.zeros(1), torch.zeros(1), low=1.2, high=5.0)


def test_geometric_rejection_by_hand() -> None:
    seq = torch.tensor([0, 0, 1, 1, 2])
    behaviour = torch.full((5,), -1.0, dtype=F64)
    # seq 0: mean(0.1, -0.1) = 0 -> rho 1, kept; seq 1: mean(1.0, 0.6) = 0.8 -> 2.225541 > 2, rejected;
    # seq 2: -0.8 -> 0.449329 < 0.5, rejected
    lp = behaviour + t(0.1, -0.1, 1.0, 0.6, -0.8)
    assert reject_geometric(lp, behaviour, seq, 3, low=0.5, high=2.0).tolist() == [False, True, True]
    assert torch.allclose(sequence_log_ratio(lp, behaviour, seq, 3).exp(), t(1.0, 2.225541, 0.449329), atol=1e-6)


def test_geometric_rejection_matches_the_product_of_ratios() -> None:
    # rho_i = (prod_t pi/mu)^(1/|y_i|), computed as a product rather than a mean of logs
    g = torch.Generator().manual_seed(11)
    lengths = [3, 7, 1, 4, 5]
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    behaviour = -torch.rand(len(seq), generator=g, dtype=F64) * 3
    lp = behaviour + torch.randn(len(seq), generator=g, dtype=F64) * 0.4
    rho = torch.stack([torch.prod(torch.exp(lp - behaviour)[seq == i]) ** (1 / n) for i, n in enumerate(lengths)])
    assert torch.allclose(sequence_log_ratio(lp, behaviour, seq, 5).exp(), rho)
    assert reject_geometric(lp, behaviour, seq, 5, low=0.8, high=1.25).tolist() == ((rho < 0.8) | (rho > 1.25)).tolist()


def test_k3_rejection_by_hand() -> None:
    seq = torch.tensor([0, 0, 1])
    behaviour = torch.full((3,), -1.0, dtype=F64)
    # r = pi/mu; k3 = r - 1 - log r. seq 0: r = 1, 1 -> 0; seq 1: log r = 1 -> e - 2 = 0.718282
    lp = behaviour + t(0.0, 0.0, 1.0)
    assert reject_k3(lp, behaviour, seq, 2, bound=0.5).tolist() == [False, True]
    assert reject_k3(lp, behaviour, seq, 2, bound=0.72).tolist() == [False, False]
    # both directions count: log r = -1 -> e^-1 + 1 - 1 = 0.367879
    lp = behaviour + t(0.0, 0.0, -1.0)
    assert reject_k3(lp, behaviour, seq, 2, bound=0.36).tolist() == [False, True]
    assert math.exp(-1) == pytest.approx(0.367879, abs=1e-6)


def test_rejections_validate_their_bounds() -> None:
    z, s = torch.zeros(2), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="0 < low < 1 < high"):
        reject_geometric(z, z, s, 1, low=0.5, high=0.9)
    with pytest.raises(ValueError, match="bound must be > 0"):
        reject_k3(z, z, s, 1, bound=0.0)
