"""Group commit in front of the store writer: the turns that arrive together go down in one append.

Every turn the proxy stores must be durable before its agent is answered, and a
`Writer.append` costs far more per call (validation, conversion of every column to Arrow,
an fsync) than per event: 32 turns in one append cost what 3 or 4 cost appended one by one.
So one commit thread per proxy process takes whatever turns are waiting, appends them in one
`Writer.append` (one write, one fsync) and releases each caller the moment that append
returns; turns that arrive meanwhile wait only for the next append, which starts as soon as
this one ends. The thread never waits on the event loop: a busy loop delays when a released
caller resumes, never when its turn or the next batch is written.

A call that finds the commit thread idle (nothing queued, nothing being written) will be
written alone, so converting it first costs nothing that batching would save: given the
writer's `prepare`, its caller converts it (`Writer.prepare`: validation, Arrow columns)
before handing it over, and the commit thread only writes and fsyncs it. That conversion runs
at once in the caller when the call is small (up to `INLINE_TOKENS` token ids and logprobs, and
a request body of at most `INLINE_BODY_BYTES`: a few hundred microseconds); a larger call is handed over as it is, so nothing of a call's size
runs on the event loop. Under load the queue is never empty and the commit thread converts
each batch in one go.

A batch the writer refuses is retried call by call, so a call with an invalid event fails
alone and the others are stored; the retry cannot store anything twice because the writer
skips event ids it already holds. One call's events always stay together, in order. A
writer that cannot write (a failed fsync, a full disk) refuses every call from then on, so a
turn is never acknowledged unless its append returned.

`append` returns how long the call waited for the commit: from its events handed to the commit
thread (converted or not) to its caller resuming, durable (/stats `durable_wait`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trajstore import PreparedBatch

# The most token ids and logprobs a call may carry to be converted by its caller on the event loop (about 25
# microseconds per thousand); a larger one is converted by the commit thread.
INLINE_TOKENS = 16_384
INLINE_BODY_BYTES = 1 << 20  # a request body up to this size is written as JSON in about a millisecond at most
_TOKEN_FIELDS = ("prompt_ids", "output_ids", "output_logprobs", "support_ids", "teacher_logprobs")


def token_count(events: Sequence[Any]) -> int:
    """The token ids and logprobs `events` carry: what their conversion costs grows with."""
    total = 0
    for event in events:
        get = event.get if isinstance(event, Mapping) else lambda name, e=event: getattr(e, name, None)
        for name in _TOKEN_FIELDS:
            value = get(name)
            if value is not None:
                try:
                    total += len(value)
                except TypeError:  # not a list: its conversion reports it
                    pass
    return total


@dataclass
class _Pending:
    events: Any  # the call's events, or the PreparedBatch its caller made of them
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]
    queued: float = 0.0  # perf_counter when handed to the commit thread


class BatchAppender:
    """`await append(events)` returns once they are durable (the seconds waited for the commit), or raises what
    the writer raised. `append` is the writer's blocking `Writer.append`; with `prepare` (`Writer.prepare`) a call
    that finds the commit thread idle is converted by its caller (see the module docstring)."""

    def __init__(self, append: Callable[[Any], object],
                 prepare: Callable[[Sequence[Any]], PreparedBatch] | None = None) -> None:
        self._write = append
        self._prepare = prepare
        self._ready = threading.Condition()
        self._queue: list[_Pending] = []
        self._writing = False  # the commit thread holds a batch
        self._thread: threading.Thread | None = None
        self._closed = False

    async def append(self, events: list[Any], *, small: bool = True) -> float:
        """`small`: the caller knows its events hold no large value but their token lists (a request body of
        at most `INLINE_BODY_BYTES`), so they may be converted on the event loop."""
        loop = asyncio.get_running_loop()
        pending = _Pending(events, loop, loop.create_future())
        if self._prepare is not None and small and not self._queue and not self._writing and \
                token_count(events) <= INLINE_TOKENS:  # it would be written alone: convert it here
            pending.events = self._prepare(events)  # an invalid call fails here, alone, before anything is queued
        with self._ready:
            if self._closed:
                raise RuntimeError("the proxy is stopping: nothing was recorded")
            pending.queued = time.perf_counter()
            self._queue.append(pending)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="proxy-commit", daemon=True)
                self._thread.start()
            self._ready.notify()
        await pending.future  # cancelled: what was handed over is written all the same
        return time.perf_counter() - pending.queued

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
                self._writing = False
                while not self._queue and not self._closed:
                    self._ready.wait()
                if not self._queue:
                    return
                batch, self._queue = self._queue, []
                self._writing = True
            outcomes = self._write_batch(batch)
            for loop in {p.loop for p in batch}:
                mine = [(p, e) for p, e in zip(batch, outcomes, strict=True) if p.loop is loop]
                try:
                    loop.call_soon_threadsafe(self._release, mine)
                except RuntimeError:  # that loop is closed: nobody waits there any more
                    pass

    def _write_batch(self, batch: list[_Pending]) -> list[BaseException | None]:
        try:
            self._write(self._whole(batch))
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

    def _whole(self, batch: list[_Pending]) -> Any:
        """What one append of `batch` is given: its events (converted together by the writer), or, when its callers
        converted some, one prepared batch of all (the others converted here, call by call)."""
        if not any(isinstance(p.events, PreparedBatch) for p in batch):
            return [event for p in batch for event in p.events]
        assert self._prepare is not None
        return PreparedBatch.join([p.events if isinstance(p.events, PreparedBatch) else self._prepare(p.events)
                                   for p in batch])

    @staticmethod
    def _release(settled: list[tuple[_Pending, BaseException | None]]) -> None:
        for pending, error in settled:
            if pending.future.done():  # the caller went away; its events are written all the same
                continue
            if error is None:
                pending.future.set_result(None)
            else:
                pending.future.set_exception(error)
