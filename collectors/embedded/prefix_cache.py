"""The embedded server's store of sessions' token ids, for prompts sent as a cached prefix plus a tail.

An agent's prompt is the session's whole history (tens of thousands of ids) on every call, although
the server saw all but the last few hundred of them in the previous call and its answer. A request
with `session_key` K leaves, once answered, its prompt ids followed by the output ids it sampled
under K (`put`); the next request of that session names them (`prompt_prefix`: key, how many of
the held ids, and their crc32) and sends only the ids after them. `prefix` hands the held ids back
only when the key is held, holds at least that many ids, and their crc32 (zlib's, over their
little-endian int32 bytes) is the one sent: anything else is a `PrefixMissing`, and the caller
resends the prompt whole; nothing is ever guessed.

The store is bounded by the ids it holds (`budget`, int32 each): least recently used keys are
evicted first; a sequence larger than the whole budget is not kept. Each sequence keeps its crc32,
so naming all of it (the common case) costs no pass over it; a shorter prefix is checked by one. A
call's sequence, its prefix's crc32 known, is checked over what the call added only (`put(known=)`).
Pure: the server (`collectors.embedded.app`) and the benchmark's fake upstream share it.
"""

from __future__ import annotations

import threading
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from collectors.errors import CollectorError

DEFAULT_BUDGET = 16 << 20  # ids (64 MiB as int32)
MAX_KEY_CHARS = 200


class PrefixMissing(CollectorError):
    """The prefix a request names is not held as named (key unknown or evicted, too few ids, another crc32)."""


def crc32_ids(ids: np.ndarray) -> int:
    """zlib.crc32 of ids as little-endian int32 bytes (the check a `prompt_prefix` carries)."""
    return zlib.crc32(np.ascontiguousarray(ids, dtype="<i4").data)


@dataclass(frozen=True)
class Held:
    ids: np.ndarray  # int32, read-only
    crc32: int  # of all of `ids`


@dataclass
class PrefixStats:
    """Counters, for GET /stats."""

    hits: int = 0
    misses: int = 0
    stored: int = 0
    evicted: int = 0


class PrefixCache:
    """Sessions' token ids by key, least recently used evicted past `budget` ids (module docstring)."""

    def __init__(self, budget: int = DEFAULT_BUDGET) -> None:
        if budget < 0:
            raise ValueError(f"the prefix cache budget must be >= 0 token ids, got {budget}")
        self.budget = budget
        self.held = 0  # ids held, all keys together
        self.stats = PrefixStats()
        self._seqs: OrderedDict[str, Held] = OrderedDict()
        self._lock = threading.Lock()  # a server may answer on more than one thread

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, key: object) -> bool:
        return key in self._seqs

    def prefix(self, key: str, tokens: int, crc32: int) -> np.ndarray:
        """The first `tokens` ids held under `key` when their crc32 is `crc32`; else PrefixMissing saying why."""
        with self._lock:
            held = self._seqs.get(key)
            if held is not None:
                self._seqs.move_to_end(key)
        if held is None:
            self.stats.misses += 1
            raise PrefixMissing(f"no token ids are held under session key {key!r} (never stored, evicted, or the "
                                "server restarted)")
        if tokens > len(held.ids):
            self.stats.misses += 1
            raise PrefixMissing(f"session key {key!r} holds {len(held.ids)} token ids, fewer than the {tokens} named")
        ids = held.ids[:tokens]
        actual = held.crc32 if tokens == len(held.ids) else crc32_ids(ids)
        if actual != crc32:
            self.stats.misses += 1
            raise PrefixMissing(f"the first {tokens} token ids held under session key {key!r} have crc32 {actual}, "
                                f"not {crc32}: they are not the ids the caller holds")
        self.stats.hits += 1
        return ids

    def put(self, key: str, *parts: Sequence[int] | np.ndarray, known: tuple[int, int] | None = None) -> None:
        """Hold the ids of `parts`, joined, under `key`, replacing what it held; then evict past the budget.
        `known`: (n, crc32 of the joined ids' first n), where the caller has it (a prompt sent as a held prefix
        carries it): the crc32 then runs over the ids after them only, so a session's call costs what it adds,
        not a pass over its whole history. A wrong one only makes the next call miss."""
        ids = np.concatenate([np.asarray(p, dtype="<i4") for p in parts]) if parts else np.empty(0, "<i4")
        ids.flags.writeable = False
        start, crc = known or (0, 0)
        if not 0 <= start <= len(ids):
            raise ValueError(f"known names the crc32 of the first {start} ids, but {len(ids)} are put")
        crc = zlib.crc32(ids[start:].data, crc)
        with self._lock:
            old = self._seqs.pop(key, None)
            if old is not None:
                self.held -= len(old.ids)
            if len(ids) > self.budget:
                return  # it would evict everything and still not fit
            self._seqs[key] = Held(ids, crc)
            self.held += len(ids)
            self.stats.stored += 1
            while self.held > self.budget:
                _, dropped = self._seqs.popitem(last=False)
                self.held -= len(dropped.ids)
                self.stats.evicted += 1

    def clear(self) -> None:
        with self._lock:
            self._seqs.clear()
            self.held = 0

    def as_json(self) -> dict[str, int]:
        s = self.stats
        return {"keys": len(self._seqs), "held_ids": self.held, "budget_ids": self.budget, "hits": s.hits,
                "misses": s.misses, "stored": s.stored, "evicted": s.evicted}
