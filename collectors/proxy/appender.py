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

How long each turn waits (handed over -> its caller resumes) is /stats `durable_wait`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class _Pending:
    events: list[Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]


class BatchAppender:
    """`await append(events)` returns once they are durable, or raises what the writer raised."""

    def __init__(self, append: Callable[[Sequence[Any]], object]) -> None:
        self._write = append  # blocking: trajstore's Writer.append
        self._ready = threading.Condition()
        self._queue: list[_Pending] = []
        self._thread: threading.Thread | None = None
        self._closed = False

    async def append(self, events: list[Any]) -> None:
        loop = asyncio.get_running_loop()
        pending = _Pending(events, loop, loop.create_future())
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

    @staticmethod
    def _release(settled: list[tuple[_Pending, BaseException | None]]) -> None:
        for pending, error in settled:
            if pending.future.done():  # the caller went away; its events are written all the same
                continue
            if error is None:
                pending.future.set_result(None)
            else:
                pending.future.set_exception(error)
