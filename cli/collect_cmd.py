"""`trajstore collect` and `trajstore reward`: thin click shells over collectors.collect.runner and collectors.collect.rewards."""

from __future__ import annotations

import logging
import sys
from typing import Any

import click

from cli.options import control_token_option, seal_interval_option, setting_default, store_option
from cli.output import CommandConsole
from collectors.collect.settings import VLLM_RELOADS, CollectSettings


def _default(name: str) -> Any:
    return setting_default(CollectSettings, name)


@click.command("collect")
@store_option
@click.option("--run", required=True, help="Run name: the rollouts, the learner and its checkpoints share it.")
@click.option("--tasks", "tasks_file", type=click.Path(dir_okay=False),
              help="Task file: JSON lines or Parquet; each task has `prompt` or `messages`, optional `id` and `files`.")
@click.option("--env", metavar="PACKAGE:NAME",
              help="Instead of --tasks: tasks an environment package generates, scored by its own reward unless "
                   "--reward is given; reasoning_gym:NAME takes any reasoning-gym generator (e.g. leg_counting).")
@click.option("--env-count", type=int, default=_default("env_count"), show_default=True,
              help="With --env: tasks to generate.")
@click.option("--env-seed", type=int, default=_default("env_seed"), show_default=True,
              help="With --env: the generator's seed (the same seed, the same tasks: a rerun resumes them).")
@click.option("--env-config", metavar="JSON", help="With --env: the generator's options, a JSON object.")
@click.option("--n", type=int, default=_default("n"), show_default=True, help="Rollouts per task (one group).")
@click.option("--model", type=click.Path(file_okay=False),
              help="Checkpoint directory: served in-process unless --server is given; its tokenizer renders prompts.")
@click.option("--server", metavar="URL", help="A running policy server (`trajstore serve`, or vLLM with --vllm).")
@click.option("--vllm", is_flag=True,
              help="Sample from vLLM: the one at --server, or one started on --model from .venv-vllm (`make vllm`).")
@click.option("--vllm-reload", type=click.Choice(VLLM_RELOADS), default=_default("vllm_reload"), show_default=True,
              help="weights: this collector reloads vLLM's weights (one per server); follow: another collector "
                   "does, turns carry the version vLLM reports; lora: load the learner's adapters at runtime.")
@control_token_option("The --control-token of the `trajstore serve` at --server, to reload it from another machine.")
@click.option("--proxy", metavar="URL", help="An external capture proxy writing to the same store (default: in-process).")
@click.option("--agent", metavar="MODULE:FN", help="Python agent: async def agent(task, ctx) -> result.")
@click.option("--tools", metavar="MOD:FN,...", help="The built-in tool-calling agent with these tools.")
@click.option("--agent-cmd", metavar="CMD",
              help="External agent, run per rollout in its directory with OPENAI_BASE_URL, OPENAI_API_KEY, "
                   "ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY and TRAJSTORE_TASK_FILE set; its stdout is the result.")
@click.option("--reward", metavar="MODULE:FN", help="reward(task, result, rollout) -> float or {name: float}; or a "
              "shipped one by name: math_verify, reasoning_gym.")
@click.option("--reward-cmd", metavar="CMD", help="Test command run in the rollout's directory: exit 0 = 1.0, else 0.0.")
@click.option("--pass-env", metavar="NAME", multiple=True,
              help="Let --agent-cmd and --reward-cmd see this variable of collect's environment (repeatable; NAME* "
                   "a prefix). By default they see only PATH, HOME, locale, temp and virtualenv paths and the "
                   "rollout's own variables: no credentials.")
@click.option("--inherit-env", is_flag=True,
              help="Let --agent-cmd and --reward-cmd see all of collect's environment (its credentials included).")
@click.option("--no-reward", is_flag=True,
              help="Collect unscored rollouts on purpose; they are not trainable until `trajstore reward` scores them.")
@click.option("--concurrency", type=int, default=_default("concurrency"), show_default=True, help="Rollouts in flight at once.")
@click.option("--rollout-timeout", type=float, default=_default("rollout_timeout"), show_default=True,
              help="Seconds an agent (and, separately, its reward) may take; then it is aborted and retried.")
@click.option("--retries", type=int, default=_default("retries"), show_default=True,
              help="New attempts for a rollout that failed or timed out (same group, same slot).")
@click.option("--max-turns", type=int, default=_default("max_turns"), show_default=True, help="Model calls an agent may make.")
@click.option("--max-tokens", type=int, default=_default("max_tokens"), show_default=True, help="Sampled tokens per model call.")
@click.option("--temperature", type=float, default=_default("temperature"), show_default=True)
@click.option("--top-p", type=float, default=_default("top_p"), show_default=True)
@click.option("--top-k", type=click.IntRange(min=0), default=_default("top_k"), show_default=True, help="0: off.")
@click.option("--seed", type=int, help="Seeds every call (each slot and attempt its own, the same on a rerun).")
@click.option("--epochs", type=int, default=_default("epochs"), show_default=True, help="Passes over the tasks (a group per pass).")
@click.option("--forever", is_flag=True, help="Cycle over the tasks, epoch after epoch, until interrupted.")
@click.option("--follow", is_flag=True,
              help="Wait for the learner to announce itself, then collect like --forever as it publishes.")
@click.option("--max-staleness", type=int,
              help="Start a group only if the learner will train it at most K versions after the one sampling it.")
@click.option("--groups-per-version", type=int, help="The learner's groups per step (default: its announcement).")
@click.option("--poll-interval", type=float, default=_default("poll_interval_s"), show_default=True,
              help="Seconds between reads of the store for the learner's newest version and the groups it holds.")
@click.option("--workdir", type=click.Path(file_okay=False),
              help="Parent of the per-rollout directories (default: <tmp>/trajstore-RUN).")
@click.option("--keep-workdirs", is_flag=True, help="Keep usable rollouts' directories (failed ones are always kept).")
@click.option("--checkpoint-cache", type=click.Path(file_okay=False), metavar="DIR",
              help="Where checkpoints the learner published on another host are fetched to (default: "
                   "$TRAJSTORE_CHECKPOINT_CACHE or ~/.cache/trajstore/checkpoints).")
@click.option("--policy-version", type=int, default=_default("policy_version"), show_default=True,
              help="Version of the weights the server starts with (in-process server, or vLLM).")
@click.option("--device", default=_default("device"), show_default=True, help="In-process server: auto, cpu, cuda, cuda:1.")
@click.option("--max-batch", type=int, default=_default("max_batch"), show_default=True, help="In-process server: batch size.")
@click.option("--threads", type=int, help="In-process server: torch CPU threads.")
@click.option("--plain", is_flag=True, help="One progress line every few seconds instead of the live table.")
@seal_interval_option(_default("seal_interval"))
def collect(store_loc: str, run: str, tasks_file: str | None, env: str | None, env_count: int, env_seed: int,
            env_config: str | None, n: int, model: str | None, server: str | None, vllm: bool,
            vllm_reload: str, control_token: str | None, proxy: str | None, agent: str | None, tools: str | None, agent_cmd: str | None,
            reward: str | None, reward_cmd: str | None, pass_env: tuple[str, ...], inherit_env: bool,
            no_reward: bool, concurrency: int, rollout_timeout: float,
            retries: int, max_turns: int, max_tokens: int, temperature: float, top_p: float, top_k: int,
            seed: int | None, epochs: int,
            forever: bool, follow: bool, max_staleness: int | None, groups_per_version: int | None, poll_interval: float,
            workdir: str | None, keep_workdirs: bool, checkpoint_cache: str | None, policy_version: int, device: str,
            max_batch: int, threads: int | None, plain: bool, seal_interval: float) -> None:
    """Run an agent over a task file, N rollouts per task, every model call stored token-exact.

    Each task becomes a group of N rollouts; each rollout goes through the capture proxy,
    gets a reward and a final status (completed, truncated, aborted or failed). Failed and
    timed-out rollouts are retried. Ctrl-C closes in-flight rollouts as aborted; the same
    command again resumes where it stopped, and groups already complete are never redone.
    New learner checkpoints are hot-reloaded into the policy server as they appear.

    \b
    Example:
      trajstore init-model tiny-model
      trajstore collect --store runs/s --run exp1 --tasks tasks.jsonl --model tiny-model \\
          --agent my_env:agent --reward my_env:reward --n 4 --max-staleness 2
      trajstore collect ... --env reasoning_gym:leg_counting --env-count 64   # reasoning-gym's tasks and scoring
      trajstore collect ... --model tiny-model --vllm          # vLLM started here (make vllm)
      trajstore collect ... --model tiny-model --vllm --server http://127.0.0.1:8000 --vllm-reload follow
    """
    from collectors.collect.progress import summary_table
    from collectors.collect.runner import run_collect

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = CollectSettings(
        store=store_loc, run=run, tasks=tasks_file, n=n, server=server, vllm=vllm, vllm_reload=vllm_reload,
        model=model, proxy=proxy, control_token=control_token,
        concurrency=concurrency, rollout_timeout=rollout_timeout, max_turns=max_turns, max_tokens=max_tokens,
        temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, epochs=epochs, forever=forever, follow=follow,
        agent=agent, tools=tools, agent_cmd=agent_cmd, reward=reward, reward_cmd=reward_cmd, no_reward=no_reward,
        pass_env=pass_env, inherit_env=inherit_env,
        retries=retries,
        max_staleness=max_staleness, groups_per_version=groups_per_version, workdir=workdir,
        keep_workdirs=keep_workdirs, display="plain" if plain else "auto", policy_version=policy_version,
        device=device, max_batch=max_batch, threads=threads, checkpoint_cache=checkpoint_cache,
        seal_interval=seal_interval, poll_interval_s=poll_interval, env=env, env_count=env_count, env_seed=env_seed,
        env_config=env_config)
    summary = run_collect(settings)
    CommandConsole().print(summary_table(summary))
    if summary.interrupted:
        sys.exit(130)
    if summary.groups_incomplete:
        raise click.ClickException(f"{summary.groups_incomplete} group(s) still lack a usable rollout in some slot "
                                   "after every retry (see the errors: trajstore query \"SELECT rollout_id, error "
                                   "FROM rollouts WHERE status = 'failed'\"); run the same command again to retry "
                                   "those slots")


@click.command("reward")
@store_option
@click.option("--run", required=True, help="The run whose rollouts to score.")
@click.option("--reward", "reward_spec", required=True, metavar="MODULE:FN",
              help="reward(task, result, rollout) -> float or {name: float}; or math_verify, reasoning_gym.")
@click.option("--tasks", "tasks_file", type=click.Path(exists=True, dir_okay=False),
              help="Task file, for rollouts whose task was too large to store with them (matched by id).")
@click.option("--name", default="reward", show_default=True, help="Reward name for a float return value.")
@click.option("--where", metavar="SQL",
              help="Which rollouts (a condition on the rollouts view); default: status IN ('completed', 'truncated').")
def reward(store_loc: str, run: str, reward_spec: str, tasks_file: str | None, name: str, where: str | None) -> None:
    """Score finished rollouts again and append the new reward events.

    The task comes from the rollout's started status (or --tasks), the result from its final
    status (or the text of its last turn). A new reward event of the same name supersedes
    the old one, so the `rollouts` view shows the new score at once.

    \b
    Example:
      trajstore reward --store runs/s --run exp1 --reward my_env:reward_v2 --where "reward < 1"
    """
    import trajstore
    from collectors.collect.rewards import rescore

    store = trajstore.open_store(store_loc, create=False)
    summary = rescore(store, run, reward_spec, tasks_file=tasks_file, name=name, where=where)
    mean = "-" if summary.mean is None else f"{summary.mean:.4f}"
    click.echo(f"scored {summary.scored} rollouts of run {run} (mean reward {mean}); skipped {len(summary.skipped)}")
    for rollout_id, why in summary.skipped[:20]:
        click.echo(f"  {rollout_id}: {why}")
