"""Write-ahead segments: one writer's events in the Arrow IPC *stream* format, checksummed.

Each appended batch carries, in its custom metadata, the CRC-32 of its IPC body, the CRC-32
of the whole serialized batch (header and body), and the writer's (name, epoch, first_seq,
last_seq). A stream format file stays readable when a crash truncates it (an IPC *file*
would need its footer), so recovery reads messages up to the last whole, checksummed batch
and cuts the rest. Arrow has no checksums of its own, hence the CRCs: the body CRC is over
the exact body bytes the reader will see (`RecordBatch.serialize()` yields the same body
`write_batch` writes); the header holding the CRCs cannot cover itself, so the second CRC
is checked by re-serializing what was decoded, which catches a damaged header (a flipped
null count or buffer length) that would decode an intact body into other values. A whole
message that cannot be decoded is corruption; only a message cut short by the end of the
file is a torn tail.

A segment is written by one writer epoch only; a reopened writer starts a new segment.
Segment names sort in append order: `{epoch:08d}-{first_seq:016d}.arrows`.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from trajstore.durable import fsync_path
from trajstore.errors import CorruptionError
from trajstore.schema import EVENT_SCHEMA

SUFFIX = ".arrows"
_META_CRC = b"trajstore.crc32"
_META_WRITER = b"trajstore.writer"
_META_EPOCH = b"trajstore.epoch"
_META_FIRST = b"trajstore.first_seq"
_META_LAST = b"trajstore.last_seq"
_META_MSG_CRC = b"trajstore.msg_crc32"


def segment_name(epoch: int, first_seq: int) -> str:
    return f"{epoch:08d}-{first_seq:016d}{SUFFIX}"


def parse_segment_name(name: str) -> tuple[int, int]:
    stem = name[: -len(SUFFIX)]
    epoch, first = stem.split("-")
    return int(epoch), int(first)


def message_crc(batch: pa.RecordBatch) -> int:
    """CRC-32 of the whole serialized batch: header (lengths, null counts, buffer layout) and body."""
    return zlib.crc32(batch.serialize())


class SegmentWriter:
    """Appends checksummed batches to one new segment file; `sync` makes them durable."""

    def __init__(self, path: Path, *, writer: str, epoch: int) -> None:
        self.path = path
        self.writer = writer
        self.epoch = epoch
        self._file = open(path, "xb")  # never reuse a segment: a new epoch gets a new file
        fsync_path(path.parent)
        self._stream = pa.ipc.new_stream(self._file, EVENT_SCHEMA)
        self.bytes_written = 0

    def write(self, batch: pa.RecordBatch, first_seq: int, last_seq: int) -> None:
        message = batch.serialize()
        meta = {
            _META_CRC: str(zlib.crc32(pa.ipc.read_message(message).body)).encode(),
            _META_MSG_CRC: str(zlib.crc32(message)).encode(),
            _META_WRITER: self.writer.encode(),
            _META_EPOCH: str(self.epoch).encode(),
            _META_FIRST: str(first_seq).encode(),
            _META_LAST: str(last_seq).encode(),
        }
        self._stream.write_batch(batch, custom_metadata=meta)
        self.bytes_written = self._file.tell()

    def sync(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if not self._file.closed:
            self._stream.close()  # writes the end-of-stream marker
            self.sync()
            self._file.close()


@dataclass
class Batch:
    """One verified batch of a segment."""

    data: pa.RecordBatch
    writer: str
    epoch: int
    first_seq: int
    last_seq: int


@dataclass
class SegmentRead:
    """What a segment holds: its verified batches and where the whole, good bytes end."""

    path: Path
    batches: list[Batch] = field(default_factory=list)
    good_bytes: int = 0
    total_bytes: int = 0
    torn: bool = False  # bytes after the last whole batch (a crash mid-write, or a live writer)

    @property
    def last_seq(self) -> int | None:
        return self.batches[-1].last_seq if self.batches else None


_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"


def _scan(data: bytes, path: Path) -> tuple[int | None, list[int], list[int]]:
    """Walk the IPC messages: (end of the schema message, end of each whole batch, body CRCs)."""
    reader = pa.BufferReader(data)
    schema_end: int | None = None
    ends: list[int] = []
    crcs: list[int] = []
    try:
        msg = pa.ipc.read_message(reader)
        if msg.type != "schema":
            raise CorruptionError(f"{path}: the segment does not start with an Arrow schema message")
        schema_end = reader.tell()
        while True:
            msg = pa.ipc.read_message(reader)
            if msg.type != "record batch":
                raise CorruptionError(f"{path}: unexpected Arrow {msg.type} message before byte {reader.tell()}")
            ends.append(reader.tell())
            crcs.append(zlib.crc32(msg.body) if msg.body is not None else 0)
    except (EOFError, OSError, pa.ArrowInvalid):
        pass  # end of stream, or a message cut short: whatever follows the last whole one is the tail
    return schema_end, ends, crcs


def _whole_message_after(data: bytes, start: int) -> bool:
    """Whether a whole record batch message starts anywhere after `start` (a torn tail has none)."""
    pos = data.find(b"\xff\xff\xff\xff", start)
    while pos != -1:
        try:
            if pa.ipc.read_message(pa.BufferReader(data[pos:])).type == "record batch":
                return True
        except (EOFError, OSError, pa.ArrowInvalid):
            pass
        pos = data.find(b"\xff\xff\xff\xff", pos + 1)
    return False


def read_segment(path: Path) -> SegmentRead:
    """Read and verify a segment.

    A message cut short by the end of the file is a torn tail (`torn=True`, not an error):
    it is what a crash, or a writer still writing, leaves. A whole batch whose checksum or
    writer metadata is wrong is corruption and raises CorruptionError, so damaged bytes are
    never returned as events.
    """
    data = path.read_bytes()
    result = SegmentRead(path=path, total_bytes=len(data))
    schema_end, ends, crcs = _scan(data, path)
    if schema_end is None:
        result.torn = len(data) > 0
        if result.torn and _whole_message_after(data, 1):
            raise CorruptionError(
                f"{path}: the schema message at byte 0 is damaged but whole batches follow it; "
                "this is corruption, not a torn write (run `trajstore verify` for the full report)"
            )
        return result
    result.good_bytes = ends[-1] if ends else schema_end
    result.torn = data[result.good_bytes:] not in (b"", _EOS)
    if result.torn and _whole_message_after(data, result.good_bytes + 8):
        raise CorruptionError(
            f"{path}: the message at byte {result.good_bytes} is damaged but whole batches follow it; "
            "this is corruption, not a torn write (run `trajstore verify` for the full report)"
        )
    if not ends:
        return result
    where = f"{path}: the schema message"
    try:
        stream = pa.ipc.open_stream(pa.BufferReader(data[: result.good_bytes]))
        if not stream.schema.equals(EVENT_SCHEMA):
            raise CorruptionError(f"{where} does not match the event schema: it is damaged, or the "
                                  "segment was not written by this version of trajstore")
        expected_first = None
        for i, end in enumerate(ends):
            where = f"{path}: batch {i} (ending at byte {end})"
            batch, meta = stream.read_next_batch_with_custom_metadata()
            if meta is None or _META_CRC not in meta:
                raise CorruptionError(f"{where} has no trajstore checksum; the file was not written by trajstore")
            if int(meta[_META_CRC]) != crcs[i]:
                raise CorruptionError(f"{where} fails its CRC-32 check: its bytes changed after they were written")
            if _META_MSG_CRC in meta and int(meta[_META_MSG_CRC]) != message_crc(batch):
                raise CorruptionError(f"{where} fails its header CRC-32 check: its bytes changed after they were written")
            first, last = int(meta[_META_FIRST]), int(meta[_META_LAST])
            if last - first + 1 != batch.num_rows or (expected_first is not None and first != expected_first):
                raise CorruptionError(f"{where} breaks the writer's sequence (seq {first}..{last}, {batch.num_rows} rows)")
            expected_first = last + 1
            result.batches.append(Batch(batch, meta[_META_WRITER].decode(), int(meta[_META_EPOCH]), first, last))
    except (pa.ArrowException, ValueError, KeyError, OSError) as exc:
        # _scan found these messages whole, so failing to decode them is damage, not a torn write.
        raise CorruptionError(f"{where} cannot be decoded ({exc}): its bytes changed after they were written") from exc
    return result


def truncate_torn_tail(read: SegmentRead) -> None:
    """Cut a torn tail at the last whole batch, so the next reader sees a clean segment."""
    if read.torn:
        with open(read.path, "r+b") as f:
            f.truncate(read.good_bytes)
            f.flush()
            os.fsync(f.fileno())


def list_segments(directory: Path) -> list[Path]:
    """The writer's segments in append order."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.name.endswith(SUFFIX))
