"""The proxy's group commit: concurrent calls share one `Writer.append`, a refused call fails alone; a call that
finds the commit thread idle is staged by its caller (`Writer.stage`), a large one or one that queues is not."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from collectors.proxy.appender import INLINE_TOKENS, BatchAppender
from trajstore import InvalidEventError, Staged, Status, Turn, Writer, open_store


class Counted:
    """A real store writer whose append calls are counted."""

    def __init__(self, writer: Writer) -> None:
        self.writer, self.calls, self.given = writer, [], []

    def append(self, events: Sequence[Any] | Staged) -> object:
        self.calls.append(events.result.appended if isinstance(events, Staged) else len(events))
        self.given.append(type(events).__name__)
        return self.writer.append(events)


def status(rollout: str) -> Status:
    return Status(run="t", group_id="g", rollout_id=rollout, status="started")


def stored(tmp_path: Path) -> list[str]:
    rows = open_store(tmp_path).query("SELECT rollout_id FROM events ORDER BY writer_seq").to_pylist()
    return [r["rollout_id"] for r in rows]


def appender_of(append: Any, writer: Writer, stage: bool) -> BatchAppender:
    return BatchAppender(append, writer.stage) if stage else BatchAppender(append)


@pytest.mark.parametrize("stage", [False, True], ids=["commit-converts", "caller-stages"])
def test_a_lone_call_is_written_at_once(tmp_path: Path, stage: bool) -> None:
    with open_store(tmp_path).writer("w") as writer:
        counted = Counted(writer)
        waited = asyncio.run(appender_of(counted.append, writer, stage).append([status("r1"), status("r1b")]))
        assert counted.calls == [2] and waited >= 0
        assert counted.given == ["Staged" if stage else "list"]  # idle: its caller staged it
    assert stored(tmp_path) == ["r1", "r1b"]


def test_a_large_call_is_converted_by_the_commit_thread_not_on_the_event_loop(tmp_path: Path) -> None:
    big = Turn(run="t", group_id="g", rollout_id="big", session_id="s", segment_id="x", turn_index=0,
               policy_version=0, prompt_ids=[1] * (INLINE_TOKENS + 1), output_ids=[2], output_logprobs=[-0.5],
               finish_reason="stop")
    with open_store(tmp_path).writer("w") as writer:
        counted = Counted(writer)
        asyncio.run(BatchAppender(counted.append, writer.stage).append([big]))
        assert counted.given == ["list"]
    assert stored(tmp_path) == ["big"]


def test_a_call_its_caller_does_not_call_small_is_converted_by_the_commit_thread(tmp_path: Path) -> None:
    with open_store(tmp_path).writer("w") as writer:
        counted = Counted(writer)
        asyncio.run(BatchAppender(counted.append, writer.stage).append([status("huge-body")], small=False))
        assert counted.given == ["list"]
    assert stored(tmp_path) == ["huge-body"]


@pytest.mark.parametrize("stage", [False, True], ids=["commit-converts", "caller-stages"])
def test_concurrent_calls_share_appends_and_keep_each_calls_events_together(tmp_path: Path, stage: bool) -> None:
    with open_store(tmp_path).writer("w") as writer:
        counted = Counted(writer)
        appender = appender_of(counted.append, writer, stage)

        async def run() -> None:
            await asyncio.gather(*(appender.append([status(f"r{i}a"), status(f"r{i}b")]) for i in range(40)))

        asyncio.run(run())
        assert sum(counted.calls) == 80
        assert len(counted.calls) < 40  # callers that arrive while a batch is written go in the next one
        if stage:  # the first found the thread idle and came staged; the others were handed over as they are
            assert counted.given.count("Staged") >= 1 and "list" in counted.given
    order = stored(tmp_path)
    assert sorted(order) == sorted(f"r{i}{x}" for i in range(40) for x in "ab")
    for i in range(40):
        assert order.index(f"r{i}b") == order.index(f"r{i}a") + 1


@pytest.mark.parametrize("stage", [False, True], ids=["commit-converts", "caller-stages"])
def test_a_refused_call_fails_alone_and_the_rest_of_its_batch_is_stored(tmp_path: Path, stage: bool) -> None:
    bad = {"kind": "status", "group_id": "g", "rollout_id": "bad"}  # no status: the writer refuses it
    with open_store(tmp_path).writer("w") as writer:
        appender = appender_of(writer.append, writer, stage)

        async def run() -> list[BaseException | None]:
            calls = [[status("r0")], [status("r1")], [bad, status("r2-with-bad")], [status("r3")]]
            return await asyncio.gather(*(appender.append(c) for c in calls), return_exceptions=True)

        results = asyncio.run(run())
        assert [type(r) for r in results] == [float, float, InvalidEventError, float]
    assert sorted(stored(tmp_path)) == ["r0", "r1", "r3"]  # nothing of the refused call, not even its good event


def test_an_invalid_call_on_an_idle_appender_fails_in_its_caller_and_nothing_is_written(tmp_path: Path) -> None:
    with open_store(tmp_path).writer("w") as writer:
        counted = Counted(writer)
        appender = BatchAppender(counted.append, writer.stage)
        with pytest.raises(InvalidEventError, match="status"):
            asyncio.run(appender.append([status("ok"), {"kind": "status", "group_id": "g", "rollout_id": "bad"}]))
        assert counted.calls == []  # refused by its own staging, before it was handed over
        asyncio.run(appender.append([status("after")]))
    assert stored(tmp_path) == ["after"]


@pytest.mark.parametrize("stage", [False, True], ids=["commit-converts", "caller-stages"])
def test_a_caller_that_goes_away_does_not_stop_the_others(tmp_path: Path, stage: bool) -> None:
    with open_store(tmp_path).writer("w") as writer:
        appender = appender_of(writer.append, writer, stage)

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


def test_a_call_after_close_is_refused_and_nothing_of_it_is_written(tmp_path: Path) -> None:
    with open_store(tmp_path).writer("w") as writer:
        appender = BatchAppender(writer.append, writer.stage)
        asyncio.run(appender.append([status("before")]))
        appender.close()
        with pytest.raises(RuntimeError, match="stopping: nothing was recorded"):
            asyncio.run(appender.append([status("after")]))  # the commit thread is idle: it would have been staged
    assert stored(tmp_path) == ["before"]  # not staged either: the writer's close would have written it


def test_callers_on_two_event_loops_are_each_released(tmp_path: Path) -> None:
    with open_store(tmp_path).writer("w") as writer:
        appender = BatchAppender(writer.append, writer.stage)

        async def calls(name: str) -> None:
            await asyncio.gather(*(appender.append([status(f"{name}{i}")]) for i in range(10)))

        threads = [threading.Thread(target=asyncio.run, args=(calls(name),)) for name in "ab"]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not any(thread.is_alive() for thread in threads)
        appender.close()
    assert sorted(stored(tmp_path)) == sorted(f"{name}{i}" for name in "ab" for i in range(10))
