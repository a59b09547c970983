"""How long `vacuum` keeps files the table no longer references: its limits and default.

A module of its own, free of pyarrow and deltalake, so the CLI's option parsing (`trajstore --help`)
can name the limits without loading the store.
"""

from __future__ import annotations

MIN_RETENTION_HOURS = 1
# A century: longer than any table lives, so nothing is deleted, and within what delta-rs's clock
# arithmetic takes (a retention near 1e15 hours panicked inside it; inf and 1e308 overflowed here).
MAX_RETENTION_HOURS = 24 * 365 * 100
DEFAULT_RETENTION_HOURS = 168  # Delta's default deleted-file retention: one week
