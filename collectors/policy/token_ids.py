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
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import chain, islice
from typing import Any, overload

import orjson


def ids_json(ids: Sequence[int]) -> bytes:
    """`orjson.dumps` of token ids (a list of Python ints; anything else is converted id by id first)."""
    return orjson.dumps(ids if type(ids) is list else [int(t) for t in ids])


class TokenLog:
    """A session's token ids, append-only, and their JSON text without its closing bracket (module docstring)."""

    __slots__ = ("_json", "ids")

    def __init__(self, ids: Sequence[int] = ()) -> None:
        self.ids: list[int] = []
        self._json = bytearray(b"[")
        self.extend(ids)

    def __len__(self) -> int:
        return len(self.ids)

    def extend(self, more: Sequence[int]) -> None:
        """Append `more`, encoding only it."""
        if type(more) is not list:
            more = more[:] if isinstance(more, TokenIds) else [int(t) for t in more]
        if not more:
            return
        encoded = ids_json(more)
        if self.ids:
            self._json += b","
        self._json += memoryview(encoded)[1:-1]
        self.ids.extend(more)

    def view(self, delta: Sequence[int] = ()) -> TokenIds:
        """The log as it is now followed by `delta`, read-only (it does not change as the log grows)."""
        return TokenIds(self, len(self.ids), len(self._json), list(delta))

    def prefix_json(self, end: int) -> bytes:
        """The first `end` bytes of the log's JSON text (what a view of it was taken at)."""
        with memoryview(self._json) as whole:  # released at once: a bytearray cannot grow while one is held
            return whole[:end].tobytes()

    def joined(self, end: int, more: bytes) -> bytes:
        """The first `end` bytes of the log's JSON text, then `more`, copied once."""
        with memoryview(self._json) as whole:
            return b"".join((whole[:end], more))


class TokenIds(Sequence[int]):
    """Token ids: the first `n` ids of a `TokenLog`, then `tail`; read-only, with their JSON ready (`json()`)."""

    __slots__ = ("_end", "_log", "_n", "_tail")

    def __init__(self, log: TokenLog, n: int, end: int, tail: list[int]) -> None:
        self._log, self._n, self._end, self._tail = log, n, end, tail

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
            head = self._log.ids[start:min(stop, n)] if start < n else []
            return head + self._tail[max(start - n, 0):max(stop - n, 0)]
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

    def json(self) -> bytes:
        """`orjson.dumps(list(self))`, encoding only the tail."""
        if not self._tail:
            return self._log.prefix_json(self._end) + b"]"
        tail = ids_json(self._tail)
        if not self._n:
            return tail
        return self._log.joined(self._end, b"," + tail[1:])

    def fragment(self) -> Any:
        """The JSON as an `orjson.Fragment`, for `orjson.dumps(..., default=...)` to write as it is."""
        return orjson.Fragment(self.json())
