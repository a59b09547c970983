"""The capture proxy's calls to the policy server: they wait out an outage, and a rollout's close cancels them.

Outage: a call that cannot reach the server (`PolicyServerUnreachable`: refused connection, or
the server went away mid-call) was never sampled nor stored, so it is sent again, after a pause
growing from `BACKOFF_S[0]` to `BACKOFF_S[1]`, until the server answers or `wait_s` (the outage
bound) has passed since its first failure; then the agent gets the error. A restarted server
thus costs the agents a pause, not a failed rollout. A streamed call is sent again only before
its first chunk (after that the agent holds part of the reply). `waiting` counts the calls
waiting now (GET /stats, the collector's progress line).

Close: `cancel(rollout_id)` cancels the rollout's calls that wait for the server (sampling or
waiting out an outage), so closing a rollout (the collector stopping or timing out its agent)
does not wait for model calls nobody will read; the server drops the request when its
connection closes. A cancelled call stores nothing and answers 401 (the rollout is closed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from typing import TypeVar

from collectors.policy import PolicyServerUnreachable
from collectors.proxy.chat import ChatError

log = logging.getLogger(__name__)
T = TypeVar("T")
OUTAGE_WAIT_S = 300.0  # default bound on waiting for an unreachable policy server
BACKOFF_S = (0.25, 5.0)  # first pause between tries, and the longest


class Upstream:
    """Retries across policy-server outages and cancellation on close (see the module docstring)."""

    def __init__(self, base_url: str, wait_s: float = OUTAGE_WAIT_S) -> None:
        self.base_url, self.wait_s = base_url, wait_s
        self.waiting = 0  # calls waiting for an unreachable server now
        self.waited = 0  # calls that had to wait (and then went through or gave up)
        self.gave_up = 0  # calls that waited `wait_s` in vain
        self.cancelled = 0  # calls cancelled by their rollout's close
        self._calls: dict[str, set[asyncio.Task[object]]] = {}
        self._closing: set[asyncio.Task[object]] = set()

    async def call(self, make: Callable[[], Awaitable[T]]) -> T:
        """`await make()`, made again while the server cannot be reached (up to `wait_s`)."""
        deadline: float | None = None
        pause = BACKOFF_S[0]
        try:
            while True:
                try:
                    return await make()
                except PolicyServerUnreachable as exc:
                    now = time.monotonic()
                    if deadline is None:
                        deadline = now + self.wait_s
                        if not self.waiting:  # once per outage, not once per call
                            log.warning("%s; model calls wait up to %g s for it to come back", exc, self.wait_s)
                        self.waiting += 1
                        self.waited += 1
                    if now + pause > deadline:
                        self.gave_up += 1
                        raise PolicyServerUnreachable(f"{exc} (waited {self.wait_s:g} s for it to come back)",
                                                      url=exc.url) from exc
                    await asyncio.sleep(pause)
                    pause = min(pause * 2, BACKOFF_S[1])
        finally:
            if deadline is not None:
                self.waiting -= 1

    async def stream(self, make: Callable[[], AsyncIterator[T]]) -> AsyncIterator[T]:
        """The chunks of `make()`; opened again while the server cannot be reached, before its first chunk."""
        async def first() -> tuple[AsyncIterator[T], list[T]]:
            chunks = make()
            try:
                return chunks, [await anext(chunks)]
            except StopAsyncIteration:
                return chunks, []
            except BaseException:
                await chunks.aclose()  # type: ignore[attr-defined]
                raise

        chunks, head = await self.call(first)
        async with aclosing(chunks):  # type: ignore[type-var]
            for chunk in head:
                yield chunk
            async for chunk in chunks:
                yield chunk

    @asynccontextmanager
    async def cancellable(self, rollout_id: str) -> AsyncIterator[None]:
        """Within this block the current call is cancelled when its rollout closes (it then raises ChatError)."""
        task = asyncio.current_task()
        assert task is not None
        calls = self._calls.setdefault(rollout_id, set())
        calls.add(task)
        try:
            yield
        except asyncio.CancelledError:
            if task not in self._closing:
                raise
            task.uncancel()
            self.cancelled += 1
            raise ChatError(f"rollout {rollout_id} was closed while this call waited for the policy server; nothing "
                            "was stored", status=401, kind="authentication") from None
        finally:
            calls.discard(task)
            self._closing.discard(task)
            if not calls:
                self._calls.pop(rollout_id, None)

    def cancel(self, rollout_id: str) -> None:
        """Cancel every call of `rollout_id` inside `cancellable` now."""
        for task in self._calls.get(rollout_id, ()):
            self._closing.add(task)
            task.cancel()

    def as_json(self) -> dict[str, int]:
        return {"waiting": self.waiting, "waited": self.waited, "gave_up": self.gave_up, "cancelled": self.cancelled}
