"""`trajstore collect`: run an agent over a task file, N rollouts per task, every model call captured.

    settings = CollectSettings(store="runs/s", run="exp1", tasks="tasks.jsonl", model="tiny-model",
                               agent="my_env:agent", reward="my_env:reward", n=4)
    summary = run_collect(settings)           # or: await collect(settings, stop=event)

Each (task, epoch) is one group of `n` rollouts (GRPO's unit). Rollouts run concurrently
(`concurrency`), each through the capture proxy (`collectors.collect.rollout`); a failed or timed-out
attempt is retried in the same slot up to `retries` times. Around that:

- resume (`collectors.collect.resume`): groups the store already has complete are skipped, partly
  done ones get only their missing slots; orphans of a dead collector are closed as aborted;
- staleness (`collectors.collect.admission`): with `max_staleness`, a group starts only when the
  learner will train it at most K versions after the version that samples it;
- hot reload (`collectors.collect.reload`): the store is polled for the learner's checkpoints and
  each newer one is loaded into the policy server (again when a restarted server reports an older one);
- outages: a model call that cannot reach the policy server waits for it (the proxy's
  `collectors.proxy.upstream`, up to 300 s) instead of failing its rollout; the progress line
  counts the calls waiting;
- shutdown: when `stop` is set (SIGINT/SIGTERM in `run_collect`) no new work starts,
  in-flight rollouts are closed as aborted ("interrupted"): their agents (commands with their
  whole process group) are cancelled, and closing a rollout cancels its model calls in flight
  (the server drops them), so nothing waits for replies nobody reads; then `collect` returns;
  running the same settings again resumes.

The policy server is `server` (embedded, or vLLM with `vllm=True`) or, without one, an
embedded server started in-process on `model`, or with `vllm=True` a vLLM started on `model`
from its own virtualenv (`collectors.policy.vllm_server`) and stopped at the end. Several
collectors can share one vLLM: the one with `vllm_reload="weights"` reloads it, the others
(`"follow"`) stamp each turn with the version vLLM reports (`collectors.policy.vllm_client`).
The proxy is `proxy` or one started in-process. With an external proxy, it must write to the
same store.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import signal
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from collectors.agents.context import load_object, shared_http_client
from collectors.collect.progress import CollectSummary, Progress, show
from collectors.collect.reload import Reloader, served_version
from collectors.collect.rewards import load_reward
from collectors.collect.rollout import Job, ProxyLink, RolloutEnv
from collectors.collect.scheduler import Collection
from collectors.collect.settings import CollectSettings
from collectors.collect.sources import generate
from collectors.collect.tasks import TaskFileError, load_tasks
from collectors.errors import CollectorError
from collectors.policy import PolicyClient
from trajstore import Store, artifacts, new_id, open_store

__all__ = ["CollectSettings", "CollectSummary", "collect", "run_collect"]

log = logging.getLogger(__name__)
LORA_MAX_RANK = 64  # --max-lora-rank of a vLLM started for LoRA reloads: adapters up to this rank load


def _sampling(settings: CollectSettings) -> Any:
    def per_job(job: Job) -> dict[str, Any]:
        out: dict[str, Any] = {"temperature": settings.temperature, "top_p": settings.top_p}
        if settings.top_k:
            out["extra_body"] = {"top_k": settings.top_k}  # vLLM's extension; the OpenAI SDK passes it through
        if settings.seed is not None:  # every slot and attempt its own draw, the same on a rerun
            key = f"{settings.seed}/{job.task_id}/{job.epoch}/{job.slot}/{job.attempt}".encode()
            out["seed"] = int.from_bytes(hashlib.sha256(key).digest()[:4], "big") >> 1
        return out

    return per_job


def _plugins(settings: CollectSettings) -> tuple[Any, Any, list[str]]:
    """The agent and reward callables; import errors are reported with the other problems."""
    agent = reward = None
    problems = []
    try:
        if settings.agent:
            agent = load_object(settings.agent, what="agent")
        elif settings.tools:
            from collectors.agents.tool_agent import tool_agent
            from collectors.agents.tools import load_tools

            agent = tool_agent(load_tools(settings.tools))
    except (ValueError, TypeError) as exc:
        problems.append(str(exc))
    try:
        reward = load_reward(settings.reward_spec) if settings.reward_spec else None
    except (ValueError, TypeError) as exc:
        problems.append(str(exc))
    return agent, reward, problems


def _checkpoint_cache(settings: CollectSettings) -> Path:
    """Where this host keeps copies of versions published on other hosts (--checkpoint-cache)."""
    return Path(settings.checkpoint_cache) if settings.checkpoint_cache else artifacts.default_cache()


async def _start_policy(settings: CollectSettings, stack: AsyncExitStack, workdir: Path) -> PolicyClient:
    from collectors.policy import EmbeddedClient

    if settings.vllm:
        return await _start_vllm_client(settings, stack, workdir)
    if settings.server is not None:
        return EmbeddedClient(settings.server, control_token=settings.control_token)
    from collectors.embedded.app import start_server
    from collectors.embedded.engine import Engine

    engine = await asyncio.to_thread(Engine, settings.model, device=settings.device, max_batch=settings.max_batch,
                                     policy_version=settings.policy_version, threads=settings.threads)
    stack.callback(engine.close)
    # the reloader names published versions by URI: this server fetches them into the collector's cache
    runner, url = await start_server(engine, checkpoint_cache=_checkpoint_cache(settings))
    stack.push_async_callback(runner.cleanup)
    return EmbeddedClient(url)


async def _start_vllm_client(settings: CollectSettings, stack: AsyncExitStack, workdir: Path) -> PolicyClient:
    """A VLLMClient on `server`, or on a vLLM started here on `model` (LoRA enabled when it reloads adapters)."""
    from collectors.policy import VLLMClient
    from collectors.policy.vllm_server import start_vllm

    url = settings.server
    if url is None:
        workdir.mkdir(parents=True, exist_ok=True)
        log.warning("starting vLLM on %s (its log: %s)", settings.model, workdir / "vllm.log")
        server = await asyncio.to_thread(start_vllm, settings.model,  # type: ignore[arg-type]
                                         lora_rank=LORA_MAX_RANK if settings.vllm_reload == "lora" else None,
                                         log_path=workdir / "vllm.log")
        stack.callback(server.stop)
        url = server.url
    client = VLLMClient(url, policy_version=settings.policy_version, reload=settings.vllm_reload)  # type: ignore[arg-type]
    if settings.vllm_reload != "lora":
        await client.served_label()  # a follower starts from the version the server serves now
    return client


async def _start_proxy(settings: CollectSettings, store: Store, client: PolicyClient, stack: AsyncExitStack,
                       collector: str) -> str:
    from collectors.proxy.app import ProxyConfig, start_proxy

    model_dir = settings.model
    if model_dir is None:  # an embedded server on this machine names its checkpoint directory
        from collectors.policy import EmbeddedClient

        names = await client.models()
        model_dir = next((n for n in names if (Path(n) / "config.json").is_file()), None)
        if model_dir is None or not isinstance(client, EmbeddedClient):
            raise ValueError(f"the policy server at {client.base_url} serves {names}, not a checkpoint directory on "
                             "this machine; pass --model DIR (its tokenizer and chat template render the prompts)")
    # the collector's id in the name: two collect() calls of one process must not share a writer
    config = ProxyConfig(model_dir=model_dir, run=settings.run,
                         writer=store.unique_writer_name(f"collect-{collector}-"),
                         model_names=("*",), seal_interval=settings.seal_interval)
    runner, url = await start_proxy(lambda: client, store, config)
    stack.push_async_callback(runner.cleanup)
    return url


def _display_mode(settings: CollectSettings) -> str:
    if settings.display != "auto":
        return settings.display
    return "live" if sys.stderr.isatty() else "plain"


async def collect(settings: CollectSettings, *, stop: asyncio.Event | None = None) -> CollectSummary:
    """Collect rollouts as `settings` say until the work is done or `stop` is set (see the module docstring)."""
    problems = settings.problems()
    agent, reward, plugin_problems = _plugins(settings)
    problems += plugin_problems
    tasks: list[dict[str, Any]] = []
    if settings.tasks and Path(settings.tasks).is_file():
        try:
            tasks = load_tasks(settings.tasks)
        except TaskFileError as exc:
            problems.append(str(exc))
    elif settings.env and not problems:  # generating imports the package: only once the settings are sound
        try:
            tasks = generate(settings.env, settings.env_count, settings.env_seed, settings.env_config)
        except CollectorError as exc:
            problems.append(str(exc))
    if problems:
        raise ValueError("cannot collect:\n  - " + "\n  - ".join(problems))
    stop = stop or asyncio.Event()
    progress = Progress(settings.run, scored=reward is not None or settings.reward_cmd is not None)
    workdir = Path(settings.workdir or Path(tempfile.gettempdir()) / f"trajstore-{settings.run}").resolve()
    async with AsyncExitStack() as stack:
        client = await _start_policy(settings, stack, workdir)
        stack.push_async_callback(client.aclose)
        await client.models()  # a dead or wrong --server is named now, before any rollout is opened
        store = open_store(settings.store)
        # a collector of this machine that died left acknowledged events only here: seal them for the others
        orphans = await asyncio.to_thread(store.seal_orphans)
        if any(orphans.values()):
            log.warning("sealed what stopped writers of this machine had left unsealed: %s", orphans)
        collector = new_id()[-12:]  # random part: names it in started statuses (admission) and its writer
        proxy_url = settings.proxy or await _start_proxy(settings, store, client, stack, collector)
        link = ProxyLink(proxy_url)
        stack.push_async_callback(link.aclose)
        http = None
        if settings.agent_cmd is None:  # a Python agent: its SDK clients share one pool for the whole run
            http = shared_http_client(settings.concurrency)
            stack.push_async_callback(http.aclose)
        env = RolloutEnv(run=settings.run, link=link, workdir=workdir,
                         timeout_s=settings.rollout_timeout, model=await link.model_name(),
                         max_turns=settings.max_turns, max_tokens=settings.max_tokens, sampling=_sampling(settings),
                         agent=agent, agent_cmd=settings.agent_cmd, reward=reward, reward_cmd=settings.reward_cmd,
                         command_env=settings.command_env, keep_workdirs=settings.keep_workdirs, http_client=http,
                         collector=collector)
        reloader = Reloader(client, await served_version(client, settings.policy_version), _checkpoint_cache(settings))
        run = Collection(settings, store, env, reloader, progress, stop, needs_reward=progress.scored)
        await run.poll_once()  # the learner's newest checkpoint is loaded before the first rollout
        progress.started = time.monotonic()  # rates count collection, not start-up
        done = asyncio.Event()

        async def proxy_stats() -> None:  # forks, and model calls waiting out a policy-server outage
            with contextlib.suppress(Exception):
                stats = await link.stats()
                progress.forks = int(stats["forks"]["total"])
                progress.server_waits = int(stats.get("upstream", {}).get("waiting", 0))

        helpers = [asyncio.create_task(run.poll_forever(done)),
                   asyncio.create_task(show(progress, _display_mode(settings), done, proxy_stats))]
        try:
            await run.schedule(tasks)
        finally:
            await env.workdirs.drain()
            await proxy_stats()
            done.set()
            await asyncio.gather(*helpers, return_exceptions=True)
    return progress.summary(interrupted=stop.is_set())


def run_collect(settings: CollectSettings) -> CollectSummary:
    """`collect` in a fresh event loop; SIGINT and SIGTERM stop it cleanly (a second signal: at once)."""

    async def main() -> CollectSummary:
        stop, loop = asyncio.Event(), asyncio.get_running_loop()

        def on_signal(signum: int) -> None:
            log.warning("%s: stopping; in-flight rollouts are closed as aborted (again to quit at once)",
                        signal.Signals(signum).name)
            stop.set()
            loop.remove_signal_handler(signum)

        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, on_signal, signum)
        try:
            return await collect(settings, stop=stop)
        finally:
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(signum)

    return asyncio.run(main())

