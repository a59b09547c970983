"""Event, rollout, group and segment ids.

New ids are time-ordered (48-bit millisecond clock + 80 random bits, Crockford base32,
26 characters, the ULID layout): ids minted close in time sort close together, so the
min/max statistics of sealed files prune lookups by id (see `trajstore.shard`). Content ids
(for `trajstore ingest` lines without an event_id) are a hash of the canonical JSON, so the
same line always gets the same id.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any

_ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def _b32(value: int, length: int) -> str:
    out = []
    for _ in range(length):
        out.append(_ALPHABET[value & 31])
        value >>= 5
    return "".join(reversed(out))


def new_id(prefix: str = "") -> str:
    """A new time-ordered id, optionally prefixed (`new_id("r-")`)."""
    ms = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")
    return prefix + _b32(ms, 10) + _b32(rand, 16)


def content_id(obj: dict[str, Any]) -> str:
    """A stable id derived from an event's content (keys sorted, compact JSON)."""
    canonical = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "c-" + hashlib.sha256(canonical.encode()).hexdigest()[:32]
