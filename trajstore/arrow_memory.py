"""Arrow's allocator for the store's processes: jemalloc (else the system's), unless the user chose one.

pyarrow's wheels default to mimalloc. On the capture proxy's work (a turn converted on the event
loop, written and freed on the commit thread, one every few milliseconds) mimalloc hands freed
pages back and takes them again, and in most runs one conversion of an event's text to Arrow in a
few stalls for 5-15 ms while holding the GIL: of an 80k-context session's 84 `Writer.prepare`
calls, 16-32 took over 2 ms (p99 8-15 ms) in two runs of the benchmark below and 1 in a third,
against 4-8 (p99 about 2.6 ms, never above 3.2) with jemalloc. The stall lands on whichever thread
converts (the event loop, for a turn that finds the commit idle), so it also delays every other
session; with it the proxy's CPU per turn was 20% higher. The system allocator has no such stall
either and measured about even with jemalloc (CPU per turn 0.87-1.22x, reads 0.94-1.43x of
jemalloc's over three runs); jemalloc comes first because, like mimalloc, it keeps freed memory
for reuse where the system allocator maps and faults in every large buffer anew. The system
allocator serves where a pyarrow build lacks jemalloc.
`python benchmarks/arrow_allocator.py` compares the three side by side.

A user who sets `ARROW_DEFAULT_MEMORY_POOL` (`jemalloc`, `mimalloc`, `system`) keeps that choice:
pyarrow reads it when it loads, and this module then changes nothing.

What this sets is pyarrow's default pool: the store's conversions, segment messages and reads. Arrow's
C++ code that takes its own default (the Parquet writer's encoding and compression buffers, when a
writer seals) keeps the pool chosen when pyarrow loaded, mimalloc in the wheels: writing a sealed
file's worth of 80k-token turns took the same CPU under each pool in a one-off timing, so the
environment is not changed before pyarrow loads to reach it.
"""

from __future__ import annotations

import os

import pyarrow as pa

ENV = "ARROW_DEFAULT_MEMORY_POOL"


def choose_allocator() -> str:
    """Make jemalloc (or, without it, the system allocator) Arrow's default unless `ARROW_DEFAULT_MEMORY_POOL`
    names one; returns the allocator in use (its backend name)."""
    if not os.environ.get(ENV):
        try:
            pool = pa.jemalloc_memory_pool()
        except NotImplementedError:  # a pyarrow built without jemalloc
            pool = pa.system_memory_pool()
        pa.set_memory_pool(pool)
    return pa.default_memory_pool().backend_name


ALLOCATOR = choose_allocator()  # before the store makes any array: every module that converts imports the schema
