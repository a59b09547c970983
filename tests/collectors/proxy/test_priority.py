"""Threads for huge calls' work run at a lower CPU priority, or as any other thread where that cannot be set."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from collectors.proxy import priority
from collectors.proxy.priority import HEAVY_NICE, heavy_pool


def nice_of_this_thread() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice value is Linux's")
def test_a_heavy_thread_runs_at_a_raised_nice_value_and_the_others_do_not() -> None:
    before = nice_of_this_thread()
    with heavy_pool("test-heavy", threads=1) as pool:
        heavy = pool.submit(nice_of_this_thread).result()
    assert heavy == min(before + HEAVY_NICE, 19)
    assert nice_of_this_thread() == before  # the process and its other threads keep theirs


def test_where_the_priority_cannot_be_set_the_threads_run_as_any_other(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(*args: object) -> None:
        raise PermissionError("setpriority: operation not permitted")

    monkeypatch.setattr(priority.os, "setpriority", refused)
    assert priority.lower_priority() is False
    with heavy_pool("test-heavy", threads=1) as pool:
        assert pool.submit(lambda: 6 * 7).result() == 42
    monkeypatch.setattr(priority.sys, "platform", "darwin")
    assert priority.lower_priority() is False
