"""The hot tier and the writer: checksummed Arrow IPC stream segments, torn tails,
idempotency, gap-free sequences, one live owner per writer name, and sealing
into the Delta table.

Tests that damage bytes on purpose open their own local store under `tmp_path`; every other
test goes through the `store` fixture, so it also runs against object storage.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import trajstore
from trajstore import CorruptionError, Reward, Status, Turn, WriterBusyError, wal
from trajstore.events import to_columns
from trajstore.schema import EVENT_SCHEMA

REPO = Path(__file__).resolve().parents[2]
MARKER = 0x5A3C_7E11  # a token id whose bytes are easy to find in a segment


def rollout(rid: str, *, group: str = "g", reward: float = 1.0, marker: int | None = None,
            version: int = 0) -> list[Any]:
    """A two-turn rollout with a reward and a completed status; `marker` goes into the prompt."""
    first_prompt = [10, 11, 12] if marker is None else [10, marker, 12]
    return [
        Turn(group_id=group, rollout_id=rid, segment_id=f"{rid}/0", turn_index=0, policy_version=version,
             prompt_ids=first_prompt, output_ids=[20, 21], output_logprobs=[-0.5, -0.25]),
        Turn(group_id=group, rollout_id=rid, segment_id=f"{rid}/0", turn_index=1, policy_version=version,
             prompt_ids=[13], output_ids=[22, 23, 24], output_logprobs=[-1.0, -0.125, -2.0],
             output_mask=[True, False, True]),
        Reward(group_id=group, rollout_id=rid, reward=reward),
        Status(group_id=group, rollout_id=rid, status="completed", group_size=2),
    ]


def segments(store: trajstore.Store, writer: str) -> list[Path]:
    return wal.list_segments(store.location.wal_root / writer)


def rows(store: trajstore.Store, sql: str = "SELECT * FROM events ORDER BY writer, writer_seq") -> list[dict[str, Any]]:
    return store.query(sql).to_pylist()


def scalar(store: trajstore.Store, sql: str) -> Any:
    return store.query(sql).column(0)[0].as_py()


def flip(path: Path, offset: int) -> bytes:
    """Flip one byte of a file in place; returns the original bytes."""
    data = path.read_bytes()
    damaged = bytearray(data)
    damaged[offset] ^= 0x5A
    path.write_bytes(bytes(damaged))
    return data


def batch_of(events: list[Any], *, writer: str, epoch: int, first_seq: int) -> pa.RecordBatch:
    columns = to_columns(events)
    n = len(columns["event_id"])
    columns["writer"] = pa.array([writer] * n)
    columns["writer_epoch"] = pa.array([epoch] * n, pa.int64())
    columns["writer_seq"] = pa.array(range(first_seq, first_seq + n), pa.int64())
    return pa.RecordBatch.from_arrays([columns[f.name] for f in EVENT_SCHEMA], schema=EVENT_SCHEMA)


# ------------------------------------------------------------------ segments


def test_segment_round_trip(tmp_path: Path) -> None:
    path = tmp_path / wal.segment_name(3, 0)
    batches = [batch_of(rollout("a"), writer="w", epoch=3, first_seq=0),
               batch_of(rollout("b") + rollout("c"), writer="w", epoch=3, first_seq=4),
               batch_of([rollout("d")[2]], writer="w", epoch=3, first_seq=12)]
    segment = wal.SegmentWriter(path, writer="w", epoch=3)
    ends = []
    for batch in batches:
        first = batch.column("writer_seq")[0].as_py()
        segment.write(batch, first, first + batch.num_rows - 1)
        segment.sync()
        ends.append(path.stat().st_size)

        # A segment being written reads back whole at every acknowledged point.
        read = wal.read_segment(path)
        assert not read.torn and read.good_bytes == ends[-1]
        assert [b.data.equals(x) for b, x in zip(read.batches, batches)] == [True] * len(ends)
    segment.close()

    read = wal.read_segment(path)
    assert not read.torn and read.total_bytes == ends[-1] + 8  # plus the end-of-stream marker
    assert [(b.writer, b.epoch, b.first_seq, b.last_seq) for b in read.batches] == \
        [("w", 3, 0, 3), ("w", 3, 4, 11), ("w", 3, 12, 12)]
    assert all(b.data.equals(x) for b, x in zip(read.batches, batches))
    assert read.last_seq == 12
    assert wal.parse_segment_name(path.name) == (3, 0)
    with pytest.raises(FileExistsError):  # a segment is never reused
        wal.SegmentWriter(path, writer="w", epoch=3)


def test_appended_events_read_back_exactly(store: trajstore.Store) -> None:
    events = rollout("a", marker=MARKER) + rollout("b", reward=0.0)
    with store.writer("rt-w", seal_on_close=False) as writer:
        result = writer.append(events)
    assert (result.appended, result.duplicates, result.first_seq, result.last_seq) == (8, 0, 0, 7)
    got = rows(store)
    assert [r["kind"] for r in got] == ["turn", "turn", "reward", "status"] * 2
    turns = [r for r in got if r["kind"] == "turn"]
    assert [t["prompt_ids"] for t in turns] == [[10, MARKER, 12], [13], [10, 11, 12], [13]]
    assert [t["output_mask"] for t in turns] == [None, [True, False, True]] * 2
    assert {(r["writer"], r["writer_epoch"]) for r in got} == {("rt-w", 1)}
    assert [r["writer_seq"] for r in got] == list(range(8))


def test_a_failed_fsync_refuses_the_batch_and_leaves_none_of_it_behind(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A full or failing disk: the append raises, its events never show up (not live, not after recovery,
    not sealed), and the failed writer closes without raising; the next epoch goes on from the acknowledged."""
    store = trajstore.open_store(tmp_path / "store")
    writer = store.writer("full-w")
    writer.append(rollout("kept"))

    def refuse(self: wal.SegmentWriter) -> None:
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(wal.SegmentWriter, "sync", refuse)
        with pytest.raises(trajstore.WriterClosedError, match="No space left on device"):
            writer.append(rollout("refused"))
        assert {r["rollout_id"] for r in rows(store)} == {"kept"}
        writer.close()  # nothing to seal or close that could fail again
    with store.writer("full-w") as again:
        assert again.append(rollout("next")).first_seq == 4
    got = rows(store)
    assert [r["rollout_id"] for r in got] == ["kept"] * 4 + ["next"] * 4
    assert [r["writer_seq"] for r in got] == list(range(8))


# ------------------------------------------------------------------ torn tails


def test_torn_tail_is_cut_at_the_last_whole_batch(tmp_path: Path) -> None:
    store = trajstore.open_store(tmp_path / "s")
    with store.writer("torn-w", seal_on_close=False) as writer:
        writer.append(rollout("a"))
        (path,) = segments(store, "torn-w")
        whole = path.stat().st_size
        writer.append(rollout("b"))
        second = path.stat().st_size
    original = path.read_bytes()

    # Wherever a crash cuts the second batch, the first stays and nothing of the second shows.
    for cut in (whole + 1, whole + 4, whole + 8, whole + 9, (whole + second) // 2, second - 1):
        path.write_bytes(original[:cut])
        read = wal.read_segment(path)
        assert read.torn and read.good_bytes == whole and [b.last_seq for b in read.batches] == [3]

    path.write_bytes(original[: (whole + second) // 2])
    assert [r["rollout_id"] for r in rows(store)] == ["a"] * 4

    with store.writer("torn-w", seal_on_close=False) as writer:
        assert path.stat().st_size == whole  # recovery cut the tail
        assert writer.epoch == 2
        result = writer.append(rollout("c"))
        assert (result.first_seq, result.last_seq) == (4, 7)  # continues after the last whole batch
        assert [p.name for p in segments(store, "torn-w")][-1] == wal.segment_name(2, 4)
    got = rows(store)
    assert [(r["rollout_id"], r["writer_epoch"], r["writer_seq"]) for r in got] == \
        [("a", 1, i) for i in range(4)] + [("c", 2, i) for i in range(4, 8)]


def test_a_segment_cut_inside_its_schema_is_empty_not_an_error(tmp_path: Path) -> None:
    store = trajstore.open_store(tmp_path / "s")
    with store.writer("early-w", seal_on_close=False) as writer:
        writer.append(rollout("a"))
    (path,) = segments(store, "early-w")
    path.write_bytes(path.read_bytes()[:100])  # a crash right after the file was created
    read = wal.read_segment(path)
    assert read.torn and not read.batches
    assert rows(store) == []
    with store.writer("early-w", seal_on_close=False) as writer:
        assert writer.append(rollout("b")).first_seq == 0


# ------------------------------------------------------------------ idempotency


def test_reappending_an_event_id_is_a_no_op_for_one_writer(store: trajstore.Store) -> None:
    a = {"kind": "reward", "event_id": "e-a", "group_id": "g", "rollout_id": "r", "reward": 1.0}
    b = {**a, "event_id": "e-b", "reward_name": "format"}
    c = {**a, "event_id": "e-c", "reward_name": "length"}
    with store.writer("idem-w", seal_on_close=False) as writer:
        r1 = writer.append([a, b, a])
        assert (r1.appended, r1.duplicates, r1.first_seq, r1.last_seq) == (2, 1, 0, 1)
        r2 = writer.append([b, c])
        assert (r2.appended, r2.duplicates, r2.first_seq, r2.last_seq) == (1, 1, 2, 2)
        r3 = writer.append([{**a, "reward": 5.0}, c])  # same id, other content: still the first one
        assert (r3.appended, r3.duplicates, r3.first_seq, r3.last_seq) == (0, 2, None, None)
    with store.writer("idem-w") as writer:  # a new epoch knows the ids its segments hold
        r4 = writer.append([a, b, c])
        assert (r4.appended, r4.duplicates) == (0, 3)
    got = rows(store)
    assert [(r["event_id"], r["writer_seq"]) for r in got] == [("e-a", 0), ("e-b", 1), ("e-c", 2)]
    assert scalar(store, "SELECT reward FROM rollouts") == 3.0


def test_an_event_id_shows_once_across_writers(store: trajstore.Store) -> None:
    turn = {"kind": "turn", "event_id": "same-turn", "group_id": "g", "rollout_id": "r", "segment_id": "s",
            "turn_index": 0, "policy_version": 0, "prompt_ids": [1, 2], "output_ids": [3],
            "output_logprobs": [-0.5]}
    reward = {"kind": "reward", "event_id": "same-reward", "group_id": "g", "rollout_id": "r", "reward": 1.0}
    w1 = store.writer("dup-1", seal_on_close=False)
    w2 = store.writer("dup-2", seal_on_close=False)
    try:
        assert w1.append([turn, reward]).appended == 2
        assert w2.append([turn, {**reward, "reward": 7.0}]).appended == 2  # w2 cannot know w1's ids

        def check(copies: int) -> None:
            with store.snapshot() as snap:
                assert snap.query("SELECT count(*) FROM _raw").column(0)[0].as_py() == copies
                got = snap.query("SELECT event_id, writer, reward FROM events ORDER BY event_id").to_pylist()
                assert got == [{"event_id": "same-reward", "writer": "dup-1", "reward": 1.0},
                               {"event_id": "same-turn", "writer": "dup-1", "reward": None}]
                assert snap.query("SELECT tokens, turns FROM samples").to_pylist() == [{"tokens": [1, 2, 3], "turns": 1}]
                assert snap.query("SELECT turns, reward FROM rollouts").to_pylist() == [{"turns": 1, "reward": 1.0}]

        check(4)  # both copies live
        w1.seal()  # one copy sealed, the other live
        check(4)
        w2.seal()  # its copies are in the table already: sealed once (issue 12.5)
        check(2)
    finally:
        w1.close()
        w2.close()
    check(2)


def test_an_event_resent_through_a_new_writer_is_sealed_once(store: trajstore.Store) -> None:
    """Issue 12.5: the default writer name changes with every restart (`<host>-<pid>`), so a client that
    re-sends its events after a restart appends them through a new writer. The views always showed them
    once; a reader of the Delta table alone (Spark, Polars, here delta-rs) now does too."""
    from deltalake import DeltaTable

    import dataclasses

    events = [dataclasses.replace(e, event_id=f"resent-{i}") for i, e in enumerate(rollout("resent"))]
    with store.writer("before-restart") as w:
        w.append(events)
    with store.writer("after-restart") as w:
        assert w.append(events).appended == 4  # this writer cannot know them yet: stored live...
        assert scalar(store, "SELECT count(*) FROM events") == 4
    sealed = DeltaTable(store.location.table_uri, storage_options=store.location.storage_options or None)
    ids = sealed.to_pyarrow_table(columns=["event_id", "writer"]).to_pylist()
    assert len(ids) == 4 and {r["writer"] for r in ids} == {"before-restart"}  # ...and sealed once
    assert store.table.sealed_seq("after-restart") == 3  # its progress is recorded all the same
    assert scalar(store, "SELECT count(*) FROM events") == 4 and store.verify().ok


# ------------------------------------------------------------------ sequences


def test_writer_seq_is_gap_free_across_threads_seals_and_epochs(store: trajstore.Store) -> None:
    results: list[trajstore.AppendResult] = []
    lock = threading.Lock()

    def work(writer: trajstore.Writer, thread: int) -> None:
        for k in range(12):
            events = [{"kind": "reward", "event_id": f"t{thread}-{k}-{j}", "group_id": "g",
                       "rollout_id": f"r{thread}", "reward_name": f"c{k}-{j}", "reward": float(j)}
                      for j in range(3)]
            if k % 4 == 3:  # re-send the previous call too: its events take no new numbers
                events += [{**e, "event_id": f"t{thread}-{k - 1}-{j}"} for j, e in enumerate(events)]
            result = writer.append(events)
            with lock:
                results.append(result)

    with store.writer("seq-w") as writer:
        threads = [threading.Thread(target=work, args=(writer, t)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        writer.seal()
        results.append(writer.append([{"kind": "status", "group_id": "g", "rollout_id": "r0", "status": "completed"}]))
    with store.writer("seq-w", seal_on_close=False) as writer:
        results.append(writer.append([{"kind": "status", "group_id": "g", "rollout_id": "r1", "status": "failed"}]))

    total = sum(r.appended for r in results)
    assert total == 4 * 12 * 3 + 2
    assert sum(r.duplicates for r in results) == 4 * 3 * 3
    assert all(r.last_seq - r.first_seq + 1 == r.appended for r in results if r.appended)
    spans = sorted((r.first_seq, r.last_seq) for r in results if r.appended)
    covered = [s for first, last in spans for s in range(first, last + 1)]
    assert covered == list(range(total))
    seqs = store.query("SELECT writer_seq FROM events WHERE writer = 'seq-w' ORDER BY writer_seq")
    assert seqs.column(0).to_pylist() == list(range(total))
    epochs = rows(store, "SELECT writer_epoch, count(*) AS n FROM events GROUP BY 1 ORDER BY 1")
    assert epochs == [{"writer_epoch": 1, "n": total - 1}, {"writer_epoch": 2, "n": 1}]


# ------------------------------------------------------------------ one live owner per name


CHILD = textwrap.dedent(
    """
    import sys
    import trajstore
    store = trajstore.open_store(sys.argv[1])
    try:
        writer = store.writer(sys.argv[2], seal_on_close=False)
    except trajstore.WriterBusyError as exc:
        print("busy", exc, flush=True)
        sys.exit(3)
    writer.append([{"kind": "reward", "event_id": "from-child", "group_id": "g", "rollout_id": "r",
                    "reward": 1.0}])
    print("ready", flush=True)
    sys.stdin.read()  # hold the writer until the parent closes stdin or kills us
    """
)


def _spawn(store_location: str, name: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", CHILD, store_location, name], cwd=REPO, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_a_live_writer_name_is_owned_by_one_process(store: trajstore.Store, store_location: str) -> None:
    child = _spawn(store_location, "owned-w")
    try:
        line = child.stdout.readline()
        assert line.strip() == "ready", (line, child.stderr.read() if child.poll() is not None else "")
        with pytest.raises(WriterBusyError, match="owned-w"):
            store.writer("owned-w")
        other = store.writer("other-w")  # other names are free
        other.close()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        child.stdout.close()
        child.stderr.close()
    assert child.returncode == -signal.SIGKILL

    # The kernel dropped the dead owner's lock: the name is free, its events are kept.
    with store.writer("owned-w", seal_on_close=False) as writer:
        assert writer.epoch == 2
        assert writer.append([{"kind": "reward", "event_id": "from-child", "group_id": "g",
                               "rollout_id": "r", "reward": 1.0}]).duplicates == 1
        assert writer.append([{"kind": "status", "group_id": "g", "rollout_id": "r",
                               "status": "completed"}]).first_seq == 1

        # While this process holds it, a second Writer cannot take it, even in this same
        # process (flock is per open file description, not per process).
        with pytest.raises(WriterBusyError):
            store.writer("owned-w")
    assert rows(store, "SELECT event_id, writer_seq FROM events ORDER BY writer_seq")[0] == \
        {"event_id": "from-child", "writer_seq": 0}


# ------------------------------------------------------------------ sealing


VIEW_QUERIES = {
    "events": "SELECT * EXCLUDE (time) FROM events ORDER BY writer, writer_seq",
    "samples": "SELECT * FROM samples ORDER BY rollout_id, segment_id",
    "rollouts": "SELECT * FROM rollouts ORDER BY rollout_id",
    "groups": "SELECT * FROM groups ORDER BY group_id",
    "advantages": "SELECT * FROM advantages ORDER BY rollout_id",
    "checkpoints": "SELECT * FROM checkpoints ORDER BY step",
}


def _views(store: trajstore.Store) -> dict[str, list[dict[str, Any]]]:
    with store.snapshot() as snap:  # one consistent snapshot for all of them
        return {name: snap.query(sql).to_pylist() for name, sql in VIEW_QUERIES.items()}


def test_sealing_moves_rows_into_the_table_without_changing_any_view(store: trajstore.Store) -> None:
    events = rollout("a", reward=1.0) + rollout("b", reward=0.0, version=1) + \
        [{"kind": "checkpoint", "policy_version": 2, "step": 1, "consumed": ["a"]}]
    with store.writer("seal-w", seal_on_close=False, seal_kinds=()) as writer:
        writer.append(events[:5])
        writer.append(events[5:])
        v0 = store.version()
        before = _views(store)
        assert len(before["events"]) == 9 and len(before["advantages"]) == 2
        assert segments(store, "seal-w")

        assert writer.seal() == 9
        v1 = store.version()
        assert v1 > v0
        assert segments(store, "seal-w") == []
        assert sum(f.rows for f in store.table.snapshot().files) == 9
        assert _views(store) == before

        assert writer.seal() == 0  # nothing new: no commit
        assert store.version() == v1

        writer.append(rollout("c", group="h"))
        mixed = _views(store)  # sealed and live together
        assert len(mixed["events"]) == 13
        writer.seal()
        assert store.version() > v1
        assert _views(store) == mixed
    # Reads of an older version see the table as it was (live rows are not added to old versions).
    assert scalar(store, "SELECT count(*) FROM events") == 13
    assert store.query("SELECT count(*) FROM events", version=v1).column(0)[0].as_py() == 9
    assert store.query("SELECT count(*) FROM events", version=v0).column(0)[0].as_py() == 0


def test_closing_a_writer_seals_what_it_appended(store: trajstore.Store) -> None:
    v0 = store.version()
    with store.writer("close-w") as writer:
        writer.append(rollout("a"))
        live = _views(store)
    assert store.version() > v0
    assert segments(store, "close-w") == []
    assert _views(store) == live


def test_small_seal_bytes_seal_in_the_background(store: trajstore.Store) -> None:
    with store.writer("bg-w", seal_bytes=1, seal_interval=0.05) as writer:
        for i in range(3):
            writer.append(rollout(f"r{i}"))
        deadline = time.monotonic() + 60
        while segments(store, "bg-w") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert segments(store, "bg-w") == [], "the background sealer did not seal the full segments"
        assert sum(f.rows for f in store.table.snapshot().files) == 12
    assert [r["writer_seq"] for r in rows(store)] == list(range(12))


def _chunk_last_bytes(path: Path) -> dict[str, int]:
    """For each column chunk of a Parquet file: the offset of its last byte (inside page data)."""
    meta = pq.ParquetFile(path).metadata
    out = {}
    for rg in range(meta.num_row_groups):
        for c in range(meta.num_columns):
            col = meta.row_group(rg).column(c)
            start = col.dictionary_page_offset or col.data_page_offset
            out[col.path_in_schema] = start + col.total_compressed_size - 1
    return out


def test_a_flipped_byte_in_a_sealed_file_raises(tmp_path: Path) -> None:
    store = trajstore.open_store(tmp_path / "s")
    with store.writer("cold-w") as writer:
        writer.append(rollout("a", marker=MARKER) + rollout("b", reward=0.0) +
                      [{"kind": "metric", "step": 1, "metrics": {"loss": 0.5}, "meta": {"note": "x"}}])
    (info,) = store.table.snapshot().files
    path = Path(store.location.data_path(info.path))
    expected = rows(store)
    chunks = _chunk_last_bytes(path)
    for column in ("event_id", "kind", "time", "writer_seq", "rollout_id", "prompt_ids.list.element",
                   "output_logprobs.list.element", "output_mask.list.element", "reward", "status",
                   "metrics.key_value.value", "meta"):
        original = flip(path, chunks[column])
        try:
            with pytest.raises(CorruptionError):
                store.query("SELECT * FROM events")
        finally:
            path.write_bytes(original)
    original = flip(path, chunks["prompt_ids.list.element"])
    with pytest.raises(CorruptionError):  # and through a view that needs the damaged tokens
        store.query("SELECT tokens FROM samples")
    path.write_bytes(original)
    assert rows(store) == expected  # the flips were the only cause


def test_a_writer_seals_the_batches_it_wrote_not_a_read_of_its_segment(tmp_path: Path) -> None:
    """A live writer keeps what it wrote and seals that: a byte flipped in its segment afterwards changes nothing
    sealed (the segment is not read again). A segment an earlier process left is read and verified."""
    store = trajstore.open_store(tmp_path / "s")
    events = rollout("a", marker=MARKER) + rollout("b", reward=0.0)
    with store.writer("mem-w", seal_on_close=False, seal_kinds=()) as writer:
        writer.append(events[:4])
        writer.append(events[4:])
        expected = rows(store)
        (path,) = segments(store, "mem-w")
        flip(path, path.read_bytes().index(MARKER.to_bytes(4, "little")))
        assert writer.seal() == 8
    assert rows(store) == expected
    with store.writer("old-w", seal_on_close=False, seal_kinds=()) as writer:
        writer.append(rollout("c", marker=MARKER))
    (path,) = segments(store, "old-w")
    flip(path, path.read_bytes().index(MARKER.to_bytes(4, "little")))
    with pytest.raises(CorruptionError, match="fails its CRC-32"):
        store.writer("old-w")
    assert sum(f.rows for f in store.table.snapshot().files) == 8  # nothing of it was sealed


def test_recent_ids_stay_bounded_and_forget_the_oldest_first() -> None:
    from trajstore.writer import RecentIds

    ids = RecentIds(cap=4)
    ids.add_all(["a", "b", "c"])
    ids.add_all(["d", "e"])
    assert len(ids) == 4 and "a" not in ids and all(x in ids for x in "bcde")


def test_a_reopened_writer_remembers_only_its_most_recent_sealed_ids(tmp_path: Path) -> None:
    store = trajstore.open_store(tmp_path / "s")
    events = [{"kind": "metric", "step": i, "metrics": {"loss": 1.0}, "event_id": f"m{i}"} for i in range(6)]
    with store.writer("w") as w:
        assert w.append(events).appended == 6
    with store.writer("w", remember_ids=3) as w:
        assert w.append(events[3:]).duplicates == 3  # the last three are remembered
        again = w.append(events[:1])
        assert again.appended == 1  # the oldest was forgotten: stored again...
    n = store.query("SELECT count(*) AS n FROM events WHERE event_id = 'm0'").to_pylist()
    assert n == [{"n": 1}]  # ...and still shown once


def test_one_writer_name_on_two_machines_is_refused_and_loses_nothing(tmp_path: Path) -> None:
    """Two machines (two spool directories) writing one store under one name: the second
    seal is refused, its segments stay, and the writer stops rather than dropping events."""
    import dataclasses

    here = trajstore.open_store(tmp_path / "s")
    elsewhere = trajstore.Store(dataclasses.replace(here.location, wal_root=tmp_path / "other-machine" / "wal"))

    def metric(i: int) -> dict:
        return {"kind": "metric", "step": i, "metrics": {"x": 1.0}, "event_id": f"e{i}"}

    a = here.writer("collector", seal_on_close=False)
    b = elsewhere.writer("collector", seal_on_close=False)
    a.append([metric(0), metric(1)])
    b.append([metric(10)])  # the same seq 0, from the other machine
    assert a.seal() == 2
    with pytest.raises(WriterBusyError, match="another machine"):
        b.seal()
    kept = list((tmp_path / "other-machine" / "wal" / "collector").glob("*.arrows"))
    assert kept and sum(len(wal.read_segment(p).batches) for p in kept) == 1
    a.close()
    b.close()
    sealed = here.query("SELECT event_id FROM events ORDER BY event_id").column(0).to_pylist()
    assert sealed == ["e0", "e1"]  # e10 was not committed under a seq that belongs to e0
