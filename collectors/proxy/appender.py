"""Group commit in front of the store writer: the turns that arrive together go down in one append.

Every turn the proxy stores must be durable before its agent is answered, and a
`Writer.append` costs far more per call (validation, conversion of every column to Arrow,
an fsync) than per event: 32 turns in one append cost what 3 or 4 cost appended one by one.
So one commit thread per proxy process takes whatever turns are waiting, appends them in one
`Writer.append` (one write, one fsync) and releases each caller the moment that append
returns; turns that arrive meanwhile wait only for the next append, which starts as soon as
this one ends. The thread never waits on the event loop: a busy loop delays when a released
caller resumes, never when its turn or the next batch is written. A lone turn waits for
nothing but its own write.

A batch the writer refuses is retried call by call, so a call with an invalid event fails
alone and the others are stored; the retry cannot store anything twice because the writer
skips event ids it already holds. One call's events always stay together, in order. A
writer that cannot write (a failed fsync, a full disk) refuses every call from then on, so a
turn is never acknowledged unless its append returned.

`CommitWaits` keeps how long each call waited, from handing its events over to being
released on its event loop (what /stats shows as `commit_wait`).
"""

from __future__ import annotations

import asyncio
import bisect
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

RECENT_WAITS = 4096  # per process: the percentiles are of the latest calls
BOUNDS_MS = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 5000.0)


@dataclass
class CommitWaits:
    """Seconds each append waited until its caller was released: all-time counts by bucket, recent samples."""

    count: int = 0
    buckets: list[int] = field(default_factory=lambda: [0] * (len(BOUNDS_MS) + 1))
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_WAITS))

    def add(self, seconds: float) -> None:
        self.count += 1
        self.buckets[bisect.bisect_left(BOUNDS_MS, seconds * 1e3)] += 1
        self.recent.append(seconds)

    def as_json(self, *, samples: bool = False) -> dict[str, Any]:
        out = summary(self.count, self.buckets, list(self.recent))
        if samples:  # for a front that merges several processes' waits
            out["samples_ms"] = [round(s * 1e3, 4) for s in self.recent]
        return out


def summary(count: int, buckets: Sequence[int], recent_s: Sequence[float]) -> dict[str, Any]:
    """`commit_wait` in /stats: percentiles of the recent waits (ms), and every wait by bucket."""
    ordered = sorted(recent_s)

    def at(q: float) -> float | None:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3, 3) if ordered else None

    labels = [f"<={b:g}" for b in BOUNDS_MS] + [f">{BOUNDS_MS[-1]:g}"]
    return {"calls": count, "recent": len(ordered), "p50_ms": at(0.5), "p90_ms": at(0.9), "p99_ms": at(0.99),
            "max_ms": round(ordered[-1] * 1e3, 3) if ordered else None,
            "histogram_ms": dict(zip(labels, buckets, strict=True))}


def merged_summary(parts: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Several processes' `commit_wait` (each with `samples_ms`) as one."""
    parts = list(parts)
    buckets = [sum(p["histogram_ms"][label] for p in parts) for label in parts[0]["histogram_ms"]] if parts else \
        [0] * (len(BOUNDS_MS) + 1)
    recent = [ms / 1e3 for p in parts for ms in p.get("samples_ms", [])]
    return summary(sum(p["calls"] for p in parts), buckets, recent)


@dataclass
class _Pending:
    events: list[Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]
    since: float  # time.perf_counter() when handed over


class BatchAppender:
    """`await append(events)` returns once they are durable, or raises what the writer raised."""

    def __init__(self, append: Callable[[Sequence[Any]], object]) -> None:
        self._write = append  # blocking: trajstore's Writer.append
        self.waits = CommitWaits()
        self._ready = threading.Condition()
        self._queue: list[_Pending] = []
        self._thread: threading.Thread | None = None
        self._closed = False

    async def append(self, events: list[Any]) -> None:
        loop = asyncio.get_running_loop()
        pending = _Pending(events, loop, loop.create_future(), time.perf_counter())
        with self._ready:
            if self._closed:
                raise RuntimeError("the proxy is stopping: nothing was recorded")
            self._queue.append(pending)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="proxy-commit", daemon=True)
                self._thread.start()
            self._ready.notify()
        await pending.future  # cancelled: what was handed over is written all the same

    def close(self) -> None:
        """Write what is queued, then stop the commit thread (the proxy's cleanup)."""
        with self._ready:
            self._closed = True
            self._ready.notify()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._queue and not self._closed:
                    self._ready.wait()
                if not self._queue:
                    return
                batch, self._queue = self._queue, []
            outcomes = self._write_batch(batch)
            for loop in {p.loop for p in batch}:
                mine = [(p, e) for p, e in zip(batch, outcomes, strict=True) if p.loop is loop]
                try:
                    loop.call_soon_threadsafe(self._release, mine)
                except RuntimeError:  # that loop is closed: nobody waits there any more
                    pass

    def _write_batch(self, batch: list[_Pending]) -> list[BaseException | None]:
        try:
            self._write([event for p in batch for event in p.events])
            return [None] * len(batch)
        except Exception as exc:  # noqa: BLE001 - answered to the callers
            if len(batch) == 1:
                return [exc]
        outcomes: list[BaseException | None] = []
        for p in batch:  # find the call(s) the writer refuses; the rest are stored
            try:
                self._write(p.events)
                outcomes.append(None)
            except Exception as one:  # noqa: BLE001
                outcomes.append(one)
        return outcomes

    def _release(self, settled: list[tuple[_Pending, BaseException | None]]) -> None:
        now = time.perf_counter()
        for pending, error in settled:
            if error is None:
                self.waits.add(now - pending.since)
            if pending.future.done():  # the caller went away; its events are written all the same
                continue
            if error is None:
                pending.future.set_result(None)
            else:
                pending.future.set_exception(error)
