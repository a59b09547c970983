"""Packing and padding of samples into micro-batches: exact alignment, budgets, and packed logprobs.

The alignment and budget tests are pure (no model). The logprob tests run transformers' Qwen2
(sdpa attention) on a tiny random model: a packed row with position ids restarting per sample
must give every sample exactly the logprobs it gets alone.
"""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoModelForCausalLM  # noqa: E402

from learner.batching import MicroBatch, pack, pad_batches, step_totals  # noqa: E402
from learner.losses import token_logprobs  # noqa: E402
from learner.train import forward_logits  # noqa: E402
from tests.learner.synth import make_model  # noqa: E402


def make_samples(lengths: list[int], *, seed: int = 0, vocab: int = 2048, segments: list[int] | None = None,
                 untrained: set[int] = frozenset()) -> pa.Table:
    """A samples table shaped like `Shard.samples`: a prompt of ~1/3 of each sample, then
    sampled tokens (trainable, with behaviour logprobs) and an untrainable tool response."""
    rng = np.random.default_rng(seed)
    tokens, masks, logprobs = [], [], []
    for i, n in enumerate(lengths):
        mask = np.zeros(n, dtype=bool)
        mask[max(1, n // 3):] = True
        mask[(2 * n) // 3:(2 * n) // 3 + 2] = False  # a tool response in the middle of the outputs
        if i in untrained:
            mask[:] = False
        tokens.append(rng.integers(0, vocab, n).tolist())
        masks.append(mask.tolist())
        logprobs.append(np.where(mask, -rng.uniform(0.1, 8.0, n), 0.0).astype(np.float32).tolist())
    segs = segments or [1] * len(lengths)
    return pa.table({
        "rollout_id": pa.array([f"r{i}" for i in range(len(lengths))]),
        "tokens": pa.array(tokens, pa.list_(pa.int32())),
        "loss_mask": pa.array(masks, pa.list_(pa.bool_())),
        "logprobs": pa.array(logprobs, pa.list_(pa.float32())),
        "advantage": pa.array(rng.normal(size=len(lengths)), pa.float64()),
        "rollout_segments": pa.array(segs, pa.int64()),
        "num_tokens": pa.array(lengths, pa.int64()),
    })


def check_alignment(samples: pa.Table, batches: list[MicroBatch]) -> None:
    """Each sample appears once, whole, shifted by one: inputs tokens[:-1], targets tokens[1:]."""
    rows = samples.to_pylist()
    seen: list[int] = []
    for mb in batches:
        seen += mb.rows
        for i, r in enumerate(mb.rows):
            at = mb.seq == i
            tokens, mask, lp = rows[r]["tokens"], rows[r]["loss_mask"], rows[r]["logprobs"]
            n = len(tokens) - 1
            real = at if mb.attention_mask is None else at & mb.attention_mask.flatten().bool()
            assert mb.input_ids.flatten()[real].tolist() == tokens[:-1]
            assert mb.position_ids.flatten()[real].tolist() == list(range(n))
            assert mb.targets[real].tolist() == tokens[1:]
            assert mb.mask[real].tolist() == mask[1:]
            assert mb.mask[at & ~real].sum() == 0  # padding is never trained
            assert torch.allclose(mb.behaviour_logprobs[real], torch.tensor(lp[1:]))
            assert torch.all(mb.advantages[real] == torch.tensor(rows[r]["advantage"], dtype=torch.float32))
            assert mb.seq_weight[i] == pytest.approx(1.0 / rows[r]["rollout_segments"])
    trainable = [r for r, row in enumerate(rows) if any(row["loss_mask"][1:])]
    assert sorted(seen) == trainable, "every sample with a trainable token exactly once, the others left out"


def test_pack_first_fit_decreasing_respects_the_budget_and_keeps_every_token_once() -> None:
    lengths = [5, 17, 33, 9, 12, 40, 3, 26, 8, 21, 2, 14]
    samples = make_samples(lengths, untrained={3})
    budget = 48
    batches = pack(samples, budget)
    check_alignment(samples, batches)
    for mb in batches:
        assert mb.input_ids.shape[0] == 1 and mb.attention_mask is None
        assert mb.num_positions <= budget
    # first-fit-decreasing: the packed rows leave less unused than one sample per row would
    positions = sum(n - 1 for i, n in enumerate(lengths) if i != 3)
    assert len(batches) == -(-positions // budget)  # these lengths happen to pack perfectly tight
    # a trainable token is a sampled one whose previous token exists: the first never counts
    totals = step_totals(samples)
    assert totals.trainable_tokens == sum(mb.num_trainable for mb in batches)
    assert totals.samples == len(lengths) and totals.rollouts == len(lengths)


def test_a_sample_longer_than_the_budget_gets_a_micro_batch_of_its_own() -> None:
    samples = make_samples([10, 70, 12, 9])
    batches = pack(samples, 32)
    check_alignment(samples, batches)
    (alone,) = [mb for mb in batches if mb.num_positions > 32]
    assert alone.rows == (1,) and alone.num_positions == 69


def test_fan_out_weights_count_each_rollout_once() -> None:
    samples = make_samples([8, 8, 8, 8], segments=[2, 2, 1, 1])
    totals = step_totals(samples)
    assert totals.rollouts == pytest.approx(3.0)  # two segments of one rollout weigh 1/2 each
    check_alignment(samples, pack(samples, 100))


def test_pad_batches_stay_in_order_within_the_budget() -> None:
    lengths = [5, 17, 33, 9, 12, 40, 3, 26]
    samples = make_samples(lengths)
    batches = pad_batches(samples, 64)
    check_alignment(samples, batches)
    for mb in batches:
        b, width = mb.input_ids.shape
        assert b * width <= 64 or b == 1
        assert width == max(lengths[r] - 1 for r in mb.rows)
    assert [r for mb in batches for r in mb.rows] == list(range(len(lengths)))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    torch.set_num_threads(1)
    path = make_model(tmp_path_factory.mktemp("models") / "tiny")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def alone_logprobs(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """(n-1,) logprob of tokens[1:], the sample run on its own."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0, :-1]
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(tokens[1:])[:, None]).squeeze(1)


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_packed_and_padded_logprobs_equal_each_sample_alone(model: torch.nn.Module, layout: str) -> None:
    lengths = [7, 30, 12, 5, 19, 24]
    samples = make_samples(lengths, seed=1)
    batches = pack(samples, 64) if layout == "packed" else pad_batches(samples, 64)
    assert len(batches) < len(lengths)  # several samples share a forward pass
    rows = samples.to_pylist()
    checked = 0
    for mb in batches:
        keep = mb.mask.nonzero().squeeze(1)
        with torch.no_grad():
            got = token_logprobs(forward_logits(model, mb, 1.0), mb.targets[keep])
        for i, r in enumerate(mb.rows):
            want = alone_logprobs(model, rows[r]["tokens"])[torch.tensor(rows[r]["loss_mask"][1:])]
            mine = got[mb.seq[keep] == i]
            assert mine.shape == want.shape
            assert torch.allclose(mine, want, atol=1e-5), (layout, r, (mine - want).abs().max())
            checked += 1
    assert checked == len(lengths)


def test_packing_without_restarted_positions_would_be_wrong(model: torch.nn.Module) -> None:
    """The check above can fail: the same packed row with running positions leaks across samples."""
    samples = make_samples([12, 12], seed=2)
    (mb,) = pack(samples, 64)
    running = MicroBatch(**{**mb.__dict__, "position_ids": torch.arange(mb.num_positions)[None]})
    keep = mb.mask.nonzero().squeeze(1)
    with torch.no_grad():
        good = token_logprobs(forward_logits(model, mb, 1.0), mb.targets[keep])
        bad = token_logprobs(forward_logits(model, running, 1.0), mb.targets[keep])
    second = mb.seq[keep] == 1
    assert not torch.allclose(good[second], bad[second], atol=1e-3)


def test_empty_and_invalid_inputs() -> None:
    empty = make_samples([4]).slice(0, 0)
    assert pack(empty, 10) == [] and pad_batches(empty, 10) == []
    assert step_totals(empty).trainable_tokens == 0
    with pytest.raises(ValueError, match="budget"):
        pack(make_samples([4]), 0)
    broken = make_samples([6]).set_column(3, "logprobs", pa.array([[0.0] * 5], pa.list_(pa.float32())))
    with pytest.raises(ValueError, match="equal length"):
        pack(broken, 10)

