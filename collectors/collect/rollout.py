"""One attempt at one rollout: open it at the capture proxy, run the agent, score it, close it.

    open   POST {proxy}/rollouts  -> the started status (task, epoch, slot, attempt in its meta)
    run    the agent in `{workdir}/{rollout_id}` (task files written there), under a time limit
    score  the reward function or command (only after a usable agent run)
    close  POST {proxy}/rollouts/{id}/close -> reward events + the final status (meta: timings,
           the agent command's exit status and output tail, the result when small)

What the rollout's turns hold (the last finish reason, which decides `truncated`; output
tokens and policy versions, for the progress display) comes from the proxy, which counts
every turn it stores: its GET /rollouts/{id} before the close and the close's answer. No
store query: at hundreds of rollouts a second those cost more CPU than the rollouts.

Outcomes: `completed`; `truncated` when the agent called `ctx.truncate` or its last model
call stopped at max_tokens; `aborted` on the time limit (retried) or on shutdown (not
retried, the next run resumes it); `failed` when the agent or the reward raised, or the
agent command exited non-zero (retried). Retrying is the caller's business (`Outcome.retry`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
import traceback
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import asdict, dataclass, field, is_dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from collectors.agents.context import AgentContext, RolloutInfo
from collectors.collect.agent_cmd import CommandEnv, CommandResult, run_command
from collectors.collect.rewards import call_reward, command_reward
from collectors.collect.tasks import chat_messages, write_files
from collectors.errors import CollectorError
from trajstore import new_id

if TYPE_CHECKING:
    import httpx2

log = logging.getLogger(__name__)
MAX_STORED_TASK = 8192  # characters of JSON: smaller tasks are stored whole in the started status
MAX_STORED_RESULT = 16384
TASK_FILE = ".trajstore-task.json"
RESULT_FILE = ".trajstore-result.txt"


class ProxyError(CollectorError):
    """The capture proxy refused or failed a rollout call."""


@dataclass(frozen=True)
class Opened:
    rollout_id: str
    group_id: str
    api_key: str
    base_urls: dict[str, str]


class ProxyLink:
    """The runner's side of the proxy's rollout routes (one aiohttp session)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120))
        return self._session

    async def _call(self, method: str, route: str, body: Any = None, key: str | None = None) -> Any:
        headers = {"Authorization": f"Bearer {key}"} if key else None
        try:
            async with self._http().request(method, self.url + route, json=body, headers=headers) as resp:
                text = await resp.text()
                if resp.status >= 400:
                    raise ProxyError(f"the capture proxy at {self.url} refused {method} {route} ({resp.status}): "
                                     f"{text[:500]}")
                return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProxyError(f"{self.url} answered {method} {route} with something that is not JSON; is it a "
                             "trajstore capture proxy?") from exc
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ProxyError(f"the capture proxy at {self.url} did not answer {method} {route} ({exc!r}); is it "
                             "running? (`trajstore proxy ...`, or leave --proxy out to run one in-process)") from exc

    async def open(self, *, run: str, group_id: str, rollout_id: str, group_size: int,
                   meta: dict[str, Any]) -> Opened:
        body = await self._call("POST", "/rollouts", {"run": run, "group_id": group_id, "rollout_id": rollout_id,
                                                      "group_size": group_size, "meta": meta})
        return Opened(body["rollout_id"], body["group_id"], body["api_key"], body["base_urls"])

    async def facts(self, opened: Opened) -> Facts:
        """What the proxy has stored of the rollout's turns so far."""
        return self._facts(await self._call("GET", f"/rollouts/{opened.rollout_id}", key=opened.api_key))

    async def close(self, opened: Opened, *, status: str, rewards: dict[str, float], error: str | None,
                    meta: dict[str, Any]) -> Facts:
        """Close the rollout; what it stored of its turns, all of them."""
        return self._facts(await self._call("POST", f"/rollouts/{opened.rollout_id}/close",
                                            {"status": status, "rewards": rewards, "error": error, "meta": meta},
                                            key=opened.api_key))

    def _facts(self, summary: Any) -> Facts:
        if not isinstance(summary, dict):
            raise ProxyError(f"the capture proxy at {self.url} answered a rollout summary that is not a JSON object: "
                             f"{str(summary)[:200]}")
        return facts_of(summary)

    async def stats(self) -> dict[str, Any]:
        return await self._call("GET", "/stats")

    async def model_name(self) -> str:
        """A `model` value the proxy accepts (the first it lists)."""
        try:
            data = (await self._call("GET", "/v1/models")).get("data") or []
        except ProxyError:
            return "policy"
        return str(data[0]["id"]) if data else "policy"

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


@dataclass(frozen=True)
class Facts:
    """What a rollout's stored turns hold, as the capture proxy counted them."""

    finish_reason: str | None = None  # of its last turn (main session first)
    turns: int = 0
    output_tokens: int = 0
    min_version: int | None = None
    max_version: int | None = None


def facts_of(summary: dict[str, Any]) -> Facts:
    """The facts in a rollout summary of the proxy (`collectors.proxy.sessions.Rollout.summary`)."""
    return Facts(summary.get("finish_reason"), int(summary.get("turns") or 0), int(summary.get("output_tokens") or 0),
                 summary.get("min_policy_version"), summary.get("max_policy_version"))


class Workdirs:
    """Removes finished rollouts' working directories in the background, many per worker thread: a slot
    does not wait for it, and on some file systems a rmdir alone takes milliseconds. `drain` waits
    until everything handed over is gone."""

    def __init__(self) -> None:
        self._doomed: list[Path] = []
        self._worker: asyncio.Task[None] | None = None

    def remove(self, path: Path) -> None:
        self._doomed.append(path)
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._work())

    async def _work(self) -> None:
        while self._doomed:
            batch, self._doomed = self._doomed, []
            await asyncio.to_thread(_remove_all, batch)

    async def drain(self) -> None:
        while self._worker is not None and not self._worker.done():
            await self._worker


def _remove_all(paths: list[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


@dataclass(frozen=True)
class Job:
    """One attempt to fill one slot of one group."""

    task: dict[str, Any]
    task_id: str
    epoch: int
    group_id: str
    slot: int
    attempt: int
    group_size: int
    version: int  # the policy version served when the group was admitted


AgentFn = Callable[[dict[str, Any], AgentContext], Awaitable[Any]]


@dataclass(frozen=True)
class RolloutEnv:
    """Everything an attempt needs besides its job (shared by all attempts of a run)."""

    run: str
    link: ProxyLink
    workdir: Path
    timeout_s: float
    model: str
    max_turns: int
    max_tokens: int
    sampling: Callable[[Job], dict[str, Any]]  # per-attempt sampling arguments (the seed varies)
    agent: AgentFn | None = None  # a Python agent, or
    agent_cmd: str | None = None  # an external command
    reward: Callable[..., Any] | None = None
    reward_cmd: str | None = None
    command_env: CommandEnv = CommandEnv()  # what of this process's environment the commands see
    keep_workdirs: bool = False
    workdirs: Workdirs = field(default_factory=Workdirs)  # removes usable rollouts' directories
    http_client: httpx2.AsyncClient | None = None  # one pool for every rollout's SDK clients (`shared_http_client`)
    collector: str = ""  # this collector's id, in each started status (other collectors of the run count it)


@dataclass(frozen=True)
class Outcome:
    status: str  # completed | truncated | aborted | failed
    rewards: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    retry: bool = False
    facts: Facts = Facts()
    rollout_id: str | None = None


async def bounded(coro: Coroutine[Any, Any, Any], timeout_s: float, stop: asyncio.Event) -> tuple[str, Any]:
    """Run `coro` until it ends, the time limit passes or `stop` is set: ("ok", value), ("error", exc),
    ("timeout", None) or ("stopped", None). A coroutine cut short is cancelled and given a moment to clean up."""
    task = asyncio.ensure_future(coro)
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopper}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
    if task.done():
        if task.cancelled():
            return "error", asyncio.CancelledError("the agent cancelled itself")
        exc = task.exception()
        return ("error", exc) if exc is not None else ("ok", task.result())
    task.cancel()
    await asyncio.wait({task}, timeout=10)  # an agent stuck in blocking code cannot be cancelled: move on
    return ("stopped" if stop.is_set() else "timeout"), None


def _describe(what: str, exc: BaseException) -> tuple[str, str]:
    """(error text for people, traceback tail for the meta)."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return f"{what} raised {type(exc).__name__}: {exc}", tb[-2000:]


def _jsonable(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        value = asdict(value)
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        return None
    return value if len(text) <= MAX_STORED_RESULT else None


def _result_text(result: Any) -> str:
    return result if isinstance(result, str) else json.dumps(result, default=str)


def _prepare_workdir(task: dict[str, Any], workdir: Path, task_json: str) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    write_files(task, workdir)
    (workdir / TASK_FILE).write_text(task_json)


async def chat_agent(task: dict[str, Any], ctx: AgentContext) -> str:
    """The default agent: one model call on the task's conversation; returns the reply text."""
    reply = await ctx.openai.chat.completions.create(model=ctx.model, messages=chat_messages(task),
                                                     max_tokens=ctx.max_tokens, **ctx.sampling)
    return reply.choices[0].message.content or ""


async def play(job: Job, env: RolloutEnv, stop: asyncio.Event) -> Outcome:
    """Run one attempt from open to close; never raises for the agent's or the reward's failures."""
    rollout_id = new_id()
    workdir = env.workdir / rollout_id
    meta: dict[str, Any] = {"task_id": job.task_id, "epoch": job.epoch, "slot": job.slot, "attempt": job.attempt,
                            "policy_version": job.version, "workdir": str(workdir),
                            **({"collector": env.collector} if env.collector else {})}
    task_json = json.dumps(job.task, default=str)
    opened = await env.link.open(run=env.run, group_id=job.group_id, rollout_id=rollout_id, group_size=job.group_size,
                                 meta={**meta, **({"task": job.task} if len(task_json) <= MAX_STORED_TASK else {})})
    info = RolloutInfo(run=env.run, group_id=job.group_id, rollout_id=opened.rollout_id, slot=job.slot,
                       attempt=job.attempt, workdir=workdir, policy_version=job.version)
    ctx = AgentContext(info, opened.base_urls, opened.api_key, env.model, env.max_turns, env.max_tokens,
                       env.sampling(job), http_client=env.http_client)
    started = time.monotonic()
    try:
        try:
            outcome = await _run(job, env, opened, ctx, workdir, task_json, meta, stop)
        except Exception as exc:  # noqa: BLE001 - e.g. the task's files could not be written: still close it
            error, meta["traceback"] = _describe("preparing or finishing the rollout", exc)
            outcome = Outcome("failed", error=error, retry=True)
        meta["seconds"] = round(time.monotonic() - started, 3)
        facts = await asyncio.shield(env.link.close(opened, status=outcome.status, rewards=outcome.rewards,
                                                    error=outcome.error, meta=meta))
    finally:
        await ctx.aclose()
    if outcome.status in ("completed", "truncated") and not env.keep_workdirs:
        env.workdirs.remove(workdir)
    return Outcome(outcome.status, outcome.rewards, outcome.error, outcome.retry, facts, opened.rollout_id)


async def _run(job: Job, env: RolloutEnv, opened: Opened, ctx: AgentContext, workdir: Path, task_json: str,
               meta: dict[str, Any], stop: asyncio.Event) -> Outcome:
    # in a thread, as they are removed: file system calls can take milliseconds, the event loop's time
    await asyncio.to_thread(_prepare_workdir, job.task, workdir, task_json)
    own = {**ctx.env(), "TRAJSTORE_TASK_FILE": str(workdir / TASK_FILE), "TRAJSTORE_TASK_ID": job.task_id,
               "TRAJSTORE_RUN": env.run, "TRAJSTORE_GROUP_ID": job.group_id, "TRAJSTORE_SLOT": str(job.slot),
               "TRAJSTORE_ATTEMPT": str(job.attempt), "TRAJSTORE_WORKDIR": str(workdir)}
    cmd_env = env.command_env.build(own)  # scrubbed: no credential of this process reaches the commands

    timeout_s = float(job.task.get("timeout_s") or env.timeout_s)
    if env.agent_cmd is not None:
        kind, value = await bounded(run_command(env.agent_cmd, cwd=workdir, env=cmd_env), timeout_s, stop)
    else:
        kind, value = await bounded((env.agent or chat_agent)(job.task, ctx), timeout_s, stop)
    if kind == "stopped":
        return Outcome("aborted", error="interrupted")
    if kind == "timeout":
        where = "the task's timeout_s" if job.task.get("timeout_s") else "--rollout-timeout"
        return Outcome("aborted", error=f"timed out after {timeout_s:g} s ({where})", retry=True)
    if kind == "error":
        error, meta["traceback"] = _describe("the agent", value)
        return Outcome("failed", error=error, retry=True)
    result, info = value, ctx.rollout
    if isinstance(value, CommandResult):
        meta.update(agent_exit=value.exit_code, agent_output=value.tail)
        if value.exit_code != 0:
            return Outcome("failed", error=f"the agent command exited with status {value.exit_code}: {value.tail}",
                           retry=True)
        result = value.stdout
        info = replace(info, agent_output=value.tail, agent_exit=value.exit_code)
    stored = _jsonable(result)
    if stored is not None:
        meta["result"] = stored

    rewards: dict[str, float] = {}
    if env.reward is not None or env.reward_cmd is not None:
        if env.reward is not None:
            scoring = call_reward(env.reward, job.task, result, info)
        else:
            (workdir / RESULT_FILE).write_text(_result_text(result))
            scoring = command_reward(env.reward_cmd or "", workdir,
                                     {**cmd_env, "TRAJSTORE_RESULT_FILE": str(workdir / RESULT_FILE)})
        kind, value = await bounded(scoring, timeout_s, stop)
        if kind == "stopped":
            return Outcome("aborted", error="interrupted")
        if kind == "timeout":
            return Outcome("failed", error=f"the reward took longer than {timeout_s:g} s", retry=True)
        if kind == "error":
            error, meta["traceback"] = _describe("the reward", value)
            return Outcome("failed", error=error, retry=True)
        if env.reward is not None:
            rewards = value
        else:
            rewards, extra = value
            meta.update(extra)

    reason = ctx.truncated
    if reason is None and (await env.link.facts(opened)).finish_reason == "length":
        reason = "max_tokens"
    if reason:
        meta["truncated"] = reason
    return Outcome("truncated" if reason else "completed", rewards)
