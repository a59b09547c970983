"""Event, rollout, group and segment ids.

New ids are time-ordered (48-bit millisecond clock + 80 random bits, Crockford base32,
26 characters, the ULID layout): ids minted close in time sort close together, so the
min/max statistics of sealed files prune lookups by id (see `trajstore.shard`). Content ids
(for `trajstore ingest` lines without an event_id) are a hash of the canonical JSON, so the
same line always gets the same id.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from typing import Any

# base32 encodes big-endian bit groups left to right; mapping its alphabet onto Crockford's,
# which ascends in ASCII, makes the text sort exactly like the 128-bit number.
_TO_CROCKFORD = bytes.maketrans(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567", b"0123456789ABCDEFGHJKMNPQRSTVWXYZ")


def new_id(prefix: str = "") -> str:
    """A new time-ordered id, optionally prefixed (`new_id("r-")`)."""
    raw = (time.time_ns() // 1_000_000).to_bytes(6, "big") + os.urandom(10)
    return prefix + base64.b32encode(raw)[:26].translate(_TO_CROCKFORD).decode()


def content_id(obj: dict[str, Any]) -> str:
    """A stable id derived from an event's content (keys sorted, compact JSON)."""
    canonical = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "c-" + hashlib.sha256(canonical.encode()).hexdigest()[:32]
