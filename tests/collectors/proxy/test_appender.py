"""The proxy's group commit: concurrent calls share one `Writer.append`, a refused call fails alone, and
with the writer's `prepare` each call is converted by its caller (inline or on a preparing thread) so the
commit thread only writes what is ready."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from collectors.proxy.appender import BatchAppender
from trajstore import InvalidEventError, PreparedBatch, Status, Turn, Writer, open_store


class Counted:
    """A real store writer whose append and prepare calls are recorded (what they got, on which thread)."""

    def __init__(self, writer: Writer) -> None:
        self.writer, self.calls, self.appended, self.prepared_on = writer, [], [], []

    def append(self, events: Sequence[Any] | PreparedBatch) -> object:
        self.calls.append(len(events))
        self.appended.append(type(events))
        return self.writer.append(events)

    def prepare(self, events: Sequence[Any]) -> PreparedBatch:
        self.prepared_on.append(threading.current_thread().name)
        return self.writer.prepare(events)


def status(rollout: str) -> Status:
    return Status(run="t", group_id="g", rollout_id=rollout, status="started")


def stored(tmp_path: Path) -> list[str]:
    rows = open_store(tmp_path).query("SELECT rollout_id FROM events ORDER BY writer_seq").to_pylist()
    return [r["rollout_id"] for r in rows]


def test_a_lone_call_is_written_at_once(tmp_path: Path) -> None:
    with open_store(tmp_path).writer("w") as writer:
        counted = Counted(writer)
        asyncio.run(BatchAppender(counted.append).append([status("r1"), status("r1b")]))
        assert counted.calls == [2]
    assert stored(tmp_path) == ["r1", "r1b"]


def test_concurrent_calls_share_appends_and_keep_each_calls_events_together(tmp_path: Path) -> None:
    with open_store(tmp_path).writer("w") as writer:
        counted = Counted(writer)
        appender = BatchAppender(counted.append)

        async def run() -> None:
            await asyncio.gather(*(appender.append([status(f"r{i}a"), status(f"r{i}b")]) for i in range(40)))

        asyncio.run(run())
        assert sum(counted.calls) == 80
        assert len(counted.calls) < 40  # callers that arrive while a batch is written go in the next one
    order = stored(tmp_path)
    assert sorted(order) == sorted(f"r{i}{x}" for i in range(40) for x in "ab")
    for i in range(40):
        assert order.index(f"r{i}b") == order.index(f"r{i}a") + 1


def test_a_refused_call_fails_alone_and_the_rest_of_its_batch_is_stored(tmp_path: Path) -> None:
    bad = {"kind": "status", "group_id": "g", "rollout_id": "bad"}  # no status: the writer refuses it
    with open_store(tmp_path).writer("w") as writer:
        appender = BatchAppender(writer.append)

        async def run() -> list[BaseException | None]:
            calls = [[status("r0")], [status("r1")], [bad, status("r2-with-bad")], [status("r3")]]
            return await asyncio.gather(*(appender.append(c) for c in calls), return_exceptions=True)

        results = asyncio.run(run())
        assert results[0] is None and results[1] is None and results[3] is None
        assert isinstance(results[2], InvalidEventError)
    assert sorted(stored(tmp_path)) == ["r0", "r1", "r3"]  # nothing of the refused call, not even its good event


def test_a_caller_that_goes_away_does_not_stop_the_others(tmp_path: Path) -> None:
    with open_store(tmp_path).writer("w") as writer:
        appender = BatchAppender(writer.append)

        async def run() -> None:
            first = asyncio.create_task(appender.append([status("r0")]))
            await asyncio.sleep(0)
            gone = asyncio.create_task(appender.append([status("r1")]))
            kept = asyncio.create_task(appender.append([status("r2")]))
            await asyncio.sleep(0)
            gone.cancel()
            await first
            await kept
            with pytest.raises(asyncio.CancelledError):
                await gone

        asyncio.run(run())
    assert sorted(stored(tmp_path)) == ["r0", "r1", "r2"]  # as with a thread: what was handed over is written


def turn(rollout: str, prompt_tokens: int = 10) -> Turn:
    return Turn(run="t", group_id="g", rollout_id=rollout, segment_id="s", turn_index=0, policy_version=0,
                prompt_ids=list(range(prompt_tokens)), output_ids=[1, 2], output_logprobs=[-0.5, -0.25],
                request={"messages": [{"role": "user", "content": "hi"}]})


@pytest.mark.parametrize("inline_tokens", [10_000, 0], ids=["inline", "off-loop"])
def test_with_prepare_the_commit_thread_writes_converted_batches_only(tmp_path: Path, inline_tokens: int) -> None:
    loop_thread = threading.current_thread().name
    with open_store(tmp_path).writer("w") as writer:
        counted = Counted(writer)
        appender = BatchAppender(counted.append, counted.prepare, inline_tokens=inline_tokens)

        async def run() -> None:
            await asyncio.gather(*(appender.append([turn(f"r{i}"), status(f"r{i}")]) for i in range(20)))

        asyncio.run(run())
        appender.close()
        assert set(counted.appended) == {PreparedBatch}  # nothing left to convert on the commit thread
        assert sum(counted.calls) == 40 and len(counted.prepared_on) == 20
        if inline_tokens:
            assert set(counted.prepared_on) == {loop_thread}
        else:
            assert all(name.startswith("proxy-prepare") for name in counted.prepared_on)
    order = stored(tmp_path)
    for i in range(20):
        assert order.index(f"r{i}") + 1 == order.index(f"r{i}", order.index(f"r{i}") + 1)  # a call stays together


def test_a_call_over_the_inline_limit_is_converted_off_the_loop(tmp_path: Path) -> None:
    with open_store(tmp_path).writer("w") as writer:
        counted = Counted(writer)
        appender = BatchAppender(counted.append, counted.prepare, inline_tokens=100)

        async def run() -> None:
            await appender.append([turn("small", 50)])
            await appender.append([turn("large", 500)])

        asyncio.run(run())
        appender.close()
        assert counted.prepared_on[0] == threading.current_thread().name
        assert counted.prepared_on[1].startswith("proxy-prepare")
    assert stored(tmp_path) == ["small", "large"]


@pytest.mark.parametrize("inline_tokens", [10_000, 0], ids=["inline", "off-loop"])
def test_an_invalid_call_is_refused_by_its_own_conversion_and_never_reaches_the_writer(
        tmp_path: Path, inline_tokens: int) -> None:
    bad = {"kind": "status", "group_id": "g", "rollout_id": "bad"}  # no status
    with open_store(tmp_path).writer("w") as writer:
        counted = Counted(writer)
        appender = BatchAppender(counted.append, counted.prepare, inline_tokens=inline_tokens)

        async def run() -> list[BaseException | None]:
            calls = [[turn("r0")], [bad, turn("r1-with-bad")], [turn("r2")]]
            return await asyncio.gather(*(appender.append(c) for c in calls), return_exceptions=True)

        results = asyncio.run(run())
        appender.close()
        assert results[0] is None and results[2] is None
        assert isinstance(results[1], InvalidEventError) and "needs 'status'" in str(results[1])
        assert sum(counted.calls) == 2  # the writer never saw the refused call: no retry, no lone append
    assert sorted(stored(tmp_path)) == ["r0", "r2"]


def test_a_call_cancelled_while_it_is_converted_off_the_loop_is_stored(tmp_path: Path) -> None:
    release = threading.Event()
    with open_store(tmp_path).writer("w") as writer:
        def slow_prepare(events: Sequence[Any]) -> PreparedBatch:
            release.wait(10)  # the caller is cancelled while this runs
            return writer.prepare(events)

        appender = BatchAppender(writer.append, slow_prepare, inline_tokens=0)

        async def run() -> None:
            task = asyncio.create_task(appender.append([turn("kept")]))
            await asyncio.sleep(0.05)
            task.cancel()
            release.set()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(run())
        appender.close()  # waits for the conversion in flight and writes it
    assert stored(tmp_path) == ["kept"]


def test_after_close_a_call_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    with open_store(tmp_path).writer("w") as writer:
        appender = BatchAppender(writer.append, writer.prepare, inline_tokens=0)
        appender.close()
        with pytest.raises(RuntimeError, match="the proxy is stopping"):
            asyncio.run(appender.append([turn("late")]))
