"""`s3://` stores against a real S3 protocol server (moto on loopback, see tests/moto_s3.py).

- a round trip: append, seal, query, shard, compact (a commit with remove actions), time
  travel to the version before compaction, and a reader on "another machine" (its own
  spool) that sees exactly the sealed events;
- two writer processes appending to one store at once, each sealing several times, so
  their Delta commits race for the same versions (S3 conditional writes decide the
  winner). A reader takes snapshots meanwhile, from this machine (sealed + live rows) and
  from another (sealed only), and every snapshot shows per writer a gap-free prefix that
  never shrinks. Afterwards every acknowledged event is there exactly once, each table
  version read by time travel holds exactly what its Delta transactions say was sealed.
"""

from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable

import trajstore
from tests.conftest import S3Server
from trajstore.errors import StoreNotFoundError

WRITERS = ("alpha", "beta")
APPENDS = 36  # per writer; each append is one whole rollout (2 turns, a reward, a status)
SEAL_EVERY = 6  # explicit seals per writer: APPENDS / SEAL_EVERY, plus the one on close
EVENTS_PER_APPEND = 4
DEADLINE_S = 240.0


def rollout(name: str, b: int, *, group_size: int = 4) -> list[dict[str, Any]]:
    """Rollout `b` of writer `name`, with client-chosen event_ids the test can recount."""
    rid, gid = f"{name}-r{b}", f"{name}-g{b // group_size}"
    common = {"run": "s3", "group_id": gid, "rollout_id": rid}
    return [
        {**common, "kind": "turn", "event_id": f"{rid}-t0", "segment_id": f"{rid}-s0", "turn_index": 0,
         "policy_version": 0, "prompt_ids": [1, 2, 3, b], "output_ids": [4, 5], "output_logprobs": [-0.5, -0.25]},
        {**common, "kind": "turn", "event_id": f"{rid}-t1", "segment_id": f"{rid}-s0", "turn_index": 1,
         "policy_version": 0, "prompt_ids": [6], "output_ids": [7, 8, 9], "output_logprobs": [-0.1, -0.2, -0.3]},
        {**common, "kind": "reward", "event_id": f"{rid}-reward", "reward": float(b % 3)},
        {**common, "kind": "status", "event_id": f"{rid}-status", "status": "completed",
         "group_size": group_size},
    ]


def _writer_process(uri: str, name: str, acks: str) -> None:
    """Child: append APPENDS rollouts, sealing every SEAL_EVERY; log each acknowledged append."""
    store = trajstore.open_store(uri)
    with store.writer(name, seal_interval=3600) as writer, open(acks, "a") as log:
        for b in range(APPENDS):
            result = writer.append(rollout(name, b))
            log.write(json.dumps({"b": b, "first": result.first_seq, "last": result.last_seq}) + "\n")
            log.flush()
            if (b + 1) % SEAL_EVERY == 0:
                writer.seal()


def per_writer(snap: trajstore.Snapshot) -> dict[str, int]:
    """Check that each writer's visible events are a gap-free prefix of whole rollouts, in
    append order, with no physical row twice; return the events visible per writer."""
    rows = snap.query("SELECT writer, count(*) AS n, count(DISTINCT writer_seq) AS seqs, min(writer_seq) AS lo, "
                      "max(writer_seq) AS hi, count(DISTINCT rollout_id) AS rollouts, "
                      "max(CAST(split_part(rollout_id, '-r', 2) AS INTEGER)) AS last_b "
                      "FROM events GROUP BY writer").to_pylist()
    raw = snap.query("SELECT count(*) AS n, count(DISTINCT event_id) AS ids FROM _raw").to_pylist()[0]
    assert raw["n"] == raw["ids"], f"a physical row is there twice: {raw}"
    seen = {}
    for r in rows:
        assert r["lo"] == 0 and r["n"] == r["seqs"] == r["hi"] + 1, f"{r['writer']}: writer_seq is not 0..k: {r}"
        assert r["n"] == EVENTS_PER_APPEND * r["rollouts"], f"{r['writer']}: a partial append is visible: {r}"
        assert r["last_b"] == r["rollouts"] - 1, f"{r['writer']}: visible rollouts are not its first ones: {r}"
        seen[r["writer"]] = r["n"]
    return seen


def _open_elsewhere(uri: str, spool: Path) -> trajstore.Store:
    """The same store as another machine sees it: its own (empty) spool, so sealed rows only."""
    return trajstore.open_store(uri, create=False, spool=spool)


@pytest.fixture
def s3_store_uri(s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("TRAJSTORE_SPOOL", str(tmp_path / "spool"))
    return s3_server.new_uri()


def test_round_trip(s3_store_uri: str, tmp_path: Path) -> None:
    store = trajstore.open_store(s3_store_uri)
    assert store.location.remote and store.location.wal_root.is_relative_to(tmp_path / "spool")
    with store.writer("solo", seal_interval=3600, seal_kinds=()) as writer:
        assert store.version() == 1  # the writer claimed its name (trajstore.owner)
        for b in range(4):
            writer.append(rollout("solo", b))
        live = store.query("SELECT count(*) AS n FROM events").column("n")[0].as_py()
        assert live == 16 and store.version() == 1, "acknowledged events are visible before any seal"
        assert writer.seal() == 16
        for b in range(4, 8):
            writer.append(rollout("solo", b))
            writer.seal()
    sealed_version = store.version()
    assert sealed_version == 6  # create, claim, then one commit per seal; close had nothing left

    elsewhere = _open_elsewhere(s3_store_uri, tmp_path / "other-spool")
    assert per_writer(elsewhere.snapshot()) == {"solo": 32}
    samples = elsewhere.query("SELECT rollout_id, tokens, loss_mask FROM samples ORDER BY rollout_id").to_pylist()
    assert len(samples) == 8
    assert samples[0]["tokens"] == [1, 2, 3, 0, 4, 5, 6, 7, 8, 9]
    assert samples[0]["loss_mask"] == [False] * 4 + [True] * 2 + [False] + [True] * 3
    shard = elsewhere.shard(policy_version=0, max_staleness=0)
    assert sorted(shard.group_ids) == ["solo-g0", "solo-g1"] and len(shard.rollout_ids) == 8
    assert shard.table_version == sealed_version

    result = store.compact(target_bytes=64 << 20)  # removes + add in one commit
    assert (result.files_before, result.files_after) == (5, 1)
    assert store.version() == sealed_version + 1
    assert per_writer(store.snapshot()) == {"solo": 32}
    assert store.verify().ok
    # Time travel: the version before compaction still reads its five files; an older one less.
    old = store.snapshot(sealed_version)
    assert len(old.files) == 5 and per_writer(old) == {"solo": 32}
    assert per_writer(store.snapshot(2)) == {"solo": 16}
    assert store.query("SELECT count(*) AS n FROM events", version=3).column("n")[0].as_py() == 20

    with pytest.raises(StoreNotFoundError):
        trajstore.open_store(s3_store_uri + "-missing", create=False)


def test_two_writer_processes(s3_store_uri: str, tmp_path: Path) -> None:
    store = trajstore.open_store(s3_store_uri)
    elsewhere = _open_elsewhere(s3_store_uri, tmp_path / "other-spool")
    ctx = multiprocessing.get_context("spawn")
    acks = {name: tmp_path / f"{name}.acks" for name in WRITERS}
    procs = [ctx.Process(target=_writer_process, args=(s3_store_uri, name, str(acks[name])), name=name)
             for name in WRITERS]
    for p in procs:
        p.start()

    here_max: dict[str, int] = {}
    there_max: dict[str, int] = {}
    snapshots = 0
    deadline = time.monotonic() + DEADLINE_S

    def check(reader: trajstore.Store, high: dict[str, int]) -> None:
        with reader.snapshot() as snap:
            seen = per_writer(snap)
        for name, n in seen.items():
            assert n >= high.get(name, 0), f"{name}: a later snapshot shows fewer events ({n} < {high[name]})"
            high[name] = n

    try:
        while any(p.is_alive() for p in procs):
            assert time.monotonic() < deadline, f"writers still running after {DEADLINE_S:.0f} s"
            check(store, here_max)
            check(elsewhere, there_max)
            snapshots += 1
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0], "a writer process failed; see its traceback above"
    assert snapshots >= 2, "the reader did not overlap the writers"

    # Every acknowledged append is there exactly once, sealed, and nothing is left live.
    expected = {}
    for name in WRITERS:
        lines = [json.loads(line) for line in acks[name].read_text().splitlines()]
        assert [line["b"] for line in lines] == list(range(APPENDS))
        assert lines[-1]["last"] == APPENDS * EVENTS_PER_APPEND - 1
        expected[name] = APPENDS * EVENTS_PER_APPEND
    assert per_writer(store.snapshot()) == expected
    assert per_writer(elsewhere.snapshot()) == expected
    ids = elsewhere.query("SELECT event_id FROM events").column("event_id").to_pylist()
    assert sorted(ids) == sorted(e["event_id"] for name in WRITERS for b in range(APPENDS) for e in rollout(name, b))
    assert store.live().by_writer == {}
    assert store.verify().ok

    # Each writer committed its seals separately, and their commits interleave in one history.
    latest = store.version()
    seals_per_writer = APPENDS // SEAL_EVERY
    assert latest >= len(WRITERS) * seals_per_writer
    # Time travel: every version holds, per writer, exactly the prefix its Delta
    # transaction says was sealed at that version, growing version by version.
    previous = {name: -1 for name in WRITERS}
    for version in range(latest + 1):
        snap = store.table.snapshot(version, writers=list(WRITERS))
        sealed = {name: snap.sealed_seq(name) for name in WRITERS}
        with store.snapshot(version) as old:
            seen = per_writer(old)
        assert {name: seen.get(name, 0) for name in WRITERS} == {name: sealed[name] + 1 for name in WRITERS}, \
            f"version {version}"
        assert all(sealed[name] >= previous[name] for name in WRITERS)
        previous = sealed
    assert previous == {name: APPENDS * EVENTS_PER_APPEND - 1 for name in WRITERS}


def test_concurrent_commits_never_lose_one(s3_store_uri: str) -> None:
    """Processes committing at once never overwrite each other's commit: the Delta log
    gets exactly one version per commit (conditional put decides, the loser retries)."""
    trajstore.open_store(s3_store_uri)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_commit_many, args=(s3_store_uri, f"c{i}", 15)) for i in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=DEADLINE_S)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    store = trajstore.open_store(s3_store_uri, create=False)
    assert store.version() == 45
    assert {f"c{i}": store.table.sealed_seq(f"c{i}") for i in range(3)} == {f"c{i}": 14 for i in range(3)}
    dt = DeltaTable(store.location.table_uri, storage_options=store.location.storage_options)
    ops = [h.get("trajstore.operation") for h in dt.history()]
    assert sorted(op for op in ops if op and op != "create") == sorted(f"c{i}-{k}" for i in range(3) for k in range(15))


def _commit_many(uri: str, app_id: str, n: int) -> None:
    """Child: n empty commits, each carrying its own application transaction."""
    store = trajstore.open_store(uri, create=False)
    for k in range(n):
        store.table.commit([], operation=f"{app_id}-{k}", writer_txn=(app_id, k))

