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
written alone, so doing everything but the write first costs nothing that batching would save:
given the writer's `stage`, its caller stages it (`Writer.stage`: validation, Arrow columns,
duplicate ids skipped, sequence numbers, the segment message encoded with its checksums) before
handing it over, and the commit thread only writes and fsyncs it. Staging runs at once in the
caller when the call is small (up to `INLINE_TOKENS` token ids and logprobs, and a request body of
at most `INLINE_BODY_BYTES`: a few hundred microseconds); a larger call is handed over as it is,
so nothing of a call's size runs on the event loop. Under load the queue is never empty and the
commit thread converts each batch in one go; a batch that holds staged calls as well appends the
others first, and that append's one write and fsync carries the staged ones (they were numbered
before it, and the writer writes in numbering order).

A call is handed over with one `queue.SimpleQueue.put` (one wake-up of a waiting commit thread),
and each batch releases its callers with one `call_soon_threadsafe` per event loop they wait on.

A batch the writer refuses is retried call by call, so a call with an invalid event fails
alone and the others are stored; the retry cannot store anything twice because the writer
skips event ids it already holds. One call's events always stay together, in order. A
writer that cannot write (a failed fsync, a full disk) refuses every call from then on, so a
turn is never acknowledged unless its append returned.

`append` returns how long the call waited for the commit: from its events handed to the commit
thread (staged or not) to its caller resuming, durable (/stats `durable_wait`).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# The most token ids and logprobs a call may carry to be staged by its caller on the event loop (about 25
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
    events: Any  # the call's events, or what its caller staged of them
    staged: bool
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]
    queued: float = 0.0  # perf_counter when handed to the commit thread


class BatchAppender:
    """`await append(events)` returns once they are durable (the seconds waited for the commit), or raises what
    the writer raised. `append` is the writer's blocking `Writer.append`; with `stage` (`Writer.stage`) a call
    that finds the commit thread idle is staged by its caller (see the module docstring)."""

    def __init__(self, append: Callable[[Any], object], stage: Callable[[Sequence[Any]], object] | None = None
                 ) -> None:
        self._write = append
        self._stage = stage
        self._queue: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()  # None: stop
        self._writing = False  # the commit thread holds a batch
        self._thread: threading.Thread | None = None
        self._start = threading.Lock()  # starts the commit thread; orders hand-overs before close's stop
        self._closed = False

    async def append(self, events: list[Any], *, small: bool = True) -> float:
        """`small`: the caller knows its events hold no large value but their token lists (a request body of
        at most `INLINE_BODY_BYTES`), so they may be staged on the event loop."""
        loop = asyncio.get_running_loop()
        pending = _Pending(events, False, loop, loop.create_future())
        with self._start:  # nothing is staged or handed over after close's stop: nothing would write it
            if self._closed:
                raise RuntimeError("the proxy is stopping: nothing was recorded")
            if self._stage is not None and small and not self._writing and self._queue.empty() and \
                    token_count(events) <= INLINE_TOKENS:  # it would be written alone: stage it here
                pending.events, pending.staged = self._stage(events), True  # an invalid call fails here, alone
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="proxy-commit", daemon=True)
                self._thread.start()
            pending.queued = time.perf_counter()
            self._queue.put(pending)  # wakes the commit thread, if it waits: the one hand-over
        await pending.future  # cancelled: what was handed over is written all the same
        return time.perf_counter() - pending.queued

    def close(self) -> None:
        """Write what is queued, then stop the commit thread (the proxy's cleanup)."""
        with self._start:
            self._closed = True
            thread = self._thread
            self._queue.put(None)  # the last item: appends refuse from now on
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        take, more = self._queue.get, self._queue.get_nowait
        while True:
            batch = [take()]
            self._writing = True
            try:
                while True:  # and whatever else was handed over meanwhile
                    batch.append(more())
            except queue.Empty:
                pass
            calls = [p for p in batch if p is not None]
            if calls:
                self._settle(calls, self._write_batch(calls))
            self._writing = False
            if len(calls) < len(batch):  # asked to stop (the last item), and everything handed over is written
                return

    @staticmethod
    def _settle(batch: list[_Pending], outcomes: list[BaseException | None]) -> None:
        """Release the callers: one wake-up of each event loop they wait on."""
        loops = {p.loop for p in batch}
        for loop in loops:
            mine = list(zip(batch, outcomes, strict=True)) if len(loops) == 1 else \
                [(p, e) for p, e in zip(batch, outcomes, strict=True) if p.loop is loop]
            try:
                loop.call_soon_threadsafe(BatchAppender._release, mine)
            except RuntimeError:  # that loop is closed: nobody waits there any more
                pass

    def _write_batch(self, batch: list[_Pending]) -> list[BaseException | None]:
        """Append the calls handed over as they are in one go (the calls staged before them are written with
        them, under the same fsync), then acknowledge the staged ones."""
        outcomes: list[BaseException | None] = [None] * len(batch)
        given = [i for i, p in enumerate(batch) if not p.staged]
        if given:
            for i, outcome in zip(given, self._write_calls([batch[i] for i in given]), strict=True):
                outcomes[i] = outcome
        for i, p in enumerate(batch):
            if p.staged:  # written by the append above, or else by this one
                try:
                    self._write(p.events)
                except Exception as exc:  # noqa: BLE001 - answered to the caller
                    outcomes[i] = exc
        return outcomes

    def _write_calls(self, calls: list[_Pending]) -> list[BaseException | None]:
        try:
            self._write([event for p in calls for event in p.events])
            return [None] * len(calls)
        except Exception as exc:  # noqa: BLE001 - answered to the callers
            if len(calls) == 1:
                return [exc]
        outcomes: list[BaseException | None] = []
        for p in calls:  # find the call(s) the writer refuses; the rest are stored
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
