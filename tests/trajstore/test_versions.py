"""Per-token policy versions: spans stored run-length, expanded by the views, oldest version for staleness."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest

import trajstore
from trajstore import InvalidEventError
from trajstore.events import to_columns
from trajstore.versions import compact, expand, span_problems

OLD_STORE = Path(__file__).parent / "data" / "store_v1_before_teacher"  # sealed before the version columns too


def turn(rollout: str, version: int, n_out: int, *, starts: list[int] | None = None,
         values: list[int] | None = None, turn_index: int = 0, group: str = "g1") -> trajstore.Turn:
    return trajstore.Turn(run="v", group_id=group, rollout_id=rollout, segment_id=f"{rollout}-s0",
                          turn_index=turn_index, policy_version=version, prompt_ids=[1, 2],
                          output_ids=list(range(10, 10 + n_out)), output_logprobs=[-0.5] * n_out,
                          output_version_starts=starts, output_version_values=values)


def rollout_done(rollout: str, group: str = "g1") -> list[object]:
    return [trajstore.Reward(run="v", group_id=group, rollout_id=rollout, reward=1.0),
            trajstore.Status(run="v", group_id=group, rollout_id=rollout, status="completed", group_size=2)]


def test_spans_expand_and_compact_both_ways() -> None:
    assert compact([4, 4, 4, 5, 5, 7]) == ([0, 3, 5], [4, 5, 7])
    assert expand([0, 3, 5], [4, 5, 7], 6, 4) == [4, 4, 4, 5, 5, 7]
    assert expand(None, None, 3, 2) == [2, 2, 2]


@pytest.mark.parametrize(("starts", "values", "message"), [
    ([0, 2], None, "go together"),
    ([0, 2], [3], "one item per version span"),
    ([1, 2], [3, 4], "must start at 0"),
    ([0, 5], [3, 4], "each below the output length"),
    ([0, 2, 2], [3, 4, 5], "must start at 0 and increase"),
    ([0, 2], [4, 3], "versions only go up"),
    ([0, 2], [2, 4], "policy_version is 3"),
    ([0, 1.5], [3, 4], "lists of integers"),
])
def test_bad_spans_are_refused_with_what_is_wrong(starts: list, values: list | None, message: str) -> None:
    record = {"kind": "turn", "policy_version": 3, "output_ids": [1, 2, 3, 4]}
    assert any(message in p for p in span_problems({**record, "output_version_starts": starts,
                                                     "output_version_values": values}))
    with pytest.raises(InvalidEventError, match=message):
        to_columns([turn("r", 3, 4, starts=starts, values=values)])


def test_turns_show_one_version_per_token_and_samples_span_oldest_to_newest(store: trajstore.Store) -> None:
    with store.writer("w") as writer:
        writer.append([replace(turn("r1", 3, 5, starts=[0, 2, 4], values=[3, 4, 6]),
                               output_mask=[True, True, False, True, False]),
                       turn("r1", 6, 2, turn_index=1),
                       turn("r2", 5, 3), *rollout_done("r1"), *rollout_done("r2")])
        for sealed in (False, True):
            rows = store.query("SELECT rollout_id, turn_index, output_versions FROM turns "
                               "ORDER BY rollout_id, turn_index").to_pylist()
            assert [r["output_versions"] for r in rows] == [[3, 3, 4, 4, 6], [6, 6], [5, 5, 5]]
            samples = store.query("SELECT rollout_id, min_version, max_version FROM samples "
                                  "ORDER BY rollout_id").to_pylist()
            assert samples == [{"rollout_id": "r1", "min_version": 3, "max_version": 6},
                               {"rollout_id": "r2", "min_version": 5, "max_version": 5}]
            ledger = store.query("SELECT version, generated, waiting FROM token_ledger ORDER BY version").to_pylist()
            assert ledger == [{"version": 3, "generated": 2, "waiting": 2}, {"version": 4, "generated": 2, "waiting": 1},
                              {"version": 5, "generated": 3, "waiting": 3}, {"version": 6, "generated": 3, "waiting": 2}]
            stats = store.stats().runs
            assert stats[0]["multi_version_samples"] == pytest.approx(0.5)
            # staleness takes the oldest version: at version 7 with staleness 3, r1 (oldest 3) is too old
            shard = store.shard(policy_version=7, max_staleness=3, run="v")
            assert shard.group_ids == ()
            shard = store.shard(policy_version=7, max_staleness=4, run="v")
            assert sorted(shard.samples.column("max_version").to_pylist()) == [5, 6]
            if not sealed:
                writer.seal()


def test_a_store_sealed_before_the_version_columns_reads_one_version_per_turn(tmp_path: Path) -> None:
    shutil.copytree(OLD_STORE, tmp_path / "store")
    store = trajstore.open_store(tmp_path / "store")
    rows = store.query("SELECT policy_version, output_ids, output_versions, output_version_starts FROM turns").to_pylist()
    assert rows and all(r["output_versions"] == [r["policy_version"]] * len(r["output_ids"])
                        and r["output_version_starts"] is None for r in rows)
    samples = store.query("SELECT min_version, max_version FROM samples").to_pylist()
    assert all(s["min_version"] == s["max_version"] for s in samples)
    assert store.stats().runs[0]["multi_version_samples"] == 0.0
    shard = store.shard(policy_version=0, max_staleness=5, run="old")  # what the learner trains on
    assert shard.group_ids == ("g1",) and shard.samples.column("max_version").to_pylist() == [0, 0]
    with store.writer("new-w") as writer:  # the old store takes turns with spans beside its old ones
        writer.append([turn("r9", 0, 3, starts=[0, 1], values=[0, 1])])
    store.compact()
    assert store.verify().problems == []
    assert store.query("SELECT output_versions FROM turns WHERE rollout_id = 'r9'").to_pylist() == [
        {"output_versions": [0, 1, 1]}]
