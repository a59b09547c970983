"""`Writer.stage` then `Writer.append(staged)`: numbering and encoding before the write keep every guarantee of
`append(events)`: gap-free sequence numbers in the order they were given, duplicates skipped, acknowledged means
durable, a failed writer refuses everything after."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trajstore import InvalidEventError, Status, WriterClosedError, open_store, wal


def status(rollout: str, event_id: str | None = None) -> Status:
    return Status(run="t", group_id="g", rollout_id=rollout, status="started", event_id=event_id)


def on_disk(directory: Path) -> list[tuple[str, int]]:
    """(rollout_id, writer_seq) of every batch the writer's segments hold, as recovery would read them."""
    found = []
    for path in wal.list_segments(directory):
        for batch in wal.read_segment(path).batches:
            found += zip(batch.data.column("rollout_id").to_pylist(), batch.data.column("writer_seq").to_pylist())
    return found


def stored(path: Path) -> list[tuple[str, int]]:
    rows = open_store(path).query("SELECT rollout_id, writer_seq FROM events ORDER BY writer_seq").to_pylist()
    return [(r["rollout_id"], r["writer_seq"]) for r in rows]


def test_staged_batches_are_written_in_the_order_they_were_numbered(tmp_path: Path) -> None:
    with open_store(tmp_path).writer("w") as writer:
        a = writer.stage([status("a0"), status("a1")])
        b = writer.stage([status("b")])
        assert (a.result.first_seq, a.result.last_seq, b.result.first_seq) == (0, 1, 2)
        assert on_disk(writer.dir) == []  # numbered and encoded, not written
        assert writer.append(b).appended == 1  # the write takes everything staged before it, under one fsync
        assert on_disk(writer.dir) == [("a0", 0), ("a1", 1), ("b", 2)]
        assert writer.append(a) == a.result  # already durable: nothing more to write
        writer.append([status("c")])
    assert stored(tmp_path) == [("a0", 0), ("a1", 1), ("b", 2), ("c", 3)]


def test_an_id_staged_but_not_yet_written_is_acknowledged_only_once_it_is_durable(tmp_path: Path) -> None:
    with open_store(tmp_path).writer("w") as writer:
        writer.stage([status("first", event_id="e1")])
        result = writer.append([status("again", event_id="e1")])
        assert (result.appended, result.duplicates) == (0, 1)
        assert on_disk(writer.dir) == [("first", 0)]  # the duplicate's answer waited for the event it repeats
    assert stored(tmp_path) == [("first", 0)]


def test_duplicates_are_skipped_across_staged_batches(tmp_path: Path) -> None:
    with open_store(tmp_path).writer("w") as writer:
        writer.append(writer.stage([status("r0", event_id="e0")]))
        again = writer.stage([status("r0-again", event_id="e0"), status("r1", event_id="e1"),
                              status("r1-again", event_id="e1")])
        assert (again.result.appended, again.result.duplicates, again.result.first_seq) == (1, 2, 1)
        writer.append(again)
    assert stored(tmp_path) == [("r0", 0), ("r1", 1)]


def test_an_invalid_call_is_refused_when_staged_and_takes_no_number(tmp_path: Path) -> None:
    with open_store(tmp_path).writer("w") as writer:
        with pytest.raises(InvalidEventError, match="status"):
            writer.stage([status("ok"), {"kind": "status", "group_id": "g", "rollout_id": "bad"}])
        writer.append(writer.stage([status("after")]))
    assert stored(tmp_path) == [("after", 0)]


def test_what_was_staged_and_never_appended_is_written_when_the_writer_closes(tmp_path: Path) -> None:
    with open_store(tmp_path).writer("w") as writer:
        writer.stage([status("staged")])
    assert stored(tmp_path) == [("staged", 0)]
    with open_store(tmp_path).writer("w") as writer:  # the next epoch goes on after it: no gap, no reuse
        assert writer.append([status("next")]).first_seq == 1


def test_a_batch_staged_by_one_writer_is_refused_by_another(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    with store.writer("one") as one, store.writer("two") as two:
        staged = one.stage([status("r")])
        with pytest.raises(ValueError, match="staged by writer 'one' was given to writer 'two'"):
            two.append(staged)
        one.append(staged)
    assert stored(tmp_path) == [("r", 0)]


def test_a_failed_write_refuses_every_batch_staged_before_it_and_everything_after(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writer = open_store(tmp_path).writer("w")
    writer.append([status("kept")])
    a, b = writer.stage([status("a")]), writer.stage([status("b")])

    def refuse(self: wal.SegmentWriter) -> None:
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(wal.SegmentWriter, "sync", refuse)
        with pytest.raises(WriterClosedError, match="No space left on device"):
            writer.append(a)
    for refused in (lambda: writer.append(b), lambda: writer.stage([status("c")])):
        with pytest.raises(WriterClosedError, match="failed earlier"):
            refused()
    writer.close()
    assert stored(tmp_path) == [("kept", 0)]  # neither staged batch was acknowledged, nor is either kept


def test_a_write_of_more_buffers_than_one_system_call_takes_is_whole(tmp_path: Path) -> None:
    n = wal._IOV_MAX  # two buffers (head, body) per batch: twice what one writev takes
    with open_store(tmp_path).writer("w") as writer:
        staged = [writer.stage([status(f"r{i}")]) for i in range(n)]
        writer.append(staged[-1])
        assert on_disk(writer.dir) == [(f"r{i}", i) for i in range(n)]
    assert len(stored(tmp_path)) == n


def test_a_short_write_goes_on_where_the_kernel_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writev = os.writev

    def at_most_100_bytes(fd: int, buffers: list[bytes | memoryview]) -> int:  # what a signal or a quota may cause
        first = memoryview(buffers[0])
        return writev(fd, [first[:100]]) if len(first) else writev(fd, buffers[1:2])

    with open_store(tmp_path).writer("w") as writer:
        monkeypatch.setattr(os, "writev", at_most_100_bytes)
        writer.append([status("a"), status("b")])
        writer.append(writer.stage([status("c")]))
        monkeypatch.undo()
        assert on_disk(writer.dir) == [("a", 0), ("b", 1), ("c", 2)]
    assert stored(tmp_path) == [("a", 0), ("b", 1), ("c", 2)]
