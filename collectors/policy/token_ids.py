"""Token ids kept beside their JSON: a long session's prompt is sent without being encoded again on every call.

A policy server is sent the whole prompt on every call (vLLM and the embedded server both take
plain JSON token ids), and an agent's session grows by a few thousand tokens a call on top of
tens of thousands already sent. `TokenLog` is a session's ids, append-only, with their JSON text
grown in step: `extend` encodes only the ids it adds. `TokenLog.view(delta)` is the next prompt,
the log as it is now plus the new ids, as a read-only `TokenIds`: its JSON (`json()`) is the
log's text up to that point, copied, and the encoding of the delta alone, byte for byte what
`orjson.dumps(list(ids))` writes. A view stays valid while the log grows (it remembers its
length), so a `Sample` may hold it as its `prompt_ids`.

The policy clients (`collectors.policy.http`) take a `TokenIds` wherever they take a list and
write its JSON into the request body as it is (`orjson.Fragment`), whatever field holds it.

A view's ids past the log are encoded once (`TokenIds.tail_json`): extending the log by a view of
it (the ids of a stored call) may take that JSON (`TokenLog.extend`'s `encoded`), not encode them again.

Long lists are handled `SLICE` ids at a time (encoded, copied), each slice one short call: a
single call over millions of ids would hold the GIL for tens of milliseconds (a server's event
loop and every other thread stopped meanwhile); between slices the interpreter may switch threads.
The result is the same bytes and lists as one call gives.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import chain, islice
from typing import Any, overload
from weakref import WeakValueDictionary

import orjson

SLICE = 1 << 16  # ids per call over a long list (about a millisecond of work each)


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


def drain(log: TokenLog) -> None:
    """Empty a long `log` a slice at a time, unless a view of it is alive: a log dropped at once frees its millions
    of ids in one call, a hold of the GIL for tens of milliseconds. For a log its owner is done with (a session's
    last segment, replaced by a new one); a view still being read keeps the log as it is."""
    if len(log.ids) > SLICE and not log._views:
        while log.ids:
            del log.ids[-SLICE:]
        log._json = bytearray(b"[")


class TokenLog:
    """A session's token ids, append-only, and their JSON text without its closing bracket (module docstring)."""

    __slots__ = ("_json", "_views", "ids")

    def __init__(self, ids: Sequence[int] = ()) -> None:
        self.ids: list[int] = []
        self._json = bytearray(b"[")
        self._views: WeakValueDictionary[int, TokenIds] = WeakValueDictionary()  # alive, by id (a view is unhashable)
        self.extend(ids)

    def __len__(self) -> int:
        return len(self.ids)

    def extend(self, more: Sequence[int], encoded: bytes | None = None) -> None:
        """Append `more`, encoding only it; `encoded`: `ids_json(more)`, when the caller has it (a view of no log's
        ids brings its own: `TokenIds.tail_json`)."""
        if isinstance(more, TokenIds) and not more._n:
            more, encoded = more.tail, more.tail_json()
        elif type(more) is not list:
            more = more[:] if isinstance(more, TokenIds) else [int(t) for t in more]
        if not more:
            return
        if self.ids:
            self._json += b","
        if encoded is not None:
            self._json += memoryview(encoded)[1:-1]
        else:
            _encode_into(self._json, more)
        _copy_into(self.ids, more, 0, len(more))

    def view(self, delta: Sequence[int] = ()) -> TokenIds:
        """The log as it is now followed by `delta`, read-only (it does not change as the log grows)."""
        return TokenIds(self, len(self.ids), len(self._json), copied(delta))

    def prefix_json(self, end: int) -> bytes:
        """The first `end` bytes of the log's JSON text (what a view of it was taken at)."""
        with memoryview(self._json) as whole:  # released at once: a bytearray cannot grow while one is held
            return whole[:end].tobytes()

    def joined(self, end: int, *more: bytes | memoryview) -> bytes:
        """The first `end` bytes of the log's JSON text, then `more`, copied once."""
        with memoryview(self._json) as whole:
            return b"".join((whole[:end], *more))


class TokenIds(Sequence[int]):
    """Token ids: the first `n` ids of a `TokenLog`, then `tail`; read-only, with their JSON ready (`json()`)."""

    __slots__ = ("__weakref__", "_end", "_log", "_n", "_tail", "_tail_json")

    def __init__(self, log: TokenLog, n: int, end: int, tail: list[int]) -> None:
        self._log, self._n, self._end, self._tail = log, n, end, tail
        self._tail_json: bytes | None = None
        log._views[id(self)] = self  # `drain` leaves a log with a view alive as it is

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
        return other[:n] == self._log.ids[:n] and other[n:] == self._tail

    __hash__ = None  # type: ignore[assignment]  # equal to a list, so unhashable like one

    def __repr__(self) -> str:
        return f"TokenIds({list(self)!r})"

    @property
    def tail(self) -> list[int]:
        """The ids after the log's part (the ones `json()` encodes)."""
        return self._tail

    def tail_json(self) -> bytes:
        """`ids_json(self.tail)`, encoded on the first call only."""
        if self._tail_json is None:
            self._tail_json = ids_json(self._tail)
        return self._tail_json

    def json(self) -> bytes:
        """`orjson.dumps(list(self))`, encoding only the tail (once: `tail_json`)."""
        if not self._tail:
            return self._log.prefix_json(self._end) + b"]"
        tail = self.tail_json()
        if not self._n:
            return tail
        return self._log.joined(self._end, b",", memoryview(tail)[1:])

    def fragment(self) -> Any:
        """The JSON as an `orjson.Fragment`, for `orjson.dumps(..., default=...)` to write as it is."""
        return orjson.Fragment(self.json())
