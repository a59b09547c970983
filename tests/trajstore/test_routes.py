"""Routed experts in the store: the per-turn layout (`trajstore.routes`), its checks, and stores written before it."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

import trajstore
from trajstore import InvalidEventError, Reward, Status, Turn, routes
from trajstore.shard import make_shard

OLD_STORE = Path(__file__).parent / "data" / "store_v1_before_teacher"  # written before the routes columns too


def fed(n: int, layers: int = 2, top_k: int = 2) -> np.ndarray:
    """Routes of n fed tokens whose values name the token: row i is all i (i < 100)."""
    return np.repeat(np.arange(n, dtype=np.int16), layers * top_k).reshape(n, layers, top_k)


def test_each_row_holds_the_routes_of_the_position_that_predicted_its_token() -> None:
    # prompt of 5 (the turn stores its last 2: a delta), 3 sampled; the server fed 5 + 3 - 1 tokens
    rows = routes.turn_rows(fed(7), prompt_len=5, output_len=3, delta_len=2)
    assert rows.shape == (5, 2, 2) and rows.dtype == np.int16
    assert rows[:, 0, 0].tolist() == [2, 3, 4, 5, 6]  # token 3 was predicted at position 2, ..., the last at 6
    whole = routes.turn_rows(fed(7), prompt_len=5, output_len=3, delta_len=5)  # a segment's first turn
    assert whole[:, 0, 0].tolist() == [routes.ABSENT, 0, 1, 2, 3, 4, 5, 6]
    short = routes.turn_rows(fed(4), prompt_len=5, output_len=3, delta_len=2)  # a server that sent fewer rows
    assert short[:, 0, 0].tolist() == [2, 3, routes.ABSENT, routes.ABSENT, routes.ABSENT]
    with pytest.raises(ValueError, match="9 rows of routes for 8 tokens"):
        routes.turn_rows(fed(9), prompt_len=5, output_len=3, delta_len=2)


def turn(**over: object) -> Turn:
    base = dict(group_id="g", rollout_id="r", segment_id="s", turn_index=0, policy_version=0, prompt_ids=[1, 2, 3],
                output_ids=[4, 5], output_logprobs=[-0.5, -0.25])
    base.update(over)
    return Turn(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(("routed", "shape", "problem"), [
    (list(range(10)), [5, 2, 1], None),
    (list(range(10)), None, "go together"),
    (list(range(9)), [5, 2, 1], "holds 9 values but its shape"),
    (list(range(8)), [4, 2, 1], "4 rows but the turn has 5 tokens"),
    ([-2] + list(range(9)), [5, 2, 1], "expert indices 0..32767 or -1"),
    ([40000] + list(range(9)), [5, 2, 1], "expert indices 0..32767 or -1"),
    ([0.5] * 10, [5, 2, 1], "expert indices"),
    (list(range(10)), [5, 2], "must be \\[tokens, layers, top_k\\]"),
])
def test_routes_are_checked_at_the_edge(tmp_path: Path, routed: list, shape: list | None, problem: str | None) -> None:
    store = trajstore.open_store(tmp_path / "s", create=True)
    with store.writer("w") as w:
        event = turn(routed_experts=routed, routed_experts_shape=shape)
        if problem is None:
            w.append([event])
            row = store.query("SELECT routed_experts, routed_experts_shape FROM turns").to_pylist()[0]
            assert row == {"routed_experts": routed, "routed_experts_shape": shape}
        else:
            with pytest.raises(InvalidEventError, match=problem):
                w.append([event])


def test_a_store_written_before_routes_reads_shards_and_takes_routed_turns(tmp_path: Path) -> None:
    shutil.copytree(OLD_STORE, tmp_path / "store")
    store = trajstore.open_store(tmp_path / "store")
    old = store.query("SELECT rollout_id, routed_experts, routed_experts_shape FROM samples ORDER BY rollout_id")
    assert old.to_pylist() == [{"rollout_id": "r1", "routed_experts": None, "routed_experts_shape": None},
                               {"rollout_id": "r2", "routed_experts": None, "routed_experts_shape": None}]
    rows = routes.turn_rows(fed(4, 1, 1), prompt_len=3, output_len=2, delta_len=3)
    with store.writer("new-w") as w:
        w.append([turn(run="new", group_id="g9", rollout_id="r9", segment_id="r9-s0", **routes.turn_columns(rows)),
                  Reward(run="new", group_id="g9", rollout_id="r9", reward=1.0),
                  Status(run="new", group_id="g9", rollout_id="r9", status="completed")])
    store.compact()  # rewrites the old files under the schema with the routes columns
    assert store.verify().problems == []
    shard = make_shard(store.reader, policy_version=0, max_staleness=0)
    got = {r["rollout_id"]: (r["routed_experts"], r["routed_experts_shape"]) for r in shard.samples.to_pylist()}
    assert got["r9"] == ([routes.ABSENT, 0, 1, 2, 3], [5, 1, 1])
    assert all(v == (None, None) for k, v in got.items() if k != "r9")
