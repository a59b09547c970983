"""The Delta log's integrity (issue 12.8): damaged log entries are reported, never acted on.

Before: random flips in the log crashed every command with a Rust error; a changed digit in a
writer's transaction version hid 40 events, which the writer destroyed when it reopened; a
changed statistics digit made `shard()` silently return fewer rollouts. Each is tried here on
the JSON commits and on a checkpoint (which delta-rs reads instead of the commits before it).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

import trajstore
from trajstore import CorruptionError, Reward, Status, Turn, wal


def rollout(rid: str, group: str, version: int, reward: float) -> list[Any]:
    return [Turn(run="r", group_id=group, rollout_id=rid, segment_id=rid, turn_index=0, policy_version=version,
                 prompt_ids=[1, 2], output_ids=[3, 4], output_logprobs=[-0.5, -0.5]),
            Reward(run="r", group_id=group, rollout_id=rid, reward=reward),
            Status(run="r", group_id=group, rollout_id=rid, status="completed", group_size=2)]


def build(path: Path) -> trajstore.Store:
    """Two writers' seals (groups at versions 3 and 5) and one compaction: adds, removes and txns."""
    store = trajstore.open_store(path)
    for name, version in (("w1", 3), ("w2", 5)):
        with store.writer(name) as w:
            for g in range(2):
                w.append(rollout(f"{name}-{g}a", f"{name}-g{g}", version, 1.0)
                         + rollout(f"{name}-{g}b", f"{name}-g{g}", version, 0.0))
                w.seal()
    store.compact()
    with store.writer("w3") as w:
        w.append(rollout("w3-a", "w3-g", 5, 2.0) + rollout("w3-b", "w3-g", 5, 0.5))
    return store


def observe(path: Path) -> tuple[Any, ...]:
    """What a fresh process sees: the rollouts, a training shard and the writers' progress."""
    store = trajstore.open_store(path, create=False)
    rows = store.query("SELECT rollout_id, reward FROM rollouts ORDER BY rollout_id").to_pylist()
    shard = store.shard(policy_version=5, max_staleness=2, max_rollouts=100)
    return rows, shard.rollout_ids, {w: store.table.sealed_seq(w) for w in ("w1", "w2", "w3")}


def log_dir(path: Path) -> Path:
    return path / "events" / "_delta_log"


def test_flipped_bits_anywhere_in_the_json_commits_are_reported_or_change_nothing(tmp_path: Path) -> None:
    path = tmp_path / "s"
    build(path)
    good = observe(path)
    entries = sorted(log_dir(path).glob("*.json"))
    newest = entries[-1]
    rng = random.Random(8)
    outcomes = {"reported": 0, "same": 0}
    sizes = {e: e.stat().st_size for e in entries}
    targets = [(newest, rng.randrange(sizes[newest])) for _ in range(60)]
    targets += [(e, rng.randrange(sizes[e])) for e in rng.choices(entries, k=60)]
    for entry, offset in targets:
        original = entry.read_bytes()
        damaged = bytearray(original)
        damaged[offset] ^= 1 << rng.randrange(8)
        entry.write_bytes(bytes(damaged))
        try:
            try:
                seen = observe(path)
            except CorruptionError:
                outcomes["reported"] += 1
                assert not trajstore.open_store(path, create=False).verify().ok, (entry.name, offset)
                continue
            assert seen == good, f"a flip at byte {offset} of {entry.name} changed what is read"
            outcomes["same"] += 1
        finally:
            entry.write_bytes(original)
    assert outcomes["reported"] > outcomes["same"] > 0, outcomes
    assert trajstore.open_store(path).verify().ok


def _edit_newest(path: Path, old: str, new: str) -> None:
    entry = sorted(log_dir(path).glob("*.json"))[-1]
    text = entry.read_text()
    assert old in text, text
    entry.write_text(text.replace(old, new, 1))


def test_a_changed_transaction_version_hides_nothing_and_destroys_nothing(tmp_path: Path) -> None:
    """Writer w sealed 40 events, then appended 40 more and died (they are live); a digit of its
    transaction version in the log changes from 39 to 79."""
    path = tmp_path / "s"
    store = trajstore.open_store(path)
    w = store.writer("w")
    for i in range(10):
        w.append(rollout(f"a{i}", f"g{i // 2}", 0, 1.0) + [Reward(run="r", group_id=f"g{i // 2}", rollout_id=f"a{i}",
                                                                   reward=0.5, reward_name="x")])
    w.seal()
    for i in range(10):
        w.append(rollout(f"b{i}", f"h{i // 2}", 0, 1.0) + [Reward(run="r", group_id=f"h{i // 2}", rollout_id=f"b{i}",
                                                                   reward=0.5, reward_name="x")])
    w._lock.release()  # the process dies: no seal, its lock goes with it (as the kernel drops a flock)
    assert trajstore.open_store(path).query("SELECT count(*) AS n FROM events").to_pylist() == [{"n": 80}]
    segments_before = sorted(p.name for p in wal.list_segments(path / "wal" / "w"))
    _edit_newest(path, '"version":39', '"version":79')
    fresh = trajstore.open_store(path, create=False)
    with pytest.raises(CorruptionError, match="Delta log entry .* is damaged"):
        fresh.query("SELECT count(*) FROM events")
    with pytest.raises(CorruptionError):
        fresh.writer("w")
    assert not fresh.verify().ok
    assert sorted(p.name for p in wal.list_segments(path / "wal" / "w")) == segments_before
    _edit_newest(path, '"version":79', '"version":39')
    assert trajstore.open_store(path).query("SELECT count(*) AS n FROM events").to_pylist() == [{"n": 80}]


def test_a_changed_statistic_is_reported_not_a_smaller_shard(tmp_path: Path) -> None:
    path = tmp_path / "s"
    build(path)
    assert len(observe(path)[1]) == 10
    _edit_newest(path, '\\"policy_version\\": 5', '\\"policy_version\\": 2')  # the newest seal's max version
    with pytest.raises(CorruptionError, match="Delta log entry"):
        trajstore.open_store(path, create=False).shard(policy_version=5, max_staleness=2)


def _checkpoint(path: Path) -> Path:
    DeltaTable(str(path / "events")).create_checkpoint()
    (checkpoint,) = log_dir(path).glob("*.checkpoint.parquet")
    return checkpoint


def _rewrite(checkpoint: Path, column: str, change: Any) -> None:
    table = pq.read_table(checkpoint)
    values = [change(v) if v else v for v in table.column(column).to_pylist()]
    index = table.schema.get_field_index(column)
    table = table.set_column(index, table.schema.field(index), pa.array(values, table.schema.field(index).type))
    pq.write_table(table, checkpoint)


def test_in_a_checkpoint_a_changed_statistic_or_transaction_version_is_caught_where_it_is_used(
        tmp_path: Path) -> None:
    """A checkpoint holds no trajstore digest: a sealed file's statistics are checked against the CRC in
    its name; a transaction version where it is acted on (live rows are hidden, or segments deleted,
    only if the table holds their events)."""
    path = tmp_path / "s"
    store = build(path)
    w = store.writer("w4")
    w.append(rollout("w4-a", "w4-g", 5, 1.0))
    w.seal()
    w.append(rollout("w4-b", "w4-g", 5, 0.0))  # live, after the seal
    w._lock.release()  # dies
    checkpoint = _checkpoint(path)
    original = checkpoint.read_bytes()
    good = observe(path)

    def more_sealed(txn: dict[str, Any]) -> dict[str, Any]:
        return {**txn, "version": txn["version"] + 3} if txn["appId"] == "w4" else txn

    _rewrite(checkpoint, "txn", more_sealed)
    fresh = trajstore.open_store(path, create=False)
    assert fresh.table.sealed_seq("w4") == 5  # what the damaged checkpoint says (2 + 3)
    with pytest.raises(CorruptionError, match="transaction version"):
        fresh.query("SELECT count(*) FROM events")
    with pytest.raises(CorruptionError, match="transaction version"):
        fresh.compact()  # sealing the dead writer's segments would have deleted them
    assert len(wal.list_segments(path / "wal" / "w4")) == 1

    checkpoint.write_bytes(original)
    _rewrite(checkpoint, "add", lambda add: {**add, "stats": add["stats"].replace('"policy_version": 5',
                                                                                   '"policy_version": 2')})
    with pytest.raises(CorruptionError, match="statistics do not match"):
        trajstore.open_store(path, create=False).shard(policy_version=5, max_staleness=2)
    checkpoint.write_bytes(original)
    assert observe(path) == good
    os.remove(checkpoint)
    (log_dir(path) / "_last_checkpoint").unlink()


def test_an_older_store_without_digests_is_read(tmp_path: Path) -> None:
    """Commits written before issue 12 have no digest: they are read (and checked where they have one)."""
    path = tmp_path / "s"
    build(path)
    for entry in log_dir(path).glob("*.json"):
        lines = []
        for line in entry.read_text().splitlines():
            action = json.loads(line)
            info = action.get("commitInfo")
            if info is not None:
                info.pop("trajstore.digest", None)
                info.pop("trajstore.digests", None)
            lines.append(json.dumps(action))
        entry.write_text("\n".join(lines) + "\n")
    assert trajstore.open_store(path, create=False).verify().ok
    assert len(observe(path)[1]) == 10
