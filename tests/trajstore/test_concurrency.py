"""Eight writer processes append to one store at once while a reader queries it.

Each writer is a real process (`crash_writer.py append` with a stop) with its own writer
name; once all eight have opened, a start signal lets them append at the same moment:
ROLLOUTS rollouts each, one append call per rollout (its turns, a reward and a status),
with small seal_bytes and explicit seals, so the eight commit to the Delta table
concurrently many times and then seal the rest on close. Meanwhile the test process takes
snapshot after snapshot and checks, within each snapshot:

- per writer, the visible writer_seq values are exactly 0..k (a gap-free prefix), and the
  visible rollouts are exactly the writer's first m (it appends them in order), which hold
  exactly those k+1 events;
- every visible rollout is whole, in `events` and in the `rollouts` view: an append call is
  visible entirely or not at all;
- the physical rows (`_raw`: sealed files + live segment rows) hold no event_id twice, so
  sealed and live rows never double count;
- snapshots only move forward: no writer's prefix ever shrinks.

At the end: every writer exited cleanly with gap-free acknowledged sequences, every event
is there exactly once, nothing is left unsealed, each writer sealed several files, and
`store.verify()` is ok.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

import trajstore
from tests.trajstore.crash_writer import batch_size, make_batch, turns_in
from trajstore import wal

pytestmark = pytest.mark.slow

HELPER = Path(__file__).with_name("crash_writer.py")
WRITERS = 8
ROLLOUTS = 120
S3_ROLLOUTS = 45
DEADLINE_S = 240.0


def batch_of(rollout_id: str) -> int:
    return int(rollout_id.rsplit("-r", 1)[1])


def prefix_events(m: int) -> int:
    return sum(batch_size(b) for b in range(m))


def check_snapshot(snap: trajstore.Snapshot, names: list[str], *, rollouts_view: bool = True) -> dict[str, int]:
    """Check one snapshot's consistency; returns the number of rollouts visible per writer.
    (`rollouts_view` adds the slowest query; the reader runs it on every third snapshot.)"""
    seqs = {r["writer"]: r for r in snap.query(
        "SELECT writer, count(*) AS n, count(DISTINCT writer_seq) AS distinct_seqs, "
        "min(writer_seq) AS lo, max(writer_seq) AS hi FROM events GROUP BY writer").to_pylist()}
    per_rollout = snap.query(
        "SELECT writer, rollout_id, count(*) AS n, count(*) FILTER (WHERE kind = 'turn') AS turns "
        "FROM events GROUP BY writer, rollout_id").to_pylist()
    rollouts = snap.query("SELECT rollout_id, turns, status, reward FROM rollouts").to_pylist() \
        if rollouts_view else []
    raw = snap.query("SELECT count(*) AS n, count(DISTINCT event_id) AS ids FROM _raw").to_pylist()[0]
    events = snap.query("SELECT count(*) AS n FROM events").to_pylist()[0]["n"]

    assert raw["n"] == raw["ids"] == events, f"physical rows double count: {raw}, events {events}"
    assert set(seqs) <= set(names), f"unknown writers: {set(seqs) - set(names)}"
    visible: dict[str, set[int]] = defaultdict(set)
    for r in per_rollout:
        b = batch_of(r["rollout_id"])
        assert (r["n"], r["turns"]) == (batch_size(b), turns_in(b)), f"rollout {r['rollout_id']} is partial: {r}"
        visible[r["writer"]].add(b)
    for name, s in seqs.items():
        assert s["lo"] == 0 and s["n"] == s["distinct_seqs"] == s["hi"] + 1, f"{name}: writer_seq not 0..k: {s}"
        m = len(visible[name])
        assert visible[name] == set(range(m)), f"{name}: visible rollouts are not its first {m}"
        assert s["n"] == prefix_events(m), f"{name}: {s['n']} events visible for {m} whole rollouts"
    for r in rollouts:
        b = batch_of(r["rollout_id"])
        assert (r["turns"], r["status"], r["reward"]) == (turns_in(b), "completed", float(b % 7)), r
    return {name: len(visible[name]) for name in names}


def test_eight_writers_and_a_reader(store_location: str, tmp_path: Path) -> None:
    names = [f"conc-{i}" for i in range(WRITERS)]
    store = trajstore.open_store(store_location)  # created before the writers race to create it
    if store.location.remote:
        # Each Delta commit on the moto server costs ~10x a local one (and conditional PUTs are
        # serialized there), so the S3 run seals less often: 3 seals per writer instead of ~15.
        rollouts = S3_ROLLOUTS
        cfg: dict[str, Any] = {"stop": rollouts, "seal_bytes": 64 << 20, "seal_interval": 600.0,
                               "seal_every": rollouts // 3}
    else:
        rollouts = ROLLOUTS
        cfg = {"stop": rollouts, "seal_bytes": 16_000, "seal_interval": 0.5, "seal_every": 20}
    cfg["go"] = str(tmp_path / "go")
    procs: dict[str, tuple[subprocess.Popen[bytes], Path, Path]] = {}
    try:
        for name in names:
            acks, err = tmp_path / f"{name}.acks", tmp_path / f"{name}.stderr"
            with open(err, "wb") as errf:
                proc = subprocess.Popen([sys.executable, str(HELPER), "append", store_location, name,
                                         str(acks), json.dumps(cfg)], stdout=subprocess.DEVNULL, stderr=errf)
            procs[name] = (proc, acks, err)

        # Each writer acknowledges that it opened, then waits for `go`: all eight start at once.
        deadline = time.monotonic() + DEADLINE_S
        while not all(acks.exists() and acks.read_text() for _, acks, _ in procs.values()):
            failed = {n: p.returncode for n, (p, _, _) in procs.items() if p.poll() is not None}
            assert not failed, f"writers exited before they were ready: {failed}"
            assert time.monotonic() < deadline, f"writers not ready after {DEADLINE_S} s"
            time.sleep(0.01)
        Path(cfg["go"]).touch()

        seen = dict.fromkeys(names, 0)
        snapshots = partial = 0
        while any(p.poll() is None for p, _, _ in procs.values()):
            assert time.monotonic() < deadline, f"writers still running after {DEADLINE_S} s"
            with store.snapshot() as snap:
                now = check_snapshot(snap, names, rollouts_view=snapshots % 3 == 0)
            shrunk = {n: (seen[n], now[n]) for n in names if now[n] < seen[n]}
            assert not shrunk, f"a later snapshot shows less of a writer than an earlier one: {shrunk}"
            seen = now
            snapshots += 1
            partial += 0 < sum(now.values()) < WRITERS * rollouts
    finally:
        for proc, _, _ in procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()

    for name, (proc, acks, err) in procs.items():
        assert proc.returncode == 0, f"writer {name} failed ({proc.returncode}):\n{err.read_text()[-4000:]}"
        lines = [json.loads(line) for line in acks.read_text().splitlines()]
        appends = [a for a in lines if "b" in a]
        assert [a["b"] for a in appends] == list(range(rollouts))
        expected_first = 0
        for a in appends:
            n = batch_size(a["b"])
            assert (a["appended"], a["first"], a["last"]) == (n, expected_first, expected_first + n - 1), a
            expected_first += n
        assert lines[-1] == {"closed": True}

    store = trajstore.open_store(store_location)
    with store.snapshot() as snap:
        final = check_snapshot(snap, names)
        ids = set(snap.query("SELECT event_id FROM events").column("event_id").to_pylist())
        files = snap.files
    assert final == dict.fromkeys(names, rollouts)
    assert ids == {e["event_id"] for name in names for b in range(rollouts) for e in make_batch(name, b)}
    for name in names:
        assert not wal.list_segments(store.location.wal_root / name), f"{name} left unsealed segments"
        sealed_files = [f for f in files if f.path.startswith(f"seal-{name}-")]
        assert len(sealed_files) >= 3, f"{name} sealed only {len(sealed_files)} files"
    report = store.verify()
    assert report.ok, report.problems
    # The reader really ran beside the writers, not only before or after them.
    assert partial >= 2, f"only {partial} of {snapshots} snapshots saw the writers mid-way"
    print(f"{snapshots} snapshots ({partial} mid-way), {len(files)} sealed files, table version {report.table_version}")

