"""Reads of an `s3://` store whose cost does not grow with its history (moto on loopback, which
counts requests per store: tests/moto_s3.py).

- a follower's poll with nothing new costs the same few requests at 3 sealed files and at 12,
  reads no sealed file again, and sees what later seals and a compaction leave exactly as a
  fresh full snapshot does;
- the sealed-file cache: a second process on the host (a new store object on the same cache
  directory) reads no sealed file from the object store again, and a file whose bytes changed
  on the object store is refused when fetched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import trajstore
from tests.conftest import S3Server
from trajstore.errors import CorruptionError

POLL_SQL = ("SELECT count(*) AS rollouts, count(*) FILTER (WHERE trainable) AS trainable, "
            "sum(reward) AS reward FROM rollouts")


def rollout(b: int) -> list[dict[str, Any]]:
    rid = f"r{b}"
    common = {"run": "follow", "group_id": f"g{b}", "rollout_id": rid}
    return [
        {**common, "kind": "turn", "event_id": f"{rid}-t0", "segment_id": f"{rid}-s0", "turn_index": 0,
         "policy_version": 0, "prompt_ids": [1, 2, b], "output_ids": [4, 5], "output_logprobs": [-0.5, -0.25]},
        {**common, "kind": "reward", "event_id": f"{rid}-reward", "reward": float(b)},
        {**common, "kind": "status", "event_id": f"{rid}-status", "status": "completed", "group_size": 1},
    ]


def seal_files(store: trajstore.Store, first: int, n: int) -> None:
    """`n` sealed files, one rollout each (from another writer process's point of view: sealed only)."""
    with store.writer("w", seal_interval=3600) as writer:
        for b in range(first, first + n):
            writer.append(rollout(b))
            writer.seal()


@pytest.fixture
def s3_uri(s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("TRAJSTORE_SPOOL", str(tmp_path / "spool"))
    monkeypatch.setenv("TRAJSTORE_FILE_CACHE", str(tmp_path / "file-cache"))
    return s3_server.new_uri()


def idle_poll_requests(s3_server: S3Server, uri: str, follower: trajstore.Follower) -> int:
    """Requests of one poll (the collector's: a query over the views) with nothing new to read."""
    with follower.snapshot() as snap:
        snap.query(POLL_SQL)
    read, before = follower.files_read, s3_server.requests(uri)
    with follower.snapshot() as snap:
        snap.query(POLL_SQL)
    assert follower.files_read == read, "a poll with nothing new read a sealed file again"
    return s3_server.requests(uri) - before


def test_idle_poll_costs_the_same_at_any_file_count(s3_server: S3Server, s3_uri: str) -> None:
    store = trajstore.open_store(s3_uri)
    seal_files(store, 0, 3)
    reader = trajstore.open_store(s3_uri, create=False)  # another process: sealed rows only
    few = idle_poll_requests(s3_server, s3_uri, reader.follower())
    seal_files(store, 3, 9)
    many = idle_poll_requests(s3_server, s3_uri, reader.follower())
    assert few == many <= 5, f"an idle poll cost {few} requests at 3 files and {many} at 12"


def test_follower_sees_what_a_full_snapshot_sees(s3_uri: str) -> None:
    store = trajstore.open_store(s3_uri)
    seal_files(store, 0, 4)
    reader = trajstore.open_store(s3_uri, create=False)
    follower = reader.follower()
    for step in range(3):
        with follower.snapshot() as snap:
            polled = snap.query(POLL_SQL).to_pylist()
        fresh = trajstore.open_store(s3_uri, create=False).query(POLL_SQL).to_pylist()
        assert polled == fresh and polled[0]["rollouts"] == 4 + 2 * step
        if step == 1:
            store.compact()  # swaps the small files for one: the follower reads it once, drops the rest
        seal_files(store, 4 + 2 * step, 2)
    with follower.snapshot() as snap:
        assert snap.query(POLL_SQL).to_pylist()[0]["rollouts"] == 10


def test_sealed_files_are_fetched_once_per_host(s3_server: S3Server, s3_uri: str) -> None:
    seal_files(trajstore.open_store(s3_uri), 0, 6)
    costs = []
    for fetched in (6, 0):  # a first process on this host, then another on the same cache directory
        store = trajstore.open_store(s3_uri, create=False)
        before = s3_server.requests(s3_uri)
        assert store.query(POLL_SQL).to_pylist()[0]["rollouts"] == 6
        costs.append(s3_server.requests(s3_uri) - before)
        assert store.table.cache is not None and store.table.cache.fetches == fetched
    assert costs[1] <= costs[0] - 6, f"requests {costs}: the second process did not read the log alone"


def test_a_changed_file_is_refused_when_fetched(s3_server: S3Server, s3_uri: str) -> None:
    store = trajstore.open_store(s3_uri)
    seal_files(store, 0, 1)
    (f,) = store.table.snapshot().files
    name = f"{s3_uri}/events/{f.path}"
    from trajstore.location import directory

    fs, path = directory(name)
    with fs.open_input_file(path) as fh:
        body = bytearray(fh.read())
    body[len(body) // 2] ^= 0x01
    s3_server.put(name, bytes(body))
    with pytest.raises(CorruptionError, match="CRC-32"):
        trajstore.open_store(s3_uri, create=False).query(POLL_SQL)


def test_scopes_read_only_the_files_that_can_hold_them(s3_uri: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The newest N events and a time window read the newest files only (by the log's time statistics)."""
    seal_files(trajstore.open_store(s3_uri), 0, 12)
    sql = "SELECT event_id, time FROM events ORDER BY time DESC, event_id"
    every = trajstore.open_store(s3_uri, create=False).query(sql).to_pylist()

    def fresh_host(name: str) -> trajstore.Store:
        monkeypatch.setenv("TRAJSTORE_FILE_CACHE", str(tmp_path / name))  # nothing cached: each file read is fetched
        return trajstore.open_store(s3_uri, create=False)

    store = fresh_host("newest")
    assert store.query(sql, scope=trajstore.Scope(newest=5)).to_pylist() == every[:5]
    assert store.table.cache is not None and store.table.cache.fetches == 2  # 3 events a file: 2 files hold 5
    store = fresh_host("window")
    since = min(r["time"] for r in every if r["event_id"].startswith("r10-"))
    assert store.query(sql, scope=trajstore.Scope(since=since)).to_pylist() == every[:6]  # r10 and r11
    assert store.table.cache is not None and store.table.cache.fetches == 2


def test_compaction_service_bounds_the_file_count(s3_uri: str) -> None:
    """`compact --follow`'s loop merges once `min_files` small files gathered; a read pinned before still
    reads its version, and every event is there once."""
    from trajstore.maintenance import CompactPolicy, compact_follow

    store = trajstore.open_store(s3_uri)
    seal_files(store, 0, 3)
    policy = CompactPolicy(every_s=0.1, min_files=4)
    compact_follow(store.location, store.table, policy, passes=1)
    assert len(store.table.snapshot().files) == 3  # below the trigger: left alone
    seal_files(store, 3, 3)
    before = trajstore.open_store(s3_uri, create=False).pin()
    compact_follow(store.location, store.table, policy, passes=2)
    assert len(store.table.snapshot().files) == 1
    fresh = trajstore.open_store(s3_uri, create=False)
    assert fresh.query(POLL_SQL).to_pylist()[0]["rollouts"] == 6
    assert fresh.query("SELECT count(*) AS n, count(DISTINCT event_id) AS ids FROM _raw").to_pylist() == [
        {"n": 18, "ids": 18}]
    with trajstore.Snapshot(fresh.table, before) as pinned:  # the replaced files are still there for it
        assert pinned.query(POLL_SQL).to_pylist()[0]["rollouts"] == 6
