"""The task file of `trajstore collect`: JSON lines or Parquet, loaded and checked before any work starts.

A task is a JSON object the agent and the reward read. The runner itself needs only:

    {"prompt": "What is 2+3?"}                                   a user message, or
    {"messages": [{"role": "system", "content": "..."}, ...]}    a whole conversation, or
    {"env": "my_envs:GuessNumber"}                                 a text environment whose first
             observation is the prompt (played by `collectors.envs.text_gym:agent`), or
    {"verifiers": {"taskset": "my_taskset", "idx": 0}}            a verifiers environment's task
             (played by `collectors.envs.verifiers:agent`)
    "id":    optional, a string or integer; default: a hash of the task's content, so the
             same task keeps its id across runs (resuming needs that)
    "files": optional {relative path: text}, written into the rollout's working directory
    "timeout_s": optional seconds for this task's agent (and, separately, its reward), instead
             of --rollout-timeout

Anything else ("answer", "tests", ...) is passed through to the agent and the reward as is.
Every bad line is reported at once, with its line (or Parquet row) number.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path, PurePosixPath
from typing import Any

from collectors.errors import CollectorError

MAX_REPORTED = 20


class TaskFileError(CollectorError, ValueError):
    """The task file cannot be used; the message lists every bad line."""


def task_id(task: dict[str, Any]) -> str:
    """The task's `id` as text, or a stable hash of its content."""
    if task.get("id") is not None:
        return str(task["id"])
    canonical = json.dumps(task, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return "t-" + hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _file_problem(files: Any) -> str | None:
    if not isinstance(files, dict):
        return "`files` must be an object {relative path: text}"
    for name, text in files.items():
        path = PurePosixPath(name)
        if not name or path.is_absolute() or ".." in path.parts:
            return f"`files` path {name!r} must be relative and stay inside the working directory"
        if not isinstance(text, str):
            return f"`files`[{name!r}] must be text, got {type(text).__name__}"
    return None


def task_problems(task: Any) -> list[str]:
    """What is wrong with one task (empty when it is usable)."""
    if not isinstance(task, dict):
        return [f"a task must be a JSON object, got {type(task).__name__}"]
    out = []
    prompt, messages = task.get("prompt"), task.get("messages")
    if prompt is None and messages is None and task.get("env") is None and task.get("verifiers") is None:
        out.append("needs `prompt` (text), `messages` (a list of {role, content}), `verifiers` (a verifiers "
                   "environment's task) or `env` (a text environment)")
    if prompt is not None and not isinstance(prompt, str):
        out.append(f"`prompt` must be text, got {type(prompt).__name__}")
    if messages is not None and not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)):
        out.append("`messages` must be a non-empty list of objects with a `role`")
    if task.get("id") is not None and (isinstance(task["id"], bool) or not isinstance(task["id"], (str, int))
                                       or task["id"] == ""):
        out.append(f"`id` must be a non-empty string or an integer, got {task['id']!r}")
    timeout = task.get("timeout_s")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        out.append(f"`timeout_s` must be a positive number of seconds, got {timeout!r}")
    if task.get("files") is not None:
        problem = _file_problem(task["files"])
        if problem:
            out.append(problem)
    return out


def _rows(path: Path) -> list[tuple[str, Any]]:
    """(where, parsed value or the parse error) for each non-blank line or row."""
    if path.suffix.lower() in (".parquet", ".pq"):
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
        return [(f"row {i + 1}", {k: v for k, v in row.items() if v is not None}) for i, row in enumerate(rows)]
    out: list[tuple[str, Any]] = []
    # Lines end at "\n" only: splitlines() also splits inside JSON strings holding U+2028 or U+0085.
    for number, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
        if not line.strip():
            continue
        try:
            out.append((f"line {number}", json.loads(line)))
        except json.JSONDecodeError as exc:
            out.append((f"line {number}", ValueError(f"not valid JSON ({exc.msg} at column {exc.colno})")))
    return out


def load_tasks(path: str | Path) -> list[dict[str, Any]]:
    """Read and check a task file; raises TaskFileError listing every bad line."""
    path = Path(path)
    if not path.is_file():
        raise TaskFileError(f"task file {path} does not exist; pass --tasks with a .jsonl or .parquet file")
    try:
        rows = _rows(path)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise TaskFileError(f"could not read task file {path}: {exc}") from exc
    problems: list[str] = []
    tasks: list[dict[str, Any]] = []
    seen: dict[str, str] = {}
    for where, value in rows:
        found = [str(value)] if isinstance(value, Exception) else task_problems(value)
        if not found:
            tid = task_id(value)
            if tid in seen:
                found = [f"task id {tid!r} repeats {seen[tid]}; give each task its own `id`"]
            seen.setdefault(tid, where)
        if found:
            problems.extend(f"{where}: {p}" for p in found)
        else:
            tasks.append(value)
    if problems:
        shown = problems[:MAX_REPORTED]
        more = f"\n  ... and {len(problems) - MAX_REPORTED} more" if len(problems) > MAX_REPORTED else ""
        raise TaskFileError(f"task file {path} has {len(problems)} problem(s); nothing was run:\n  "
                            + "\n  ".join(shown) + more)
    if not tasks:
        raise TaskFileError(f"task file {path} holds no tasks; write one JSON object per line, e.g. "
                            '{"id": "t1", "prompt": "What is 2+3?", "answer": "5"}')
    return tasks


def chat_messages(task: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation a task starts with: its `messages`, or its `prompt` as one user message."""
    if task.get("messages") is not None:
        return [dict(m) for m in task["messages"]]
    if task.get("prompt") is None:
        raise TaskFileError(f"task {task_id(task)!r} has no prompt or messages: its conversation comes from the "
                            "text environment it names (`env`); collect it with --agent collectors.envs.text_gym:agent")
    return [{"role": "user", "content": task["prompt"]}]


def write_files(task: dict[str, Any], workdir: Path) -> None:
    """Write the task's `files` into `workdir` (paths were checked when the file was loaded)."""
    for name, text in (task.get("files") or {}).items():
        target = workdir / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
