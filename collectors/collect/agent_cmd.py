"""External programs of a rollout (`--agent-cmd`, `--reward-cmd`): run in the rollout's directory, killed whole.

The command runs through the shell in its own session (process group), so cancelling it
(timeout, Ctrl-C) kills it and everything it started with one SIGKILL to the group.

Its environment is scrubbed (`CommandEnv`): a reward command often runs code the model wrote,
and an agent is a program of its own, so neither sees the collector's cloud credentials, API
keys or control token. It gets the rollout's own variables (OPENAI_BASE_URL, OPENAI_API_KEY,
ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY, TRAJSTORE_*), and of this process's environment only
what running programs needs (`INHERITED`: PATH, HOME, locale, terminal, temp directory, the
active virtualenv or conda prefix, PYTHONPATH, NODE_PATH, CA bundles, XDG directories). More is
an explicit opt-in: `collect --pass-env NAME` (repeatable; `NAME*` passes a prefix, e.g.
`AWS_*`), or `--inherit-env` for all of it (except TRAJSTORE_CONTROL_TOKEN, which only a
`--pass-env` naming it passes). Output is read as it comes: stdout is
kept up to `MAX_STDOUT` characters (its end, where agents print their answer), and the last
`TAIL` characters of stdout and stderr go into the status meta.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

INHERITED = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "TERM", "COLORTERM", "NO_COLOR", "LANG", "LANGUAGE", "TZ",
    "TMPDIR", "TEMP", "TMP", "XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME", "XDG_RUNTIME_DIR",
    "VIRTUAL_ENV", "CONDA_PREFIX", "CONDA_DEFAULT_ENV", "PYTHONPATH", "PYTHONHOME", "PYTHONUTF8",
    "PYTHONIOENCODING", "PYTHONDONTWRITEBYTECODE", "TOKENIZERS_PARALLELISM", "HF_HOME",
    "NODE_PATH", "NVM_DIR", "NVM_BIN", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS",
})  # what an agent CLI or a test runner needs to start; no credential among them
INHERITED_PREFIXES = ("LC_",)
NEVER_INHERITED = frozenset({"TRAJSTORE_CONTROL_TOKEN"})  # passed only by a --pass-env naming it
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\*?")
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


@dataclass(frozen=True)
class CommandEnv:
    """Which of this process's variables a rollout's commands see (see the module docstring)."""

    pass_env: tuple[str, ...] = ()  # names, or prefixes ending in `*`, passed besides INHERITED
    inherit_all: bool = False

    def problems(self) -> list[str]:
        return [f"--pass-env {name!r} is not a variable name (letters, digits, _; a trailing * passes every name "
                "it starts)" for name in self.pass_env if not ENV_NAME.fullmatch(name)]

    def passes(self, name: str) -> bool:
        if any(name == n or n.endswith("*") and name.startswith(n[:-1]) for n in self.pass_env):
            return True
        if name in NEVER_INHERITED:
            return False
        return self.inherit_all or name in INHERITED or name.startswith(INHERITED_PREFIXES)

    def build(self, rollout: Mapping[str, str], source: Mapping[str, str] | None = None) -> dict[str, str]:
        """The whole environment of a command: the passed variables of `source` (this process's), then the
        rollout's own."""
        source = os.environ if source is None else source
        return {**{k: v for k, v in source.items() if self.passes(k)}, **rollout}


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
    """Run `command` to its end with exactly the environment `env` (`CommandEnv.build`); on cancellation its
    whole process group is killed first."""
    proc = await asyncio.create_subprocess_shell(
        command, cwd=cwd, env=dict(env), stdin=asyncio.subprocess.DEVNULL,
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
