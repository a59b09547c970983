"""External programs of a rollout (`--agent-cmd`, `--reward-cmd`): run in the rollout's directory, killed whole.

The command runs through the shell in its own session (process group), so cancelling it
(timeout, Ctrl-C) kills it and everything it started with one SIGKILL to the group. Its
environment is this process's plus the rollout's (OPENAI_BASE_URL, OPENAI_API_KEY,
ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY, TRAJSTORE_*). Output is read as it comes: stdout is
kept up to `MAX_STDOUT` characters (its end, where agents print their answer), and the last
`TAIL` characters of stdout and stderr go into the status meta.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

TAIL = 2000
MAX_STDOUT = 1 << 20
READ_AFTER_KILL_S = 5.0


@dataclass(frozen=True)
class CommandResult:
    exit_code: int
    stdout: str  # up to MAX_STDOUT characters, the end kept
    stdout_tail: str
    stderr_tail: str

    @property
    def tail(self) -> str:
        """Both streams' tails, labelled, for an error message or the status meta."""
        parts = [f"[stdout] {self.stdout_tail}" if self.stdout_tail else "",
                 f"[stderr] {self.stderr_tail}" if self.stderr_tail else ""]
        return "\n".join(p for p in parts if p)[-TAIL:] or "(no output)"


async def _drain(stream: asyncio.StreamReader | None, keep: int) -> str:
    if stream is None:
        return ""
    kept = bytearray()
    while chunk := await stream.read(65536):
        kept += chunk
        if len(kept) > 2 * keep:
            del kept[:-keep]
    return kept[-keep:].decode("utf-8", errors="replace")


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


async def run_command(command: str, *, cwd: Path, env: Mapping[str, str]) -> CommandResult:
    """Run `command` to its end; on cancellation its whole process group is killed first."""
    proc = await asyncio.create_subprocess_shell(
        command, cwd=cwd, env={**os.environ, **env}, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True)
    readers = asyncio.gather(_drain(proc.stdout, MAX_STDOUT), _drain(proc.stderr, TAIL))
    try:
        code = await proc.wait()
    except asyncio.CancelledError:
        _kill_group(proc.pid)
        await asyncio.shield(_reap(proc, readers))
        raise
    _kill_group(proc.pid)  # the shell is gone; whatever it left running in its group goes with it
    out, err = await _reap(proc, readers)
    return CommandResult(exit_code=code, stdout=out, stdout_tail=out[-TAIL:], stderr_tail=err[-TAIL:])


async def _reap(proc: asyncio.subprocess.Process, readers: asyncio.Future[list[str]]) -> tuple[str, str]:
    await proc.wait()
    try:  # a process that left the group may still hold the pipes open: do not wait on it forever
        out, err = await asyncio.wait_for(readers, READ_AFTER_KILL_S)
    except TimeoutError:
        return "", "(output lost: a process the command started kept its pipes open)"
    return out, err
