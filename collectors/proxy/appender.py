"""Group commit in front of the store writer: the turns that arrive together go down in one append.

Every turn the proxy stores must be durable before its agent is answered, and a
`Writer.append` costs far more per call (an fsync) than per event: 32 turns in one append
cost what 3 or 4 cost appended one by one. So one commit thread per proxy process takes
whatever turns are waiting, appends them in one `Writer.append` (one write, one fsync) and
releases each caller the moment that append returns; turns that arrive meanwhile wait only
for the next append, which starts as soon as this one ends. The thread never waits on the
event loop: a busy loop delays when a released caller resumes, never when its turn or the
next batch is written. A lone turn waits for nothing but its own write.

Given the writer's `prepare`, each call's events are validated and converted to Arrow
columns (`Writer.prepare`) before they are queued, by their caller: on the event loop when
they are small (a turn of up to `INLINE_TOKENS` token ids converts in a few hundred
microseconds, less than a hop to a thread costs), on a preparing thread otherwise. The
commit thread then only numbers, writes and fsyncs what is ready, so no turn waits for the
conversion of the turns batched with it. An invalid call is refused by its own conversion,
before it is queued: it fails alone, and the others are stored.

A batch the writer still refuses is retried call by call, so a call the writer refuses fails
alone; the retry cannot store anything twice because the writer skips event ids it already
holds. One call's events always stay together, in order. A writer that cannot write (a failed
fsync, a full disk) refuses every call from then on, so a turn is never acknowledged unless
its append returned. Events handed to `append` are written even if their caller is cancelled
while they are converted or written.

How long each turn waits (handed over, conversion included -> its caller resumes) is /stats
`durable_wait`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from trajstore import PreparedBatch

# A call with more token ids than this is converted on a preparing thread, off the event loop: converting
# token lists costs ~25 us per thousand ids, and a proxy turn's JSON (its request, bounded by the model's
# context) well under a millisecond with orjson.
INLINE_TOKENS = 16_384
_TOKEN_FIELDS = ("prompt_ids", "output_ids", "output_logprobs", "support_ids", "teacher_logprobs")
PREPARE_THREADS = 2


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
    events: Any  # the call's events, or the PreparedBatch made of them
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]


class BatchAppender:
    """`await append(events)` returns once they are durable, or raises what the writer raised.

    `append` is the writer's (blocking) `Writer.append`; with `prepare` (`Writer.prepare`) each call's events
    are converted before they are queued (see the module docstring)."""

    def __init__(self, append: Callable[[Any], object], prepare: Callable[[Sequence[Any]], PreparedBatch] | None = None,
                 *, inline_tokens: int = INLINE_TOKENS) -> None:
        self._write = append
        self._prepare = prepare
        self.inline_tokens = inline_tokens
        self._ready = threading.Condition()
        self._queue: list[_Pending] = []
        self._thread: threading.Thread | None = None
        self._preparing = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="proxy-prepare")
        self._closed = False

    async def append(self, events: list[Any]) -> None:
        loop = asyncio.get_running_loop()
        pending = _Pending(events, loop, loop.create_future())
        if self._prepare is None:
            self._queue_up(pending)
        elif token_count(events) <= self.inline_tokens:
            self._check_open()
            pending.events = self._prepare(events)  # an invalid call fails here, alone
            self._queue_up(pending)
        else:
            self._check_open()
            try:  # not run_in_executor: a caller cancelled meanwhile must not cancel the conversion
                self._preparing.submit(self._prepare_off_loop, pending)
            except RuntimeError:  # shut down by close()
                raise RuntimeError("the proxy is stopping: nothing was recorded") from None
        await pending.future  # cancelled: what was handed over is written all the same

    def close(self) -> None:
        """Write what is queued or being converted, then stop the commit thread (the proxy's cleanup)."""
        self._preparing.shutdown(wait=True)
        with self._ready:
            self._closed = True
            self._ready.notify()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the proxy is stopping: nothing was recorded")

    def _queue_up(self, pending: _Pending) -> None:
        with self._ready:
            self._check_open()
            self._queue.append(pending)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="proxy-commit", daemon=True)
                self._thread.start()
            self._ready.notify()

    def _prepare_off_loop(self, pending: _Pending) -> None:
        assert self._prepare is not None
        try:
            pending.events = self._prepare(pending.events)
            self._queue_up(pending)
        except Exception as exc:  # noqa: BLE001 - answered to the caller
            self._settle(pending.loop, [(pending, exc)])

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
                self._settle(loop, [(p, e) for p, e in zip(batch, outcomes, strict=True) if p.loop is loop])

    def _settle(self, loop: asyncio.AbstractEventLoop, settled: list[tuple[_Pending, BaseException | None]]) -> None:
        try:
            loop.call_soon_threadsafe(self._release, settled)
        except RuntimeError:  # that loop is closed: nobody waits there any more
            pass

    def _write_batch(self, batch: list[_Pending]) -> list[BaseException | None]:
        try:
            if self._prepare is None:
                self._write([event for p in batch for event in p.events])
            else:
                self._write(PreparedBatch.join([p.events for p in batch]))
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
