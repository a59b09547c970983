"""Crash safety: real writer and compactor processes killed with SIGKILL at random moments.

Each trial starts a child process (`crash_writer.py`) that opens writer NAME and appends
one rollout per call with client-chosen event_ids, acknowledging each call that returned
in a side file; the test kills it with SIGKILL after a random delay, checks the store as
the crash left it, and lets the next trial's process (the writer's next epoch) recover and
carry on. Three paths, one store each:

(a) plain appends (seals happen only when a new epoch seals what the last one left);
(b) tiny seal_bytes, short seal_interval and explicit seal() calls, so kills land in the
    Parquet write, the Delta commit and the deletion of sealed segments;
(c) a compaction process looping `store.compact` beside a writer, both killed.

After every kill, from a fresh reader:
- every acknowledged batch is there exactly once and unchanged (token counts and sums,
  rewards, statuses); the one batch in flight at the kill is there whole or not at all;
- no event_id and no (writer, writer_seq) occurs twice among the snapshot's physical rows
  (`_raw`: sealed files + live segment rows), so sealed and live rows never double count;
- the writer's writer_seq values are exactly 0..n-1, and `store.verify()` is ok.
In the next process: the epoch goes up; acknowledged batches re-sent by the client (whose
own bookkeeping may lag a few batches behind) are no-ops, the batch that was in flight is
a no-op exactly when it had become durable, and new batches continue the sequence with no
gap. Finally the test process itself reopens the writer, appends, closes (sealing
everything) and checks again.

Kill timing is real time and varies; every other decision comes from a seeded
random.Random per trial. A failure names its seed; `TRAJSTORE_CRASH_SEED=<seed>` replays
those decisions.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest
from deltalake import DeltaTable

import trajstore
from tests.ledger import assert_ledger_balances
from tests.trajstore.crash_writer import FINGERPRINT_SQL, batch_size, fingerprint, make_batch
from trajstore import wal

pytestmark = pytest.mark.slow

HELPER = Path(__file__).with_name("crash_writer.py")
BASE_SEED = int(os.environ.get("TRAJSTORE_CRASH_SEED") or random.SystemRandom().randrange(1 << 31))
READY_TIMEOUT_S = 60.0
EARLY_KILL = 0.15  # share of trials killed on a timer from spawn: in import, open or recovery
MAX_RESEND = 3  # a restarted client re-sends up to this many acknowledged batches


# ---------------------------------------------------------------------- child processes


class Child:
    """A helper process and the acknowledgements it wrote before it died."""

    def __init__(self, tmp: Path, tag: str, argv: list[str]) -> None:
        self.tag = tag
        self.acks_path = tmp / f"{tag}.acks"
        self.err_path = tmp / f"{tag}.stderr"
        with open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(HELPER), argv[0], *argv[1:-1], str(self.acks_path), argv[-1]],
                stdout=subprocess.DEVNULL, stderr=err,
            )

    @classmethod
    def writer(cls, tmp: Path, tag: str, location: str, name: str, cfg: dict[str, Any]) -> Child:
        return cls(tmp, tag, ["append", location, name, json.dumps(cfg)])

    @classmethod
    def compactor(cls, tmp: Path, tag: str, location: str, cfg: dict[str, Any]) -> Child:
        return cls(tmp, tag, ["compact", location, json.dumps(cfg)])

    def acks(self) -> list[dict[str, Any]]:
        if not self.acks_path.exists():
            return []
        lines = self.acks_path.read_text().splitlines(keepends=True)
        return [json.loads(line) for line in lines if line.endswith("\n")]

    def stderr(self) -> str:
        return self.err_path.read_text()[-4000:]

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not any("ready" in a for a in self.acks()):
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.tag} exited ({self.proc.returncode}) before it was ready:\n{self.stderr()}")
            if time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(f"{self.tag} was not ready after {READY_TIMEOUT_S} s:\n{self.stderr()}")
            time.sleep(0.01)

    def kill(self) -> None:
        """SIGKILL it; a child that already died on its own is a failure (its error is shown)."""
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.tag} died on its own (exit {self.proc.returncode}) "
                                 f"before the kill:\n{self.stderr()}")
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def reap(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@contextmanager
def children() -> Iterator[list[Child]]:
    """Children started inside are killed on the way out, whatever happens."""
    started: list[Child] = []
    try:
        yield started
    finally:
        for child in started:
            child.reap()


@contextmanager
def trial(path: str, i: int, seed: str) -> Iterator[None]:
    try:
        yield
    except AssertionError as exc:
        raise AssertionError(f"{path} trial {i}, seed {seed!r} (replay the run's decisions with "
                             f"TRAJSTORE_CRASH_SEED={BASE_SEED}): {exc}") from exc


# ---------------------------------------------------------------------- what the test knows


@dataclass
class Ledger:
    """What writer `name` was acknowledged and what the store held for it at the last check."""

    name: str
    acked: int = 0  # batches 0..acked-1 were acknowledged
    inflight_stored: bool = False  # batch `acked` is stored although its append never returned
    events: int = 0  # events stored for the writer, hence its next writer_seq
    epoch: int = 0

    def absorb(self, acks: list[dict[str, Any]], resend_from: int) -> None:
        """Check one writer process's acknowledgements against the store it started from."""
        ready = [a for a in acks if "ready" in a]
        if ready:
            assert ready[0]["epoch"] > self.epoch, f"epoch did not go up: {ready[0]} after {self.epoch}"
            self.epoch = ready[0]["epoch"]
        expect = resend_from
        for a in (a for a in acks if "b" in a):
            b, n = a["b"], batch_size(a["b"])
            assert b == expect, f"acknowledgements out of order: {a}, expected batch {expect}"
            expect += 1
            assert a["appended"] + a["duplicates"] == n, a
            if b < self.acked:
                assert a["appended"] == 0, f"re-sent acknowledged batch {b} was stored a second time: {a}"
            elif self.inflight_stored:  # b == self.acked: the batch the last process died appending
                assert a["appended"] == 0, (f"batch {b} became durable before the crash (unacknowledged); "
                                            f"re-sending it stored it a second time: {a}")
                self.inflight_stored = False
                self.acked = b + 1
            else:
                assert (a["appended"], a["first"], a["last"]) == (n, self.events, self.events + n - 1), (
                    f"batch {b} should take writer_seq {self.events}..{self.events + n - 1} (gap-free), got {a}")
                self.events += n
                self.acked = b + 1


def batch_of(rollout_id: str) -> int:
    return int(rollout_id.rsplit("-r", 1)[1])


def check_store(location: str, ledgers: list[Ledger]) -> None:
    """Check a fresh reader's snapshot against the ledgers (and update what the store holds)."""
    store = trajstore.open_store(location)
    with store.snapshot() as snap:
        # `_raw` is the snapshot's physical rows (sealed files UNION ALL live segment rows),
        # before the `events` view keeps one row per event_id: a double count shows here.
        raw_dups = snap.query("SELECT event_id, count(*) AS n FROM _raw GROUP BY event_id "
                              "HAVING count(*) > 1 LIMIT 10").to_pylist()
        seq_dups = snap.query("SELECT writer, writer_seq, count(*) AS n FROM _raw GROUP BY writer, writer_seq "
                              "HAVING count(*) > 1 LIMIT 10").to_pylist()
        rows = snap.query(FINGERPRINT_SQL).to_pylist()
    assert not raw_dups, f"event_ids stored more than once: {raw_dups}"
    assert_ledger_balances(store)  # every generated token accounted once, whatever the kill left
    assert not seq_dups, f"(writer, writer_seq) stored more than once: {seq_dups}"
    by_writer: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_writer[row["writer"]].append(row)
    for ledger in ledgers:
        mine = by_writer.pop(ledger.name, [])
        by_batch: dict[int, dict[str, tuple[Any, ...]]] = defaultdict(dict)
        for r in mine:
            by_batch[batch_of(r["rollout_id"])][r["event_id"]] = (
                r["kind"], r["rollout_id"], r["turn_index"], r["n_prompt"], r["sum_prompt"],
                r["n_out"], r["sum_out"], r["reward"], r["status"])
        missing = sorted(set(range(ledger.acked)) - set(by_batch))
        assert not missing, f"acknowledged batches lost: {missing[:20]} (of {ledger.acked} acknowledged)"
        unknown = sorted(set(by_batch) - set(range(ledger.acked + 1)))
        assert not unknown, f"batches that were never sent are visible: {unknown[:20]}"
        for b, got in by_batch.items():
            want = {e["event_id"]: fingerprint(e) for e in make_batch(ledger.name, b)}
            assert got == want, f"batch {b} is torn or changed: got {got}, want {want}"
        seqs = sorted(r["writer_seq"] for r in mine)
        if seqs != list(range(len(seqs))):
            gaps = sorted(set(range(seqs[-1] + 1)) - set(seqs))[:20]
            raise AssertionError(f"writer_seq of {ledger.name} is not 0..{len(seqs) - 1}: missing {gaps}")
        ledger.inflight_stored = ledger.acked in by_batch
        ledger.events = len(seqs)
    assert not by_writer, f"rows of unknown writers: {list(by_writer)}"
    report = store.verify()
    assert report.ok, f"verify found problems: {report.problems}"


def finish(location: str, ledger: Ledger, rng: random.Random, new_batches: int = 3) -> None:
    """Reopen the writer here, re-send and append more, close (sealing all), check everything."""
    store = trajstore.open_store(location)
    resend_from = max(0, ledger.acked - rng.randint(0, MAX_RESEND))
    acks: list[dict[str, Any]] = []
    with store.writer(ledger.name) as w:
        acks.append({"ready": True, "epoch": w.epoch})
        for b in range(resend_from, ledger.acked + 1 + new_batches):
            r = w.append(make_batch(ledger.name, b))
            acks.append({"b": b, "appended": r.appended, "duplicates": r.duplicates,
                         "first": r.first_seq, "last": r.last_seq})
    ledger.absorb(acks, resend_from)
    check_store(location, [ledger])
    assert ledger.events == sum(batch_size(b) for b in range(ledger.acked))
    left = wal.list_segments(store.location.wal_root / ledger.name)
    assert not left, f"closing the writer left unsealed segments: {left}"


def writer_process(tmp: Path, location: str, ledger: Ledger, rng: random.Random, tag: str,
                   cfg: dict[str, Any], started: list[Child]) -> tuple[Child, int]:
    resend_from = max(0, ledger.acked - rng.randint(0, MAX_RESEND))
    child = Child.writer(tmp, tag, location, ledger.name, {**cfg, "resend_from": resend_from})
    started.append(child)
    return child, resend_from


def kill_writer_at_random(child: Child, rng: random.Random, max_delay: float) -> None:
    if rng.random() < EARLY_KILL:
        time.sleep(rng.uniform(0.2, 1.5))
    else:
        child.wait_ready()
        time.sleep(rng.uniform(0.0, max_delay))
    child.kill()


def kill_writer_in_seal(child: Child, rng: random.Random, max_delay: float) -> None:
    """Half the time aim at an explicit seal: kill within 60 ms after the n-th one starts, which
    lands in its Parquet write, its Delta commit or the deletion of its segments."""
    if rng.random() < 0.5:
        kill_writer_at_random(child, rng, max_delay)
        return
    child.wait_ready()
    target = rng.randint(1, 4)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while sum("sealing" in a for a in child.acks()) < target:
        if child.proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{child.tag} never started seal {target}:\n{child.stderr()}")
        time.sleep(0.002)
    time.sleep(rng.uniform(0.0, 0.06))
    child.kill()


def killed_mid_seal(acks: list[dict[str, Any]]) -> bool:
    marks = [a for a in acks if "sealing" in a or "sealed" in a]
    return bool(marks) and "sealing" in marks[-1]


def unreferenced_files(location: str) -> int:
    """Parquet files in the table directory that no table version references at present."""
    store = trajstore.open_store(location)
    fs = store.location.filesystem
    on_disk = {info.base_name for info in fs.get_file_info(pafs.FileSelector(store.location.table_path))
               if info.base_name.endswith(".parquet")}
    return len(on_disk - {f.path for f in store.table.snapshot().files})


def operations(location: str) -> list[str]:
    """The trajstore operation (seal, compact) of every commit in the table's history."""
    loc = trajstore.open_store(location).location
    history = DeltaTable(loc.table_uri, storage_options=loc.storage_options or None).history()
    return [h["trajstore.operation"] for h in history if "trajstore.operation" in h]


# ---------------------------------------------------------------------- the three paths


def run_writer_trials(location: str, tmp: Path, path: str, trials: int,
                      config: Callable[[random.Random], dict[str, Any]], max_delay: float,
                      kill: Callable[[Child, random.Random, float], None] = kill_writer_at_random,
                      ) -> tuple[Ledger, dict[str, int]]:
    ledger = Ledger(name=f"crash-{path}")
    seen = {"kills": 0, "batches_acked": 0, "inflight_durable": 0, "kills_with_live_segments": 0,
            "kills_mid_explicit_seal": 0}
    with children() as started:
        for i in range(trials):
            seed = f"{BASE_SEED}-{path}-{i}"
            rng = random.Random(seed)
            with trial(path, i, seed):
                child, resend_from = writer_process(tmp, location, ledger, rng, f"{path}-{i}", config(rng), started)
                kill(child, rng, max_delay)
                ledger.absorb(child.acks(), resend_from)
                check_store(location, [ledger])
            seen["kills"] += 1
            seen["kills_mid_explicit_seal"] += killed_mid_seal(child.acks())
            seen["inflight_durable"] += ledger.inflight_stored
            seen["kills_with_live_segments"] += bool(wal.list_segments(
                trajstore.open_store(location).location.wal_root / ledger.name))
        seed = f"{BASE_SEED}-{path}-final"
        with trial(path, trials, seed):
            finish(location, ledger, random.Random(seed))
    seen["batches_acked"] = ledger.acked
    return ledger, seen


def test_kill_during_plain_appends(tmp_path: Path) -> None:
    """(a) Appends only: a kill lands mid-append, mid-fsync, or in the next epoch's recovery.

    Local only: with an s3:// store the write-ahead segments live in the same kind of local
    spool directory, so the S3 run would repeat this path at twice the cost; kills around S3
    commits are covered by the sealing test, which runs on both."""
    _, seen = run_writer_trials(
        str(tmp_path / "store"), tmp_path, "plain", trials=8, max_delay=0.6,
        config=lambda rng: {"seal_bytes": 64 << 20, "seal_interval": 600.0},
    )
    # what the trials exercised: every kill landed on a writer with live segments (none is ever sealed here,
    # so only a kill before the first trial's first append could find none) after thousands of acknowledgements
    assert seen["kills"] == 8 and seen["batches_acked"] > 100, seen
    assert seen["kills_with_live_segments"] >= seen["kills"] - 1, seen


def test_kill_during_sealing(store_location: str, tmp_path: Path) -> None:
    """(b) Sealing all the time: kills land in Parquet writes, Delta commits and segment deletion."""
    _, seen = run_writer_trials(
        store_location, tmp_path, "seal", trials=10, max_delay=1.0,
        config=lambda rng: {
            "seal_bytes": rng.choice([1_000, 4_000, 16_000]),
            "seal_interval": rng.choice([0.05, 0.2, 1.0]),
            "seal_every": rng.choice([1, 2, 5]),
        },
        kill=kill_writer_in_seal,
    )
    seen["unreferenced_parquet_files"] = unreferenced_files(store_location)  # kills between write and commit
    # half the trials aim at an explicit seal; at least one kill must land inside one (7 to 10 of 10 here)
    assert seen["kills"] == 10 and seen["kills_mid_explicit_seal"] >= 1 and seen["batches_acked"] > 0, seen


def test_kill_during_compaction(tmp_path: Path) -> None:
    """(c) A compactor loops `store.compact` with a small target beside a sealing writer; both are
    killed, in either order (with the writer dead first, the compactor seals its orphans).

    Local only: on the moto S3 server a compaction commit takes ~0.5 s, so only a handful
    commit within the trials (3 in 6 trials, measured) while the path costs a minute; kills
    around S3 commits are covered by the sealing test, which runs on both."""
    path = "compact"
    store_location = str(tmp_path / "store")
    ledger = Ledger(name=f"crash-{path}")
    with children() as started:
        for i in range(6):
            seed = f"{BASE_SEED}-{path}-{i}"
            rng = random.Random(seed)
            with trial(path, i, seed):
                writer, resend_from = writer_process(
                    tmp_path, store_location, ledger, rng, f"{path}-{i}-writer",
                    {"seal_bytes": rng.choice([2_000, 6_000]), "seal_interval": 0.2,
                     "seal_every": rng.choice([0, 3])}, started)
                writer.wait_ready()  # it must hold its lock before the compactor looks for orphans
                compactor = Child.compactor(tmp_path, f"{path}-{i}-compactor", store_location,
                                            {"target_bytes": rng.choice([40_000, 100_000, 300_000])})
                started.append(compactor)
                compactor.wait_ready()
                # sealed files here are ~10-20 kB each, so every target makes bins of several
                first, second = (compactor, writer) if rng.random() < 0.5 else (writer, compactor)
                time.sleep(rng.uniform(0.2, 1.5))
                first.kill()
                time.sleep(rng.uniform(0.0, 0.8))
                second.kill()
                ledger.absorb(writer.acks(), resend_from)
                check_store(store_location, [ledger])
        compactions = operations(store_location).count("compact")  # bins committed by the killed compactors
        seed = f"{BASE_SEED}-{path}-final"
        with trial(path, 6, seed):
            store = trajstore.open_store(store_location)
            result = store.compact(target_bytes=1 << 20)  # one whole pass after all the killed ones
            check_store(store_location, [ledger])
            finish(store_location, ledger, random.Random(seed))
    assert compactions > 0, "no compaction committed before a kill: the trials did not exercise compaction"
    # the final pass merges what the killed ones left, unless they had already merged everything into one file
    assert (result.files_after < result.files_before or result.files_before == 1) and ledger.acked > 0, \
        (result, ledger.acked)
