"""Damage to write-ahead segments: a flipped byte in a live batch, a damaged schema, the
framing CRCs of format 2 that tell a torn write (cut) from damage (reported), and format 1
segments still read. Split from test_wal.py, whose helpers these share."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pytest

import trajstore
from tests.trajstore.test_wal import MARKER, batch_of, flip, rollout, scalar, segments
from trajstore import CorruptionError, wal
from trajstore.schema import EVENT_SCHEMA

# ------------------------------------------------------------------ corruption of live segments


def _body_span(data: bytes, index: int) -> tuple[int, int]:
    """(start, end) of the body of record batch `index` in a segment's bytes."""
    reader = pa.BufferReader(data)
    pa.ipc.read_message(reader)  # schema
    for _ in range(index + 1):
        message = pa.ipc.read_message(reader)
    end = reader.tell()
    return end - message.body.size, end


@pytest.mark.parametrize("which", [0, 1], ids=["first-batch", "last-batch"])
def test_a_flipped_byte_in_a_live_batch_body_raises(tmp_path: Path, which: int) -> None:
    store = trajstore.open_store(tmp_path / "s")
    writer = store.writer("flip-w", seal_on_close=False)
    writer.append(rollout("a", marker=MARKER if which == 0 else None))
    writer.append(rollout("b", marker=MARKER if which == 1 else None))
    (path,) = segments(store, "flip-w")
    original = path.read_bytes()
    at = original.index(MARKER.to_bytes(4, "little"))
    start, end = _body_span(original, which)
    assert start <= at < end

    flip(path, at + 1)
    for sql in ("SELECT * FROM events", "SELECT count(*) FROM events", "SELECT * FROM samples",
                "SELECT * FROM rollouts"):
        with pytest.raises(CorruptionError):
            store.query(sql)
    writer.close()  # closing (end-of-stream marker) does not make the damage readable
    with pytest.raises(CorruptionError):
        store.query("SELECT * FROM events")
    with pytest.raises(CorruptionError):  # nor does recovery cut it away as if it were a torn tail
        store.writer("flip-w")

    path.write_bytes(original)
    assert scalar(store, "SELECT count(*) FROM events") == 8


def test_a_damaged_schema_message_is_not_taken_for_a_torn_write(tmp_path: Path) -> None:
    """Whole batches after an unreadable schema message mean damage: recovery must refuse,
    not cut the segment to nothing (which would delete acknowledged events)."""
    store = trajstore.open_store(tmp_path / "s")
    with store.writer("schema-w", seal_on_close=False) as writer:
        writer.append(rollout("a"))
    (path,) = segments(store, "schema-w")
    flip(path, 0)  # the schema message's continuation marker
    damaged = path.read_bytes()
    with pytest.raises(CorruptionError, match="schema message"):
        wal.read_segment(path)
    with pytest.raises(CorruptionError):
        store.query("SELECT * FROM events")
    with pytest.raises(CorruptionError):
        store.writer("schema-w")
    assert path.read_bytes() == damaged  # nothing was cut


def test_no_flipped_byte_in_a_segment_is_read_as_other_data(tmp_path: Path) -> None:
    """Sweep the bytes of a closed segment, the last batch's header included: each flip raises
    CorruptionError or reads back the same events; body bytes always raise."""
    store = trajstore.open_store(tmp_path / "s")
    with store.writer("sweep-w", seal_on_close=False) as writer:
        writer.append(rollout("a"))
        writer.append(rollout("b"))
        writer.append(rollout("c"))
    (path,) = segments(store, "sweep-w")
    original = path.read_bytes()
    good = [b.data for b in wal.read_segment(path).batches]
    bodies = [_body_span(original, i) for i in range(3)]
    outcomes = {"corrupt": 0, "same": 0}
    try:
        for offset in range(0, len(original) - 8, 13):
            flip(path, offset)
            in_body = any(a <= offset < b for a, b in bodies)
            try:
                read = wal.read_segment(path)
            except CorruptionError:
                outcomes["corrupt"] += 1
                continue
            finally:
                path.write_bytes(original)
            assert not in_body, f"a flipped body byte at {offset} was not detected"
            assert len(read.batches) == 3 and all(b.data.equals(g) for b, g in zip(read.batches, good)), \
                f"a flipped byte at {offset} read back as other data"
            outcomes["same"] += 1
    finally:
        path.write_bytes(original)
    assert outcomes["corrupt"] > outcomes["same"] > 0


# ------------------------------------------------------------------ framing: torn writes vs flipped bits (issue 12.7)


def _three_batches(tmp_path: Path, *, closed: bool) -> tuple[Path, bytes, list[pa.RecordBatch], int]:
    """A segment with three acknowledged batches (closed, or as a crash leaves it: no end marker),
    its bytes, the batches and where the last batch's message starts."""
    path = tmp_path / wal.segment_name(1, 0)
    seg = wal.SegmentWriter(path, writer="w", epoch=1)
    starts = []
    for i, name in enumerate("abc"):
        starts.append(seg.bytes_written)
        seg.write(batch_of(rollout(name), writer="w", epoch=1, first_seq=4 * i), 4 * i, 4 * i + 3)
        seg.sync()
    if closed:
        seg.close()
    data = path.read_bytes()
    return path, data, [b.data for b in wal.read_segment(path).batches], starts[-1]


def _outcome(path: Path, data: bytes, good: list[pa.RecordBatch]) -> str:
    path.write_bytes(data)
    try:
        read = wal.read_segment(path)
    except CorruptionError:
        return "reported"
    assert len(read.batches) == 3, f"an acknowledged batch was dropped ({len(read.batches)} of 3 read)"
    assert all(b.data.equals(g) for b, g in zip(read.batches, good)), "a flip was read back as other data"
    return "harmless"


@pytest.mark.parametrize("closed", [False, True], ids=["as-a-crash-leaves-it", "closed"])
def test_no_bit_flip_is_taken_for_a_torn_write_or_read_as_data(tmp_path: Path, closed: bool) -> None:
    """A bit of every byte of the newest batch's framing (the message a torn write could have hit: its
    prefix and metadata), and 1,500 random bits anywhere: each flip is reported as damage or changes
    nothing read; an acknowledged batch is never dropped as a torn tail. (Before the framing CRC, 6 of
    1,500 random flips dropped the newest batch and 16 made the segment unsealable.)"""
    path, original, good, last = _three_batches(tmp_path, closed=closed)
    rng = random.Random(12)
    framing_end = last + 8 + int.from_bytes(original[last + 4:last + 8], "little")
    positions = [(offset, rng.randrange(8)) for offset in range(last, framing_end)] if not closed else []
    positions += [(rng.randrange(len(original)), rng.randrange(8)) for _ in range(1500)]
    harmless = []
    for offset, bit in positions:
        damaged = bytearray(original)
        damaged[offset] ^= 1 << bit
        if _outcome(path, bytes(damaged), good) == "harmless":
            harmless.append(offset)
    # every batch byte is covered by a CRC: only schema bytes that decode to the same schema, and the
    # end marker (not data), may change without a report
    assert all(o < len(wal.SCHEMA_MESSAGE) or (closed and o >= len(original) - 8) for o in harmless), harmless
    assert len(harmless) < 0.05 * len(positions)
    path.write_bytes(original)


def test_a_torn_write_at_any_byte_of_the_newest_batch_is_cut_never_reported(tmp_path: Path) -> None:
    path, original, good, last = _three_batches(tmp_path, closed=False)
    framing_end = last + 8 + int.from_bytes(original[last + 4:last + 8], "little")
    for cut in [*range(last + 1, framing_end + 16), *range(framing_end + 16, len(original), 7)]:
        path.write_bytes(original[:cut])
        read = wal.read_segment(path)
        assert read.torn and read.good_bytes == last and len(read.batches) == 2, cut
    path.write_bytes(original + b"\xff\xff")  # the next batch's write cut after two bytes
    assert wal.read_segment(path).torn and len(wal.read_segment(path).batches) == 3


@pytest.mark.parametrize("where", ["length prefix", "continuation marker", "metadata", "body length"])
def test_damage_to_the_newest_batch_survives_reopening_and_is_reported_everywhere(tmp_path: Path,
                                                                                   where: str) -> None:
    """The store refuses to read, verify passes no judgement of ok, compaction and the writer refuse:
    and none of them cuts the damaged batch away."""
    store = trajstore.open_store(tmp_path / "s")
    with store.writer("w", seal_on_close=False) as writer:
        for name in "ab":
            writer.append(rollout(name))
    (path,) = segments(store, "w")
    data = bytearray(path.read_bytes())
    last = wal.read_segment(path).batches and _last_message_start(bytes(data))
    meta_len = int.from_bytes(data[last + 4:last + 8], "little")
    offset = {"length prefix": last + 6, "continuation marker": last + 1, "metadata": last + 8 + meta_len // 2,
              "body length": last + 8 + meta_len - 24}[where]
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptionError, match="not a torn write"):
        store.query("SELECT count(*) FROM events")
    report = store.verify()
    assert not report.ok and any(path.name in p for p in report.problems)
    with pytest.raises(CorruptionError):
        store.compact()
    with pytest.raises(CorruptionError):
        store.writer("w")
    assert path.read_bytes() == bytes(data)  # nothing was cut


def _last_message_start(data: bytes) -> int:
    reader = pa.BufferReader(data)
    pa.ipc.read_message(reader)
    start = reader.tell()
    while True:
        at = reader.tell()
        try:
            pa.ipc.read_message(reader)
        except (EOFError, pa.ArrowInvalid, OSError):
            return start
        if reader.tell() == at:
            return start
        start = at


def test_format_1_segments_are_still_read_and_recovered(tmp_path: Path) -> None:
    """A segment written before issue 12 (body CRC and a CRC of the re-serialized batch in its
    metadata, written by pyarrow's stream writer) is read, sealed and its torn tail cut."""
    import zlib

    store = trajstore.open_store(tmp_path / "s")
    wdir = store.location.wal_root / "old-w"
    wdir.mkdir(parents=True)
    path = wdir / wal.segment_name(1, 0)
    with open(path, "wb") as f, pa.ipc.new_stream(f, EVENT_SCHEMA) as stream:
        for i, name in enumerate("ab"):
            batch = batch_of(rollout(name), writer="old-w", epoch=1, first_seq=4 * i)
            message = batch.serialize()
            stream.write_batch(batch, custom_metadata={
                b"trajstore.crc32": str(zlib.crc32(pa.ipc.read_message(message).body)).encode(),
                b"trajstore.msg_crc32": str(zlib.crc32(message)).encode(), b"trajstore.writer": b"old-w",
                b"trajstore.epoch": b"1", b"trajstore.first_seq": str(4 * i).encode(),
                b"trajstore.last_seq": str(4 * i + 3).encode()})
    whole = path.read_bytes()
    path.write_bytes(whole[:-8] + whole[-8:-3])  # the end marker cut short, as a crash would
    assert [b.last_seq for b in wal.read_segment(path).batches] == [3, 7]
    assert scalar(store, "SELECT count(*) FROM events") == 8
    with store.writer("old-w") as writer:  # recovery cuts the tail and seals the old segment
        assert writer.append(rollout("c")).first_seq == 8
    assert scalar(store, "SELECT count(DISTINCT rollout_id) FROM rollouts") == 3
