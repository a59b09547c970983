"""Threads for the work of huge calls, at a lower CPU priority than the rest of the proxy.

Rendering and tokenizing a call of megabytes takes seconds of a core (a tokenizer reads a few MB
a second). On a machine whose cores are all busy, that competes with every other session's
work in the same process: the kernel shares the cores out evenly among runnable threads. A
thread that runs such work at a raised nice value yields the cores to the others while they have
work, and still runs at full speed on cores nobody else wants: nice only matters under contention.

On Linux a thread's nice value is its own (`setpriority` on its native thread id). Elsewhere, or
where the system refuses (a sandbox), these threads run at the process's priority, as any other.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger(__name__)
HEAVY_NICE = 10  # added to the process's nice value (19 at most)
HEAVY_THREADS = 2  # huge calls rendered at once; more wait their turn, off the event loop


def lower_priority(by: int = HEAVY_NICE) -> bool:
    """Raise the calling thread's nice value by `by`; False where a thread's priority is not its own to set."""
    if not sys.platform.startswith("linux") or not hasattr(os, "setpriority"):
        return False  # elsewhere PRIO_PROCESS with a thread id names a process, or nothing
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(os.getpriority(os.PRIO_PROCESS, tid) + by, 19))
    except OSError as exc:
        log.debug("could not lower the priority of thread %d: %s", tid, exc)
        return False
    return True


def heavy_pool(name: str, threads: int = HEAVY_THREADS) -> ThreadPoolExecutor:
    """A thread pool whose threads run at a lower priority (`lower_priority`) than the process's other threads."""
    return ThreadPoolExecutor(threads, thread_name_prefix=name, initializer=lower_priority)
