"""Sampling-support replay in the learner (`learner.support`) and the sampling columns of a shard.

The sparse renormalization is checked against the dense definition (log-softmax of the logits
with every token outside the kept set at -inf), values and gradients, for both ways a set is
stored: id by id, and by its size alone ("the m most likely tokens", above SUPPORT_IDS_CAP).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pytest
import torch

import trajstore
from learner.batching import pack
from learner.errors import LearnerError
from learner.losses import token_logprobs
from learner.support import Support, kept_positions, replay_entropy, replay_logprobs
from learner.train import check_sampling
from trajstore.events import SUPPORT_IDS_CAP

OLD_STORE = Path(__file__).parents[1] / "trajstore" / "data" / "store_v1_before_teacher"


def _case(vocab: int = 700) -> tuple[torch.Tensor, torch.Tensor, Support, torch.Tensor]:
    """Four positions: ids stored {3, 5, 9}; none; the top 600 (above the cap); ids stored {0..511}."""
    torch.manual_seed(0)
    logits = torch.randn(4, vocab, dtype=torch.float64, requires_grad=True)
    order = logits.detach()[2].argsort(descending=True)
    targets = torch.tensor([5, 11, int(order[17]), 100])
    sets = {0: [3, 5, 9], 3: list(range(SUPPORT_IDS_CAP))}
    dense = torch.ones(4, vocab, dtype=torch.bool)
    for row, ids in sets.items():
        dense[row] = False
        dense[row, ids] = True
    dense[2] = False
    dense[2, order[:600]] = True
    rows = torch.tensor([r for r, ids in sets.items() for _ in ids])
    ids = torch.tensor([i for ids in sets.values() for i in ids])
    return logits, targets, Support(rows, ids, torch.tensor([2]), torch.tensor([600])), dense


def test_replayed_logprobs_and_gradients_equal_the_dense_renormalization() -> None:
    logits, targets, support, dense = _case()
    sparse = replay_logprobs(logits, targets, token_logprobs(logits, targets), support)
    (grad_sparse,) = torch.autograd.grad(sparse.sum(), logits)
    expected = torch.log_softmax(logits.masked_fill(~dense, float("-inf")), -1).gather(1, targets[:, None]).squeeze(1)
    (grad_dense,) = torch.autograd.grad(expected.sum(), logits)
    torch.testing.assert_close(sparse, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad_sparse, grad_dense, rtol=0, atol=1e-12)
    assert sparse[1] == token_logprobs(logits, targets)[1]  # no recorded support: the whole vocabulary


def test_replayed_entropy_is_the_entropy_of_the_renormalized_distribution() -> None:
    logits, _, support, dense = _case()
    logp = torch.log_softmax(logits.detach().masked_fill(~dense, float("-inf")), -1)
    expected = -torch.where(dense, logp.exp() * logp, torch.zeros_like(logp)).sum(-1)
    torch.testing.assert_close(replay_entropy(logits.detach(), support), expected, rtol=0, atol=1e-12)


def test_kept_positions_takes_the_trainable_positions_sets_only() -> None:
    # positions 0..4: sizes 2 (ids 7, 8), 0, 3 (not trainable: ids 1, 2, 3), 1 (id 4), 900 (no ids: the top 900)
    sizes = torch.tensor([2, 0, 3, 1, 900])
    support = kept_positions(sizes, torch.tensor([7, 8, 1, 2, 3, 4]), keep=torch.tensor([0, 1, 3, 4]))
    assert support.rows.tolist() == [0, 0, 2] and support.ids.tolist() == [7, 8, 4]
    assert support.top_rows.tolist() == [3] and support.top_sizes.tolist() == [900]
    assert support.positions() == 3


def test_a_store_from_before_the_sampling_columns_trains_at_the_guard_or_1(tmp_path: Path) -> None:
    shutil.copytree(OLD_STORE, tmp_path / "store")
    shard = trajstore.open_store(tmp_path / "store").shard(policy_version=0, max_staleness=5, run="old")
    assert len(shard) == 2 and shard.samples.column("temperature").null_count == 2
    for guard, expected in ((None, 1.0), (0.8, 0.8)):
        samples = check_sampling(shard.samples, guard)
        assert samples.column("temperature").to_pylist() == [expected, expected]
        for mb in pack(samples, 64):
            assert mb.temperature is not None and torch.allclose(mb.temperature, torch.tensor(expected))
            assert mb.support_sizes is not None and not mb.support_sizes.any() and mb.support_ids.numel() == 0


def test_a_sample_whose_turns_sampled_differently_is_refused() -> None:
    samples = pa.table({"run": ["r"], "rollout_id": ["a"], "segment_id": ["a-s0"], "temperature": [1.0],
                        "sampling_varies": [True]})
    with pytest.raises(LearnerError, match="mix sampling parameters across their turns .* rollout a, segment a-s0"):
        check_sampling(samples, None)
