"""Child processes that do not outlive the process that started them (`spawn_child`).

A server this process starts (vLLM, `trajstore serve`, the demo's collector and learner) must
stop when this process stops, however it stops. An orderly exit stops them in `finally` blocks;
a SIGKILL, or a SIGTERM to a process with no handler (pytest, a killed test run), runs none.
On Linux each child therefore asks the kernel, between fork and exec, for a signal when its
parent dies (`prctl(PR_SET_PDEATHSIG)`), SIGTERM by default so that it shuts down cleanly
(vLLM stops its engine processes, `trajstore serve` and the proxy seal what they wrote); a
parent already gone by then ends the child at once.

Limits: the kernel sends the signal when the *thread* that started the child ends, so start
long-lived children from a thread that lives as long as they should (the main thread, or a
worker of the event loop's default executor, which lives until the loop closes). The signal
reaches the child only; a child that starts processes of its own in another session stops them
itself (vLLM and the trajstore servers do). Elsewhere than Linux nothing is added: the children
are stopped by the orderly exits only.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

PR_SET_PDEATHSIG = 1
# looked up here, before any fork: the child between fork and exec only calls it
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def _tie_to(parent: int, sig: int) -> Callable[[], None]:
    """The pre-exec step of a child of `parent`: signal `sig` when it dies, or exit now if it already has."""

    def tie() -> None:
        if _prctl is not None:
            _prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:  # the parent died between fork and prctl: nobody would send the signal
            os._exit(1)

    return tie


def spawn_child(args: Sequence[str], *, death_signal: int = signal.SIGTERM, **popen: Any) -> subprocess.Popen[Any]:
    """`subprocess.Popen(args, **popen)` for a child that gets `death_signal` when this process dies."""
    return subprocess.Popen(args, preexec_fn=_tie_to(os.getpid(), death_signal), **popen)  # noqa: PLW1509 - see above
