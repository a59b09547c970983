"""Servers this project starts die with the process that started them (issue 20, item 13).

A real parent process starts a real `trajstore serve` through `spawn_child` (the launcher vLLM,
the demo and the tests use) and is then killed with SIGKILL, or SIGTERM without a handler (how a
killed pytest dies): nothing of the parent runs after that, yet the server must be gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.collectors.fake_vllm import free_port

REPO = Path(__file__).resolve().parents[2]
PARENT = textwrap.dedent("""
    import subprocess, sys, time
    from collectors.children import spawn_child
    child = spawn_child([sys.executable, "-m", "cli.main", "serve", "--model", sys.argv[1], "--port", sys.argv[2],
                         "--device", "cpu", "--threads", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(child.pid, flush=True)
    time.sleep(600)
""")


def running(pid: int) -> bool:
    """The process exists and is not a zombie waiting for its (new) parent to reap it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_a_server_dies_with_its_killed_parent(tiny_model: Path, how: signal.Signals) -> None:
    port = free_port()
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tiny_model), str(port)], cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())  # type: ignore[union-attr]
    try:
        deadline = time.monotonic() + 120
        while not (Path(f"/proc/{child}/cmdline").exists() and b"serve" in Path(f"/proc/{child}/cmdline").read_bytes()):
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        parent.send_signal(how)
        parent.wait(30)
        deadline = time.monotonic() + 60
        while running(child):
            assert time.monotonic() < deadline, f"the server (pid {child}) outlived its parent killed by {how.name}"
            time.sleep(0.1)
    finally:
        if running(child):
            os.kill(child, signal.SIGKILL)
        if parent.poll() is None:
            parent.kill()
