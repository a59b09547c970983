"""The sampler's pure functions: processed distributions, seeded draws, stop strings."""

from __future__ import annotations

import math

import torch

from collectors.embedded.sampling import find_stop, make_generator, processed_logprobs, sample


def run(logits: list[list[float]], temperature: list[float], top_k: list[int], top_p: list[float]) -> torch.Tensor:
    return processed_logprobs(torch.tensor(logits), torch.tensor(temperature), torch.tensor(top_k),
                              torch.tensor(top_p))


def test_temperature_scales_and_zero_means_temperature_one() -> None:
    logits = [[1.0, 2.0, 3.0, 0.5]]
    out = run(logits * 3, [0.5, 0.0, 1.0], [0, 0, 0], [1.0, 1.0, 1.0])
    assert torch.allclose(out[0], torch.log_softmax(torch.tensor(logits[0]) / 0.5, -1))
    assert torch.allclose(out[1], out[2])  # greedy rows report the temperature-1 distribution


def test_top_k_and_top_p_keep_the_documented_sets() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).tolist()
    k2 = run(logits, [1.0], [2], [1.0])[0]
    assert torch.isinf(k2[2:]).all() and torch.allclose(k2[:2].exp().sum(), torch.tensor(1.0))
    assert math.isclose(k2[0].item(), math.log(0.5 / 0.8), rel_tol=1e-5)
    p = run(logits, [1.0], [0], [0.75])[0]  # 0.5 < 0.75 <= 0.5 + 0.3: the top two
    assert torch.isfinite(p[:2]).all() and torch.isinf(p[2:]).all()
    tiny = run(logits, [1.0], [0], [0.01])[0]  # at least one token always stays
    assert torch.isfinite(tiny[0]) and torch.isinf(tiny[1:]).all()
    mixed = run(logits * 2, [1.0, 1.0], [0, 1], [1.0, 1.0])
    assert torch.isfinite(mixed[0]).all() and torch.isfinite(mixed[1]).sum() == 1  # per-row settings


def test_seeded_draws_repeat_and_follow_the_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    logprobs = torch.log(probs).expand(4000, 3).contiguous()
    gen = make_generator(5, torch.device("cpu"), fallback=0)
    draws = sample(logprobs, [False] * 4000, [gen] * 4000)
    again = sample(logprobs, [False] * 4000, [make_generator(5, torch.device("cpu"), fallback=0)] * 4000)
    assert torch.equal(draws, again)
    freq = torch.bincount(draws, minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def test_each_row_draws_from_its_own_generator() -> None:
    logprobs = torch.log_softmax(torch.randn(3, 50), -1)
    alone = sample(logprobs[1:2], [False], [make_generator(9, torch.device("cpu"), 0)])
    batched = sample(logprobs, [False, False, True],
                     [make_generator(1, torch.device("cpu"), 0), make_generator(9, torch.device("cpu"), 0), None])
    assert batched[1] == alone[0]
    assert batched[2] == logprobs[2].argmax()


def test_excluded_tokens_are_never_drawn() -> None:
    logprobs = run([[0.0, 0.1, 5.0, 0.2]] * 500, [2.0] * 500, [2] * 500, [1.0] * 500)
    draws = sample(logprobs, [False] * 500, [make_generator(i, torch.device("cpu"), 0) for i in range(500)])
    assert set(draws.tolist()) <= {2, 3}


def test_find_stop_takes_the_earliest() -> None:
    assert find_stop("abc\n\nUser: x", ("User:", "\n\n")) == (3, "\n\n")
    assert find_stop("hello", ("x",)) is None
