"""verifiers (0.4) environments as `trajstore collect` rollouts: the environment runs in its own virtualenv,
its model calls go through the capture proxy, its rubric's rewards are stored.

verifiers pins openai<3 (the project has 3.x), so it lives in `.venv-envs` (`make envs`) and is
never imported here. Each rollout runs one episode of the task's verifiers environment with
verifiers' own runner (`vf-eval`, one task, one rollout) in that virtualenv, its client pointed at
this rollout's base URL of the capture proxy (`--client.base-url`, the rollout's key in
`--client.api-key-var`): every model call the environment's harness makes is a turn the proxy
samples and stores, tokens and logprobs as the policy sampled them, nothing re-rendered from
verifiers' trace. A task:

    {"id": "v1", "verifiers": {"taskset": "my_taskset", "idx": 0, "harness": "my_harness",
                               "path": "envs/", "args": ["--env.taskset.some-option", "3"]}}

    trajstore collect ... --tasks tasks.jsonl --agent collectors.envs.verifiers:agent \\
        --reward collectors.envs.verifiers:reward

`taskset` and `harness` are verifiers plugin ids (importable modules exporting a Taskset / a
Harness via `__all__`; `harness` defaults to the taskset's own), `idx` the task's position in the
taskset, `path` a directory put on the environment's PYTHONPATH (relative to collect's working
directory), `args` more `vf-eval` options. The episode runs in verifiers' `subprocess` runtime, with
no upload (`--no-push`), in the rollout's directory. `--max-tokens`, temperature and top_p are
passed as verifiers' sampling settings.

The result is `{"rewards": {name: score}, "weights": {name: weight}, "metrics": {...}, "calls": N,
"replies": [the sampled messages' text, in order]}` from verifiers' trace; the reward stores each rubric function as its own component, weighted
(`score * weight`), so the rollout's reward (their sum) is verifiers' weighted total. An episode
verifiers marks failed (a provider error, a harness crash) fails the rollout with its errors.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Any

from collectors.agents.context import AgentContext
from collectors.collect.agent_cmd import run_command
from collectors.envs.venv import envs_python
from collectors.errors import CollectorError

KEY = "verifiers"  # the task's field
KEY_VAR = "TRAJSTORE_ROLLOUT_KEY"  # the variable verifiers' client reads the rollout's key from
TRACES = "traces.jsonl"  # what vf-eval writes into its run directory


class VerifiersError(CollectorError, ValueError):
    """The task is not a verifiers task, or the episode failed."""


def spec(task: dict[str, Any]) -> dict[str, Any]:
    """The task's `verifiers` field, checked."""
    value = task.get(KEY)
    if not isinstance(value, dict) or not isinstance(value.get("taskset"), str) or not value["taskset"]:
        raise VerifiersError(f"task {task.get('id')!r} is not a verifiers task: it needs "
                             '{"verifiers": {"taskset": "MODULE", "idx": N, ...}}')
    if not isinstance(value.get("idx", 0), int) or value.get("idx", 0) < 0:
        raise VerifiersError(f"task {task.get('id')!r}: verifiers `idx` must be a task position (0, 1, ...)")
    if not isinstance(value.get("args", []), list) or not all(isinstance(a, str) for a in value.get("args", [])):
        raise VerifiersError(f"task {task.get('id')!r}: verifiers `args` must be a list of strings")
    return value


def command(task: dict[str, Any], ctx: AgentContext, out: Path) -> list[str]:
    """The vf-eval command line of one episode of `task` through this rollout's base URL."""
    s = spec(task)
    vf_eval = envs_python().parent / "vf-eval"
    args = [str(vf_eval), s["taskset"], "--select.include.idx", str(s.get("idx", 0)), "-n", "1", "-r", "1",
            "--env.agent.runtime.type", "subprocess", "--no-push", "-o", str(out),
            "--client.base-url", ctx.base_urls["openai"], "--client.api-key-var", KEY_VAR, "--model", ctx.model,
            "--sampling.max-tokens", str(ctx.max_tokens)]
    if s.get("harness"):
        args += ["--env.agent.harness.id", s["harness"]]
    for name in ("temperature", "top_p"):
        if name in ctx.sampling:
            args += [f"--sampling.{name.replace('_', '-')}", str(ctx.sampling[name])]
    return args + list(s.get("args", []))


def read_episode(out: Path) -> dict[str, Any]:
    """The one episode vf-eval wrote under `out`."""
    found = sorted(out.glob(f"*/{TRACES}"))
    lines = [json.loads(line) for f in found for line in f.read_text().splitlines() if line.strip()]
    if len(lines) != 1:
        raise VerifiersError(f"vf-eval wrote {len(lines)} episodes under {out}, expected 1")
    return lines[0]


def summarize(episode: dict[str, Any]) -> dict[str, Any]:
    """The result: the rubric's scores and weights, the metrics and the model calls of the episode's trace."""
    traces = episode.get("traces") or []
    problems = [e.get("message") for e in episode.get("errors", [])]
    problems += [e.get("message") for t in traces for e in t.get("errors", [])]
    if not episode.get("ok") or not traces:
        raise VerifiersError("the verifiers episode failed: " + ("; ".join(str(p) for p in problems if p)
                                                                  or "no trace"))
    rewards = {name: r for t in traces for name, r in (t.get("rewards") or {}).items()}
    return {"rewards": {n: float(r["score"]) for n, r in rewards.items()},
            "weights": {n: float(r.get("weight", 1.0)) for n, r in rewards.items()},
            "metrics": {n: m for t in traces for n, m in (t.get("metrics") or {}).items()},
            "calls": sum(len(t.get("calls") or []) for t in traces),
            "replies": [n["message"].get("content") for t in traces for n in t.get("nodes") or []
                        if n.get("sampled") and isinstance(n.get("message"), dict)]}


async def agent(task: dict[str, Any], ctx: AgentContext) -> dict[str, Any]:
    """Run one episode of the task's verifiers environment through this rollout (see the module docstring)."""
    out = ctx.workdir / "verifiers"
    path = Path(spec(task).get("path") or ".").resolve()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", str(ctx.workdir)),
           "PYTHONPATH": str(path), KEY_VAR: ctx.api_key}
    result = await run_command(shlex.join(command(task, ctx, out)), cwd=ctx.workdir, env=env)
    if result.exit_code != 0:
        raise VerifiersError(f"vf-eval exited with status {result.exit_code}: {result.tail}")
    return summarize(read_episode(out))


def reward(task: dict[str, Any], result: Any, rollout: Any = None) -> dict[str, float]:
    """Each rubric function's weighted score, as its own component (their sum is verifiers' reward)."""
    if not isinstance(result, dict) or not isinstance(result.get("rewards"), dict) or not result["rewards"]:
        raise VerifiersError("verifiers.reward scores the result of collectors.envs.verifiers:agent (its rubric's "
                             f"`rewards`); got {type(result).__name__}")
    weights = result.get("weights") or {}
    return {name: score * float(weights.get(name, 1.0)) for name, score in result["rewards"].items()}
