"""Write-ahead segments: one writer's events in the Arrow IPC *stream* format, checksummed and framed.

A segment is a valid Arrow IPC stream: the event schema, then one record batch message per
append, then (once closed) the end-of-stream marker. A stream stays readable when a crash
truncates it (an IPC *file* would need its footer). Arrow has no checksums, so each batch's
custom metadata carries trajstore's (format 2, written since issue 12):

- `trajstore.body_crc32`: CRC-32 of the message body, the exact bytes the reader decodes;
- `trajstore.meta_len`: the length of the message's metadata (the flatbuffer), as written;
- `trajstore.frame_crc32`: CRC-32 of the message's framing, i.e. its 8-byte prefix (the
  continuation marker and the metadata length) and the whole flatbuffer (buffer layout,
  lengths, null counts, body length, every custom metadata value), computed with this
  field's own 8 characters as zeros. The writer serializes the message once with fixed-width
  placeholders and patches the values in, so the header covers itself;
- the writer's name, epoch, first and last seq.

Telling a torn write from damage. The writer fsyncs after every append, so everything but
the message a crash interrupted is whole and acknowledged; a torn write only ever cuts the
newest message short. The reader walks the messages:

- a frame that verifies, with a body cut short by the end of the file: torn (the body length
  was checked by the frame CRC, so the body really is incomplete);
- a whole frame or body that fails its CRC: damage, reported, never cut;
- a message whose prefix does not fit the file (or has no continuation marker): its
  flatbuffer is parsed anyway from the bytes that are there; if it names its own metadata
  length and its frame CRC verifies with that length, the message is whole and only its
  prefix is damaged: damage. Otherwise the message was cut short: torn;
- bytes after the end-of-stream marker, or any whole message after a torn one: damage.

So a flipped bit is never taken for a torn tail, and recovery (which cuts torn tails) never
deletes an acknowledged batch. Segments of format 1 (before issue 12: body CRC, plus a CRC of
the re-serialized batch, no framing CRC) are still read and recovered; for them a damaged
prefix of the newest batch still looks torn, which is why format 2 exists.

A segment is written by one writer epoch only; a reopened writer starts a new segment.
Segment names sort in append order: `{epoch:08d}-{first_seq:016d}.arrows`. Readers that
keep a `SegmentRead` pass it back to read only what was appended since (`previous=`).
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from trajstore.durable import SYNCHRONOUS_WRITES, create_synchronous, fsync_path, sync_file
from trajstore.errors import CorruptionError
from trajstore.schema import EVENT_SCHEMA

SUFFIX = ".arrows"
FORMAT = b"2"
_META_FORMAT = b"trajstore.format"
_META_BODY_CRC = b"trajstore.body_crc32"
_META_META_LEN = b"trajstore.meta_len"
_META_FRAME_CRC = b"trajstore.frame_crc32"
_META_WRITER = b"trajstore.writer"
_META_EPOCH = b"trajstore.epoch"
_META_FIRST = b"trajstore.first_seq"
_META_LAST = b"trajstore.last_seq"
_META_CRC_V1 = b"trajstore.crc32"  # format 1: body CRC
_META_MSG_CRC_V1 = b"trajstore.msg_crc32"  # format 1: CRC of the re-serialized batch
# fixed-width placeholders, patched in after serializing (they cannot occur in other metadata)
_HOLD_BODY, _HOLD_LEN, _HOLD_FRAME = b"@@bodyc@", b"@@metalen@", b"@@frame@"
_CONTINUATION = b"\xff\xff\xff\xff"
_EOS = _CONTINUATION + b"\x00\x00\x00\x00"
SCHEMA_MESSAGE = EVENT_SCHEMA.serialize().to_pybytes()
# Given once: without options pyarrow reads two environment variables for every stream it opens.
_IPC_OPTIONS = pa.ipc.IpcWriteOptions()
_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 16  # buffers one writev takes


def segment_name(epoch: int, first_seq: int) -> str:
    return f"{epoch:08d}-{first_seq:016d}{SUFFIX}"


def parse_segment_name(name: str) -> tuple[int, int]:
    stem = name[: -len(SUFFIX)]
    epoch, first = stem.split("-")
    return int(epoch), int(first)


def _frame_crc(head: bytes | bytearray, frame_at: int) -> int:
    """CRC-32 of a message's prefix and flatbuffer (`head`), with the frame CRC's own 8 characters
    (at `frame_at`) taken as zeros."""
    view = memoryview(head)
    return zlib.crc32(view[frame_at + 8:], zlib.crc32(b"00000000", zlib.crc32(view[:frame_at])))


Message = tuple[bytes, memoryview]  # one batch's message: its head and its body (`encode_batch`)


def encode_batch(batch: pa.RecordBatch, *, writer: str, epoch: int, first_seq: int, last_seq: int) -> Message:
    """One record batch message with its checksums and framing (see the module docstring), as its head (the
    prefix and the flatbuffer, patched) and its body, a view of Arrow's buffer: written one after the other,
    the body is copied once, into the file (a 300 kB chat request is worth not copying four more times)."""
    meta = {_META_FORMAT: FORMAT, _META_WRITER: writer.encode(), _META_EPOCH: str(epoch).encode(),
            _META_FIRST: str(first_seq).encode(), _META_LAST: str(last_seq).encode(),
            _META_BODY_CRC: _HOLD_BODY, _META_META_LEN: _HOLD_LEN, _META_FRAME_CRC: _HOLD_FRAME}
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, EVENT_SCHEMA, options=_IPC_OPTIONS) as stream:  # writes the schema, then the batch
        stream.write_batch(batch, custom_metadata=meta)
        end = sink.tell()
    message = memoryview(sink.getvalue())[len(SCHEMA_MESSAGE):end]
    meta_len = struct.unpack_from("<i", message, 4)[0]
    head, body = bytearray(message[: 8 + meta_len]), message[8 + meta_len:]
    body_at, len_at, frame_at = head.find(_HOLD_BODY), head.find(_HOLD_LEN), head.find(_HOLD_FRAME)
    head[body_at:body_at + 8] = b"%08x" % zlib.crc32(body)
    head[len_at:len_at + 10] = b"%010d" % meta_len
    head[frame_at:frame_at + 8] = b"%08x" % _frame_crc(head, frame_at)
    return bytes(head), body


class SegmentWriter:
    """Appends checksummed batches to one new segment file; `sync` makes them durable."""

    def __init__(self, path: Path, *, writer: str, epoch: int) -> None:
        self.path = path
        self.writer = writer
        self.epoch = epoch
        # unbuffered, each write one system call that returns once its bytes are on disk: nothing is copied first,
        # and a writing thread takes the GIL back once per write instead of after a write and again after an
        # fsync. Never reuse a segment: a new epoch gets a new file
        self._file = create_synchronous(path)
        fsync_path(path.parent)
        self.bytes_written = 0
        self._write([SCHEMA_MESSAGE])

    def write(self, batch: pa.RecordBatch, first_seq: int, last_seq: int) -> None:
        self.write_messages([encode_batch(batch, writer=self.writer, epoch=self.epoch, first_seq=first_seq,
                                          last_seq=last_seq)])

    def write_messages(self, messages: list[Message]) -> None:
        """Write messages `encode_batch` made (with this segment's writer and epoch), in order."""
        self._write([part for message in messages for part in message])

    def _write(self, parts: list[bytes | memoryview]) -> None:
        fd, at = self._file.fileno(), 0
        while at < len(parts):  # one system call for them all, unless the kernel takes less: then on from there
            written = os.writev(fd, parts[at:at + _IOV_MAX])
            self.bytes_written += written
            while at < len(parts) and written >= len(parts[at]):
                written -= len(parts[at])
                at += 1
            if written:
                parts[at] = memoryview(parts[at])[written:]

    def sync(self) -> None:
        """Make what was written durable: already done by each write where the system has O_DSYNC."""
        if not SYNCHRONOUS_WRITES:
            sync_file(self._file)

    def close(self) -> None:
        if not self._file.closed:
            self._write([_EOS])
            self.sync()
            self._file.close()

    def abandon(self, keep_bytes: int) -> None:
        """After a failed write or sync: cut what was not acknowledged (best effort: the disk may refuse even
        that) and close without the end-of-stream marker, so no reader or recovery takes a refused batch for
        a stored one."""
        try:
            self._file.truncate(keep_bytes)
            sync_file(self._file)  # a truncation is no write: O_DSYNC does not cover it
        except OSError:
            pass
        finally:
            try:
                self._file.close()
            except OSError:  # its buffer could not be flushed: those bytes were refused anyway
                pass


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
    closed: bool = False  # ends with the end-of-stream marker
    schema: pa.Schema = EVENT_SCHEMA  # what its batches were written with: ours, or an older version's columns

    @property
    def last_seq(self) -> int | None:
        return self.batches[-1].last_seq if self.batches else None


# ---------------------------------------------------------------------------- the flatbuffer


def _flat_meta(buf: bytes, start: int, end: int) -> tuple[int, dict[bytes, tuple[int, bytes]]] | None:
    """(body length, {key: (offset of the value in `buf`, value)}) of the Arrow `Message` flatbuffer
    at buf[start:end], reading only what lies inside those bounds; None when it does not parse.

    A few lines of the flatbuffers wire format (little-endian offsets, a vtable per table) for
    the two fields needed: `bodyLength` (field 3) and `custom_metadata` (field 4, a vector of
    KeyValue tables of two strings). pyarrow parses a message only together with its whole body,
    and these fields are needed exactly when the body may be cut short or the prefix damaged.
    """
    def u32(at: int) -> int:
        if not start <= at <= end - 4:
            raise ValueError
        return struct.unpack_from("<I", buf, at)[0]

    def field_at(table: int, index: int) -> int | None:
        vtable = table - struct.unpack("<i", struct.pack("<I", u32(table)))[0]
        if not start <= vtable <= end - 4:
            raise ValueError
        vt_size = struct.unpack_from("<H", buf, vtable)[0]
        if 4 + 2 * index + 2 > vt_size or vtable + 4 + 2 * index + 2 > end:
            return None
        offset = struct.unpack_from("<H", buf, vtable + 4 + 2 * index)[0]
        return table + offset if offset else None

    def string(at: int) -> tuple[int, bytes]:
        pos = at + u32(at)
        n = u32(pos)
        if pos + 4 + n > end:
            raise ValueError
        return pos + 4, bytes(buf[pos + 4:pos + 4 + n])

    try:
        table = start + u32(start)
        body_at = field_at(table, 3)
        body_length = 0
        if body_at is not None:
            if body_at + 8 > end:
                return None
            body_length = struct.unpack_from("<q", buf, body_at)[0]
        meta: dict[bytes, tuple[int, bytes]] = {}
        vec_field = field_at(table, 4)
        if vec_field is not None:
            vec = vec_field + u32(vec_field)
            for i in range(u32(vec)):
                element = vec + 4 + 4 * i
                kv = element + u32(element)
                key_field, value_field = field_at(kv, 0), field_at(kv, 1)
                if key_field is None or value_field is None:
                    continue
                meta[string(key_field)[1]] = string(value_field)
        return body_length, meta
    except (ValueError, struct.error):
        return None


# ---------------------------------------------------------------------------- reading


class _Walk:
    """Walks one segment's messages from `pos`, appending verified batches to `read`."""

    def __init__(self, data: bytes, base: int, read: SegmentRead) -> None:
        self.data, self.base, self.read = data, base, read  # data[0] is byte `base` of the file
        self.buffer = pa.py_buffer(data)  # batches are zero-copy slices of the bytes read
        self.where = str(read.path)

    def damage(self, at: int, what: str) -> CorruptionError:
        return CorruptionError(f"{self.where}: {what} (at byte {self.base + at}): its bytes changed after they were "
                               "written, and it is not a torn write. The batches before it are intact; restore the "
                               "file from a copy, or move it out of the writer's directory to go on without its "
                               "events (they are then lost). `trajstore verify` lists every damaged segment")

    def run(self, pos: int) -> None:
        data, read = self.data, self.read
        while True:
            left = len(data) - pos
            if left == 0:
                return
            if data[pos:pos + 8] == _EOS:
                if left > 8:
                    raise self.damage(pos + 8, f"{left - 8} bytes after the end-of-stream marker")
                read.closed = True
                return
            whole = self.message(pos)
            if whole is None:  # cut short: what a crash leaves, or a writer still writing
                if self.whole_message_after(pos + 8):
                    raise self.damage(pos, "a batch is unreadable but whole batches follow it")
                read.torn = True
                return
            pos = whole
            read.good_bytes = self.base + pos

    def message(self, pos: int) -> int | None:
        """Verify the message at `pos` and keep its batch; returns where it ends, None if it is cut short."""
        data = self.data
        end = len(data)
        if end - pos < 8:
            return None
        (meta_len,) = struct.unpack_from("<i", data, pos + 4)
        if data[pos:pos + 4] != _CONTINUATION or meta_len <= 0 or meta_len % 8 or pos + 8 + meta_len > end:
            self.check_prefix(pos)  # raises when a whole message with a damaged prefix is there
            return None
        parsed = _flat_meta(data, pos + 8, pos + 8 + meta_len)
        if parsed is None:
            raise self.damage(pos, "the metadata of a batch does not parse")
        body_len, meta = parsed
        if _META_FRAME_CRC in meta:
            return self.message_v2(pos, meta_len, body_len, meta)
        return self.message_v1(pos, meta_len, body_len, meta)

    def check_prefix(self, pos: int) -> None:
        """The prefix at `pos` does not fit: damage if the message behind it is whole and its framing
        verifies with the metadata length it records (format 2)."""
        parsed = _flat_meta(self.data, pos + 8, len(self.data))
        if parsed is None or _META_META_LEN not in parsed[1] or _META_FRAME_CRC not in parsed[1]:
            return
        meta = parsed[1]
        try:
            meta_len = int(meta[_META_META_LEN][1])
        except ValueError:
            return
        if not 0 < meta_len <= len(self.data) - pos - 8:
            return
        head = _CONTINUATION + struct.pack("<i", meta_len) + self.data[pos + 8:pos + 8 + meta_len]
        if _frame_crc(head, meta[_META_FRAME_CRC][0] - pos) == _hex(meta[_META_FRAME_CRC][1]):
            raise self.damage(pos, "the length prefix of a whole batch is damaged")

    def message_v2(self, pos: int, meta_len: int, body_len: int, meta: dict[bytes, tuple[int, bytes]]) -> int | None:
        data = self.data
        head = data[pos:pos + 8 + meta_len]
        if _frame_crc(head, meta[_META_FRAME_CRC][0] - pos) != _hex(meta[_META_FRAME_CRC][1]):
            raise self.damage(pos, "a batch's framing (its length prefix and metadata) fails its CRC-32")
        body_at = pos + 8 + meta_len
        if body_at + body_len > len(data):
            return None  # the framing is whole and verified: the body really is cut short
        if zlib.crc32(memoryview(data)[body_at:body_at + body_len]) != _hex(meta[_META_BODY_CRC][1]):
            raise self.damage(pos, "a batch's body fails its CRC-32")
        self.keep(pos, body_at + body_len, meta)
        return body_at + body_len

    def message_v1(self, pos: int, meta_len: int, body_len: int, meta: dict[bytes, tuple[int, bytes]]) -> int | None:
        data = self.data
        body_at = pos + 8 + meta_len
        if body_at + body_len > len(data):
            return None
        if _META_CRC_V1 not in meta:
            raise self.damage(pos, "a batch has no trajstore checksum; the file was not written by trajstore")
        if zlib.crc32(memoryview(data)[body_at:body_at + body_len]) != int(meta[_META_CRC_V1][1]):
            raise self.damage(pos, "a batch's body fails its CRC-32")
        batch = self.keep(pos, body_at + body_len, meta)
        if _META_MSG_CRC_V1 in meta and int(meta[_META_MSG_CRC_V1][1]) != zlib.crc32(batch.serialize()):
            self.read.batches.pop()
            raise self.damage(pos, "a batch's header fails its CRC-32")
        return body_at + body_len

    def keep(self, pos: int, end: int, meta: dict[bytes, tuple[int, bytes]]) -> pa.RecordBatch:
        """Decode a verified message and check its place in the writer's sequence."""
        try:
            message = pa.ipc.read_message(pa.BufferReader(self.buffer.slice(pos, end - pos)))
            batch = pa.ipc.read_record_batch(message, self.read.schema)
            batch.validate(full=True)
            first, last = int(meta[_META_FIRST][1]), int(meta[_META_LAST][1])
            writer, epoch = meta[_META_WRITER][1].decode(), int(meta[_META_EPOCH][1])
        except (pa.ArrowException, ValueError, KeyError, UnicodeDecodeError) as exc:
            raise self.damage(pos, f"a batch whose checksums match cannot be decoded ({exc})") from exc
        previous = self.read.batches[-1].last_seq if self.read.batches else None
        if last - first + 1 != batch.num_rows or (previous is not None and first != previous + 1):
            raise self.damage(pos, f"a batch breaks the writer's sequence (seq {first}..{last}, {batch.num_rows} rows)")
        self.read.batches.append(Batch(_widen(batch), writer, epoch, first, last))
        return batch  # as written: format 1 checks the CRC of its serialization

    def whole_message_after(self, start: int) -> bool:
        """Whether a whole, verifiable batch starts anywhere after `start` (a torn tail has none)."""
        data = self.data
        pos = data.find(_CONTINUATION, start)
        while pos != -1:
            (meta_len,) = struct.unpack_from("<i", data, pos + 4) if pos + 8 <= len(data) else (0,)
            if 0 < meta_len and meta_len % 8 == 0 and pos + 8 + meta_len <= len(data):
                parsed = _flat_meta(data, pos + 8, pos + 8 + meta_len)
                if parsed is not None and (_META_FRAME_CRC in parsed[1] or _META_CRC_V1 in parsed[1]):
                    meta = parsed[1]
                    if _META_FRAME_CRC not in meta or _frame_crc(
                            data[pos:pos + 8 + meta_len], meta[_META_FRAME_CRC][0] - pos) == \
                            _hex(meta[_META_FRAME_CRC][1]):
                        return True
            pos = data.find(_CONTINUATION, pos + 1)
        return False


def _hex(value: bytes) -> int:
    """A CRC as the writer spells it (8 lowercase hex digits); -1 for anything else."""
    return int(value, 16) if len(value) == 8 and all(c in b"0123456789abcdef" for c in value) else -1


def read_segment(path: Path, previous: SegmentRead | None = None) -> SegmentRead:
    """Read and verify a segment; with `previous` (an earlier read of the same, still growing file),
    read only the bytes appended since.

    A message cut short by the end of the file is a torn tail (`torn=True`, not an error): it is
    what a crash, or a writer still writing, leaves. Damage raises CorruptionError (see the
    module docstring), so damaged bytes are never returned as events nor cut as a torn tail.
    """
    if previous is not None and previous.good_bytes >= len(SCHEMA_MESSAGE) and not previous.closed:
        with open(path, "rb") as f:
            f.seek(previous.good_bytes)
            data = f.read()
        read = SegmentRead(path=path, batches=list(previous.batches), good_bytes=previous.good_bytes,
                           total_bytes=previous.good_bytes + len(data), schema=previous.schema)
        _Walk(data, previous.good_bytes, read).run(0)
        return read
    data = path.read_bytes()
    read = SegmentRead(path=path, total_bytes=len(data))
    walk = _Walk(data, 0, read)
    n = len(SCHEMA_MESSAGE)
    if data[:n] != SCHEMA_MESSAGE:
        if SCHEMA_MESSAGE.startswith(data) or not any(data):  # cut (or zero-filled) right after creation
            read.torn = len(data) > 0
            return read
        older = _older_schema(data)
        if older is not None:  # written before the newest columns were appended to the schema
            read.schema = older
        elif not _schema_equal(data):  # format 1 segments carry another pyarrow's bytes for the same schema
            if walk.whole_message_after(1):
                raise walk.damage(0, "the schema message is damaged but whole batches follow it")
            read.torn = True  # nothing whole after it: no acknowledged batch is lost by cutting it
            return read
        n = _schema_end(data)
    read.good_bytes = n
    walk.run(n)
    return read


def _schema_end(data: bytes) -> int:
    reader = pa.BufferReader(data)
    pa.ipc.read_message(reader)
    return reader.tell()


def _schema_equal(data: bytes) -> bool:
    """For segments whose schema message is not byte-identical to ours (another pyarrow wrote it)."""
    try:
        message = pa.ipc.read_message(pa.BufferReader(data))
        return message.type == "schema" and pa.ipc.read_schema(message).equals(EVENT_SCHEMA)
    except (pa.ArrowException, OSError, EOFError, ValueError):
        return False


def _older_schema(data: bytes) -> pa.Schema | None:
    """The segment's schema when it is an older version of ours: our first columns, exactly, and
    fewer of them (columns are only ever appended to the schema, nullable)."""
    try:
        message = pa.ipc.read_message(pa.BufferReader(data))
        if message.type != "schema":
            return None
        schema = pa.ipc.read_schema(message)
    except (pa.ArrowException, OSError, EOFError, ValueError):
        return None
    n = len(schema)
    if not 0 < n < len(EVENT_SCHEMA) or any(not schema.field(i).equals(EVENT_SCHEMA.field(i)) for i in range(n)):
        return None
    return schema


def _widen(batch: pa.RecordBatch) -> pa.RecordBatch:
    """A batch of an older schema with the columns appended since, all null."""
    if batch.schema.equals(EVENT_SCHEMA):
        return batch
    extra = [pa.nulls(batch.num_rows, f.type) for f in list(EVENT_SCHEMA)[batch.num_columns:]]
    return pa.RecordBatch.from_arrays(batch.columns + extra, schema=EVENT_SCHEMA)


def truncate_torn_tail(read: SegmentRead) -> None:
    """Cut a torn tail at the last whole batch, so the next reader sees a clean segment."""
    if read.torn:
        with open(read.path, "r+b") as f:
            f.truncate(read.good_bytes)
            sync_file(f)


def list_segments(directory: Path) -> list[Path]:
    """The writer's segments in append order."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.name.endswith(SUFFIX))
