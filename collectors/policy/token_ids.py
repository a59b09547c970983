"""Token ids kept beside their JSON: a long session's prompt is sent without being encoded again on every call.

A policy server is sent the whole prompt on every call (vLLM and the embedded server both take
plain JSON token ids), and an agent's session grows by a few thousand tokens a call on top of
tens of thousands already sent. `TokenLog` is a session's ids, append-only, with their JSON text
grown as it is needed: the first time a view's JSON is asked for, only the ids added since the
last time are encoded. `TokenLog.view(delta)` is the next prompt, the log as it is now plus the
new ids, as a read-only `TokenIds`: its JSON (`json()`) is the log's text up to that point,
copied, and the encoding of the delta alone, byte for byte what `orjson.dumps(list(ids))` writes.
A view stays valid while the log grows (it remembers its length), so a `Sample` may hold it as
its `prompt_ids`. A session whose server holds its ids (below) is sent only the ids after them,
packed, so its log never encodes JSON at all.

The policy clients (`collectors.policy.http`) take a `TokenIds` wherever they take a list and
write its JSON into the request body as it is (`orjson.Fragment`), whatever field holds it.

A view's ids past the log are encoded once (`TokenIds.tail_json`): extending the log by a view of
it (the ids of a stored call) may take that JSON (`TokenLog.extend`'s `encoded`), not encode them again.

Long lists are handled `SLICE` ids at a time (encoded, copied, packed), each slice one short call: a
single call over millions of ids would hold the GIL for tens of milliseconds (a server's event
loop and every other thread stopped meanwhile); between slices the interpreter may switch threads.
The result is the same bytes and lists as one call gives.

A log keeps its ids as one int32 array (`array('i')`): 4 bytes an id, where a list of Python ints
takes ~40 and hands the garbage collector an object per id to visit on every full collection
(32 sessions at 80k tokens: 2.75 million). Its bytes are the packed form below as they are (on a
little-endian machine; a big-endian one swaps a copy), and a call's ids that were packed to be
sent are appended as those bytes.

The embedded server also takes a prompt as base64 of little-endian int32 ids
(`prompt_token_ids_b64`, `PackedIds`), which it decodes and checks in bulk instead of parsing
and checking tens of thousands of JSON numbers per call. The log keeps the base64 of its whole
3-byte groups, grown lazily, the first time a view of it is packed (`PackedIds`), by the ids
added since (base64 of a concatenation is the concatenation of the pieces' base64 only at 3-byte
boundaries); the 0 to 2 bytes after the last whole group are encoded with the view's own ids. A
call costs O(new ids) plus one copy.

The embedded server can also hold a session's ids itself (`session_key`, `prompt_prefix`: the
next call names the held ids by their count and crc32 and sends only the ids after them). A log
is such a session: it has a random `key`, its identity on the server, and keeps the crc32 of its
int32 bytes as they grow (`crc32`), so naming a view's log part costs O(new ids) too.
"""

from __future__ import annotations

import base64
import secrets
import struct
import sys
import threading
import zlib
from array import array
from collections.abc import Iterator, Sequence
from itertools import chain, islice
from typing import Any, overload

import orjson

SLICE = 1 << 16  # ids per call over a long list (about a millisecond of work each)
_LITTLE = sys.byteorder == "little"  # an int32 array's bytes are the packed form as they are
if array("i").itemsize != 4:
    raise ImportError("collectors.policy.token_ids needs a 4-byte C int for its int32 arrays")


def _swapped(data: bytes) -> bytes:
    """Little-endian int32 bytes as this (big-endian) machine's own."""
    ids = array("i", data)
    ids.byteswap()
    return ids.tobytes()


def ids_json(ids: Sequence[int]) -> bytes:
    """`orjson.dumps` of token ids (a list of Python ints; anything else is converted id by id first), a slice at
    a time when long (module docstring)."""
    ids = ids if type(ids) is list else [int(t) for t in ids]
    if len(ids) <= SLICE:
        return orjson.dumps(ids)
    out = bytearray(b"[")
    _encode_into(out, ids)
    out += b"]"
    return bytes(out)


def _encode_into(out: bytearray, ids: list[int]) -> None:
    """Append the JSON of `ids` without its brackets to `out`, a slice at a time (`ids` not empty)."""
    for start in range(0, len(ids), SLICE):
        if start:
            out += b","
        out += memoryview(orjson.dumps(ids[start:start + SLICE]))[1:-1]


def copied(ids: Sequence[int]) -> list[int]:
    """`list(ids)`, a slice at a time when long (module docstring)."""
    if len(ids) <= SLICE:
        return list(ids)
    out: list[int] = []
    _copy_into(out, ids, 0, len(ids))
    return out


def _copy_into(out: list[int], ids: Sequence[int], start: int, stop: int) -> None:
    """Append `ids[start:stop]` to `out`, a slice at a time."""
    if not start and stop == len(ids) <= SLICE:  # a short list whole: no slice copied first
        out += ids
        return
    for at in range(start, stop, SLICE):
        out += ids[at:min(at + SLICE, stop)]


def listed(ids: Any) -> list[int]:
    """An array of ids (numpy's, or `array.array`) as a list of Python ints, made a slice at a time: one `tolist`
    of millions of ids holds the GIL for tens of milliseconds."""
    out: list[int] = []
    for at in range(0, len(ids), SLICE):
        out += ids[at:at + SLICE].tolist()
    return out


def ids_int32(ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int32 bytes, a slice at a time when long; OverflowError for an id outside int32
    (no model has one). `struct` packs a list of ints in a third less time than numpy's conversion of it."""
    if type(ids) is array and ids.typecode == "i":  # a log's own ids: their bytes
        return ids.tobytes() if _LITTLE else _swapped(ids.tobytes())
    ids = ids if type(ids) is list else [int(t) for t in ids]
    try:
        if len(ids) <= SLICE:
            return struct.pack(f"<{len(ids)}i", *ids)
        return b"".join(struct.pack(f"<{len(part)}i", *part)
                        for part in (ids[at:at + SLICE] for at in range(0, len(ids), SLICE)))
    except struct.error as exc:
        raise OverflowError(f"token ids must be integers within int32: {exc}") from None


_B64_BLOCK = 3 * SLICE  # bytes base64-encoded per call (a multiple of 3: the pieces' base64 joins as the whole's)


def b64(data: bytes | bytearray | memoryview) -> bytes:
    """`base64.b64encode(data)`, a block at a time when long (module docstring)."""
    if len(data) <= _B64_BLOCK:
        return base64.b64encode(data)
    with memoryview(data) as view:
        return b"".join(base64.b64encode(view[at:at + _B64_BLOCK]) for at in range(0, len(view), _B64_BLOCK))


PACKED_FIELD = "prompt_token_ids_b64"  # the embedded server's request field for packed ids
# the embedded server's fields for a prompt that starts with ids it holds (module docstring), and its 409's code
PREFIX_FIELD, SESSION_KEY_FIELD, PREFIX_NOT_CACHED = "prompt_prefix", "session_key", "prefix_not_cached"


class PackedIds:
    """Token ids as the embedded server's `prompt_token_ids_b64`: base64 of their little-endian int32 bytes.

    Packed when first written (`quoted()`, the JSON string with its quotes), not when made: a request body
    holding it is encoded on a thread when much is left to pack (`pending`), as one with a long JSON prompt is.
    A `TokenIds` is packed from its log's kept form, encoding only what the log has not packed yet; with
    `tail_only`, its tail alone (`TokenIds.packed_tail`: kept on the view, for the log to take when it grows by
    the tail)."""

    __slots__ = ("_ids", "_quoted", "_tail_only")

    def __init__(self, ids: Sequence[int], *, tail_only: bool = False) -> None:
        self._ids, self._quoted, self._tail_only = ids, b"", tail_only and isinstance(ids, TokenIds)

    def __len__(self) -> int:
        return len(self._ids.tail) if self._tail_only else len(self._ids)  # type: ignore[attr-defined]

    @property
    def pending(self) -> int:
        """How many ids packing still encodes."""
        ids = self._ids
        if self._quoted:
            return 0
        return len(self) if self._tail_only or not isinstance(ids, TokenIds) else ids.unpacked()

    def quoted(self) -> bytes:
        """The base64 as a JSON string; ValueError for an id outside int32 (no model has such a token)."""
        if not self._quoted:
            ids = self._ids
            try:
                if self._tail_only:
                    self._quoted = ids.packed_tail()  # type: ignore[attr-defined]
                elif isinstance(ids, TokenIds):
                    self._quoted = ids.packed()
                else:
                    self._quoted = b"".join((b'"', b64(ids_int32(ids)), b'"'))
            except OverflowError:
                raise ValueError(f"prompt token ids {min(ids)}..{max(ids)} do not all fit int32: no model has "
                                 "such tokens") from None
        return self._quoted

    def text(self) -> str:
        """The base64 text."""
        return self.quoted()[1:-1].decode("ascii")

    def fragment(self) -> Any:
        """An `orjson.Fragment`, for `orjson.dumps(..., default=...)` to write as it is."""
        return orjson.Fragment(self.quoted())


class TokenLog:
    """A session's token ids, append-only, as int32, with their JSON text and packed forms (module docstring)."""

    __slots__ = ("__weakref__", "_b64", "_crc", "_crc_n", "_json", "_json_n", "_lock", "ids", "key")

    def __init__(self, ids: Sequence[int] = ()) -> None:
        self.ids = array("i")  # 4 bytes an id, nothing for the garbage collector to walk (module docstring)
        self._json, self._json_n = bytearray(b"["), 0  # the JSON text of ids[:_json_n], grown when asked for
        # the packed form (module docstring) is the ids' own bytes: the base64 of their first len // 3 * 3 bytes
        # is kept, grown only when a view is packed, and the crc32 of the first `_crc_n` ids; a request body may
        # be encoded on a thread
        self._b64, self._lock = bytearray(), threading.Lock()
        self._crc, self._crc_n = 0, 0
        self.key = secrets.token_hex(16)  # this session's name on a server that holds its ids (`session_key`)
        self.extend(ids)

    def __len__(self) -> int:
        return len(self.ids)

    def extend(self, more: Sequence[int], encoded: bytes | None = None, int32: bytes | None = None) -> None:
        """Append `more`; `encoded`: `ids_json(more)`, when the caller has it (a view's tail, sent as JSON:
        `TokenIds.tail_json`), taken into the JSON form when that has caught up with the log; `int32`:
        `ids_int32(more)`, likewise (a view's packed tail: `TokenIds.tail_int32`): appended as they are, and taken
        into the crc32 when that has caught up. ValueError for an id outside int32 (no model has one)."""
        if isinstance(more, TokenIds) and not more._n:
            more, encoded, int32 = more.tail, more.tail_json(made_only=True), more.tail_int32(made_only=True)
        elif isinstance(more, TokenIds) or not hasattr(more, "__len__"):  # a view past its log, or an iterator
            more = list(more)
        if not len(more):
            return
        if int32 is None or not _LITTLE:
            try:
                int32 = ids_int32(more)  # first: an id past int32 leaves the log as it was
            except OverflowError as exc:
                raise ValueError(str(exc)) from None
        with self._lock:
            n = len(self.ids)
            self.ids.frombytes(int32 if _LITTLE else _swapped(int32))
            if encoded is not None and self._json_n == n:  # caught up: it grows by these bytes
                if self._json_n:
                    self._json += b","
                self._json += memoryview(encoded)[1:-1]
                self._json_n = len(self.ids)
            if self._crc_n == n:
                self._crc, self._crc_n = zlib.crc32(int32, self._crc), len(self.ids)

    def view(self, delta: Sequence[int] = ()) -> TokenIds:
        """The log as it is now followed by `delta`, read-only (it does not change as the log grows)."""
        return TokenIds(self, len(self.ids), copied(delta))

    def joined(self, n: int, *more: bytes | memoryview) -> bytes:
        """The JSON text of the first `n` ids without its closing bracket, then `more`, copied once. The log's
        JSON form grows to `n` ids first (encoding only those it lacks); a view older than the form (the log grew
        and was sent since) is encoded whole."""
        with self._lock:
            if self._json_n < n:
                if self._json_n:
                    self._json += b","
                _encode_into(self._json, listed(self.ids[self._json_n:n]))
                self._json_n = n
            if self._json_n == n:
                with memoryview(self._json) as whole:  # released at once: a bytearray cannot grow while one is held
                    return b"".join((whole, *more))
            older = listed(self.ids[:n])
        return b"".join((ids_json(older)[:-1], *more))

    def packed(self, n: int, tail: list[int], more: bytes | None = None) -> bytes:
        """The first `n` ids then `tail`, packed (`PackedIds.quoted`): the kept base64 of the log's whole 3-byte
        groups, then the rest encoded here (0-2 bytes of the log's, and `tail`'s: `more`, its int32 bytes, when the
        caller has them); the kept base64 grows to `n` ids first."""
        more = ids_int32(tail) if more is None else more  # first: an id past int32 leaves the log as it was
        whole = 4 * n // 3 * 3  # the log's bytes whose base64 is kept
        with self._lock, self._int32() as raw:
            done = len(self._b64) // 4 * 3
            for at in range(done, whole, _B64_BLOCK):
                self._b64 += base64.b64encode(raw[at:min(at + _B64_BLOCK, whole)])
            rest = b64(b"".join((raw[whole:4 * n], more)))
            with memoryview(self._b64) as kept:
                return b"".join((b'"', kept[:whole // 3 * 4], rest, b'"'))

    def crc32(self, n: int) -> int:
        """zlib.crc32 of the first `n` ids as little-endian int32 bytes: kept as the log grows (to `n` first), so a
        view's whole log part costs O(ids new since); an older view's is computed."""
        with self._lock, self._int32() as raw:
            for at in range(4 * self._crc_n, 4 * n, 4 * SLICE):
                self._crc = zlib.crc32(raw[at:min(at + 4 * SLICE, 4 * n)], self._crc)
            self._crc_n = max(self._crc_n, n)
            return self._crc if n == self._crc_n else zlib.crc32(raw[:4 * n])

    def _int32(self) -> memoryview:
        """The ids as little-endian int32 bytes (their own buffer on a little-endian machine; release it before the
        log grows: an array cannot resize while a view of it is held). Under `_lock`."""
        if _LITTLE:
            return memoryview(self.ids).cast("B")
        swapped = array("i", self.ids)
        swapped.byteswap()
        return memoryview(swapped).cast("B")


class TokenIds(Sequence[int]):
    """Token ids: the first `n` ids of a `TokenLog`, then `tail`; read-only, with their JSON ready (`json()`)."""

    __slots__ = ("__weakref__", "_log", "_n", "_tail", "_tail_int32", "_tail_json")

    def __init__(self, log: TokenLog, n: int, tail: list[int]) -> None:
        self._log, self._n, self._tail = log, n, tail
        self._tail_json: bytes | None = None
        self._tail_int32: bytes | None = None

    def __len__(self) -> int:
        return self._n + len(self._tail)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        n = self._n
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return list(self)[index]
            out: list[int] = []
            _copy_into(out, self._log.ids, min(start, n), min(stop, n))
            _copy_into(out, self._tail, max(start - n, 0), max(stop - n, 0))
            return out
        i = index + len(self) if index < 0 else index
        if not 0 <= i < len(self):
            raise IndexError("token index out of range")
        return self._log.ids[i] if i < n else self._tail[i - n]

    def __iter__(self) -> Iterator[int]:
        return chain(islice(self._log.ids, self._n), self._tail)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)) or len(other) != len(self):
            return False
        n = self._n
        other = other if isinstance(other, list) else list(other)
        return other[:n] == listed(self._log.ids[:n]) and other[n:] == self._tail

    __hash__ = None  # type: ignore[assignment]  # equal to a list, so unhashable like one

    def __repr__(self) -> str:
        return f"TokenIds({list(self)!r})"

    @property
    def tail(self) -> list[int]:
        """The ids after the log's part (the ones `json()` encodes)."""
        return self._tail

    @property
    def log(self) -> TokenLog:
        """The log whose first `logged` ids these start with."""
        return self._log

    @property
    def logged(self) -> int:
        """How many of the ids are the log's (the rest are `tail`)."""
        return self._n

    def logged_crc32(self) -> int:
        """`TokenLog.crc32` of the log's part."""
        return self._log.crc32(self._n)

    def tail_json(self, made_only: bool = False) -> bytes | None:
        """`ids_json(self.tail)`, encoded on the first call only; with `made_only`, None unless it was."""
        if self._tail_json is None and not made_only:
            self._tail_json = ids_json(self._tail)
        return self._tail_json

    def tail_int32(self, made_only: bool = False) -> bytes | None:
        """`ids_int32(self.tail)`, converted on the first call only; with `made_only`, None unless it was."""
        if self._tail_int32 is None and not made_only:
            self._tail_int32 = ids_int32(self._tail)
        return self._tail_int32

    def packed_tail(self) -> bytes:
        """The tail alone packed (`PackedIds.quoted`): what a server holding the log's part is sent."""
        return b"".join((b'"', b64(self.tail_int32()), b'"'))

    def json(self) -> bytes:
        """`orjson.dumps(list(self))`, encoding only the tail (once: `tail_json`)."""
        if not self._tail:
            return self._log.joined(self._n, b"]")
        tail = self.tail_json()
        if not self._n:
            return tail
        return self._log.joined(self._n, b",", memoryview(tail)[1:])

    def fragment(self) -> Any:
        """The JSON as an `orjson.Fragment`, for `orjson.dumps(..., default=...)` to write as it is."""
        return orjson.Fragment(self.json())

    def packed(self) -> bytes:
        """The ids packed (`PackedIds.quoted`), encoding only what the log has not packed yet."""
        return self._log.packed(self._n, self._tail, self.tail_int32())

    def unpacked(self) -> int:
        """How many of the ids packing them (`PackedIds`) would encode: the tail and what the log has not packed."""
        kept = (len(self._log._b64) // 4 * 3 + 3) // 4  # ids the kept base64 reaches (the last may end in `rest`)
        return max(self._n - kept, 0) + len(self._tail)
