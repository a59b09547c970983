"""`trajstore demo`: the closed loop on one CPU machine, from a random model to a better one.

The only module that joins collectors and learner (they never import each other: they meet in
the store and the checkpoint directory), so it lives with the CLI. It runs the real commands as real processes,
exactly as a user would, and prints each one:

1. `trajstore init-model`: a tiny random Qwen2 with its own tokenizer (no downloads);
2. a short supervised warm start on worked packing episodes (`learner.sft` over
   `collectors.envs.packing.warm_start_conversations`): the random model learns the format
   and the tool protocol (call the forecast, repeat the weather, name an item) from a weak
   demonstrator that packs the right item in 3 episodes of 10 (a random wrong one otherwise),
   so version 0 packs the right item about 30% of the time (any input-blind policy: 25%);
3. `trajstore learn` and `trajstore collect --follow` side by side on one store: the
   collector runs the built-in tool agent with the forecast tool through the capture proxy
   and the embedded server, admits rollouts only within `max_staleness` versions of the
   learner, and hot-reloads every checkpoint the learner publishes;
4. a summary from the store by SQL: the `correct` rate by policy version with a 95% Wilson
   interval (`correct_by_version`), tokens, rollouts and steps; a PNG plot of it; one failed
   rollout of version 0 and one solved rollout of the newest versions, to replay side by
   side; and the next commands to try.

`DemoSettings` is the one preset: `trajstore demo` uses it as is (`--engine` only changes
who serves the model), `DemoSettings.quick` is the CI-sized loop of the same task.

The demo is budgeted by learner steps: it stops when the learner has published its last
version, however long that takes on this machine; the collector is then interrupted, which
marks its in-flight rollouts aborted. The time limit is only a safety net: when it fires (or
the learner stops early, short of data), the result says so (`DemoResult.cut_short`), the demo
prints it plainly, and `trajstore demo` exits non-zero.
"""

from __future__ import annotations

import math
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import NormalDist
from typing import Any, get_args

import torch

from collectors.children import spawn_child
from collectors.envs import packing
from collectors.model.build import ModelSize, init_model
from learner.settings import LossName
from learner.sft import warm_start
from trajstore import open_store

RUN = "demo"
DEMO_LOSSES = tuple(n for n in get_args(LossName) if n != "distill")  # what the loop can run: it has no teacher


@dataclass(frozen=True)
class DemoSettings:
    """One closed-loop demo; `quick()` is the CI-sized version of the same loop."""

    directory: Path
    seed: int = 0
    # 2 layers, 2 heads of 32 dimensions (vLLM's CPU attention takes no smaller), untied LM head (vLLM reloads it
    # whole); sized for 10 minutes on an idle 2-core machine: a learner step of 8 groups took about 2.5 s at load 2
    size: ModelSize = ModelSize(vocab_size=2048, hidden_size=64, layers=2, heads=2, kv_heads=1,
                                intermediate_size=192, max_positions=1024)
    engine: str = "embedded"  # the collector's policy server: the embedded one, or "vllm" (collect --vllm)
    warm_start_examples: int = 2000
    warm_start_steps: int = 400
    warm_start_lr: float = 1e-2
    warm_start_batch: int = 16
    warm_start_right: float = 0.3  # the share of worked episodes that pack the right item (a weak demonstrator)
    tasks: int = 1024
    n: int = 8  # rollouts per task: one GRPO group
    groups_per_step: int = 8  # 2 groups of each weather on average: a gradient that points the same way step to step
    steps: int = 90
    publish_every: int = 1
    max_staleness: int = 1
    lr: float = 2e-3  # 3e-3 broke the reply format for a few versions in 2 seeds of 3; 1e-3 learned too slowly
    warmup_steps: int = 10  # learn --warmup-steps
    kl_coef: float = 0.0  # learn --kl-coef: k3 KL to the warm-started model
    loss: str = "ppo"  # learn --loss: any but distill (the loop has no teacher)
    temperature: float = 1.0
    max_tokens: int = 48
    max_turns: int = 3
    concurrency: int = 16
    # collect + learn: a safety net, not the budget (the steps are); 6-8 minutes on 2 idle cores, over 20 on a
    # loaded machine, so a limit that only a hang reaches
    time_limit_s: float = 3600.0

    def problems(self) -> list[str]:
        out = [f"{name} must be >= 1, got {value}" for name, value in asdict(self).items()
               if isinstance(value, int) and name not in ("seed", "warmup_steps") and value < 1]
        out += [f"{name} must be > 0, got {value}" for name, value in asdict(self).items()
                if isinstance(value, float) and value <= 0 and name != "kl_coef"]
        if not self.warm_start_right <= 1:
            out.append(f"warm_start_right is a share of episodes, in (0, 1]; got {self.warm_start_right}")
        if self.kl_coef < 0:
            out.append(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.loss not in DEMO_LOSSES:
            out.append(f"loss must be one of {list(DEMO_LOSSES)}, got {self.loss!r} (distill needs a teacher's "
                       "annotations: run `trajstore annotate` and `trajstore learn --loss distill` on a store)")
        out += self.size.problems()
        if self.engine not in ("embedded", "vllm"):
            out.append(f"engine must be 'embedded' or 'vllm', got {self.engine!r}")
        elif self.engine == "vllm":
            out += [f"the model cannot run on vLLM: {p}" for p in self.size.vllm_problems()]
        if self.directory.exists() and any(self.directory.iterdir()):
            out.append(f"{self.directory} exists and is not empty; pass a new --dir (or delete it) so the demo "
                       "starts from a random model")
        return out

    @classmethod
    def quick(cls, directory: Path, seed: int = 0) -> DemoSettings:
        """The CI-sized loop (tests/cli/test_demo.py): the same task and warm start, 40 learner steps."""
        return cls(directory, seed=seed, steps=40)


@dataclass
class DemoResult:
    directory: Path
    store: Path
    plot: Path | None
    by_version: list[dict[str, Any]]
    steps: int
    rollouts: int
    tokens: int
    seconds: float
    commands: list[str] = field(default_factory=list)
    planned_steps: int = 0
    cut_short: str | None = None  # why the loop ended before the learner's last step (time limit, no data)
    failure: str | None = None  # a rollout of version 0 that packed the wrong item, to replay
    success: str | None = None  # a rollout of the last quarter of versions that packed the right one


def _cli(*args: Any) -> list[str]:
    return [sys.executable, "-m", "cli.main", *map(str, args)]


def _shown(cmd: list[str]) -> str:
    return "trajstore " + shlex.join(cmd[3:])


def commands(s: DemoSettings, model: Path) -> dict[str, list[str]]:
    """The two concurrent commands of the loop, exactly as run."""
    d = s.directory
    learn = _cli("learn", "--store", d / "store", "--run", RUN, "--model", model, "--checkpoints", d / "checkpoints",
                 "--max-staleness", s.max_staleness, "--groups-per-step", s.groups_per_step, "--steps", s.steps,
                 "--publish-every", s.publish_every, "--lr", s.lr, "--warmup-steps", s.warmup_steps, "--kl-coef", s.kl_coef,
                 "--loss", s.loss, "--seed", s.seed, "--wait-timeout", s.time_limit_s)  # a slow collector is waited for, not cut
    collect = _cli("collect", "--store", d / "store", "--run", RUN, "--tasks", d / "tasks.jsonl", "--n", s.n,
                   "--model", model, "--tools", "collectors.envs.packing:forecast",
                   "--reward", "collectors.envs.packing:reward",
                   "--max-turns", s.max_turns, "--max-tokens", s.max_tokens, "--temperature", s.temperature,
                   "--concurrency", s.concurrency, "--max-staleness", s.max_staleness,
                   "--groups-per-version", s.groups_per_step * s.publish_every, "--follow", "--plain",
                   "--seed", s.seed, "--workdir", d / "work",  # rollouts' directories and vLLM's log
                   *(["--vllm"] if s.engine == "vllm" else []))
    return {"learn": learn, "collect": collect}


def run_demo(s: DemoSettings, say: Callable[[str], None] = print) -> DemoResult:
    problems = s.problems()
    if problems:
        raise ValueError("invalid demo settings: " + "; ".join(problems))
    started = time.monotonic()
    d = s.directory
    d.mkdir(parents=True, exist_ok=True)
    say(f"[1/4] init-model: a random {s.size.layers}-layer Qwen2 and its tokenizer -> {d / 'base'}")
    init_model(d / "base", s.size, seed=s.seed)
    say(f"[2/4] warm start: {s.warm_start_steps} supervised steps on {s.warm_start_examples} worked packing "
        f"episodes (the right item in {s.warm_start_right:.0%}, a random wrong one otherwise) -> {d / 'warm'}")
    threads = torch.get_num_threads()
    # one thread, as the loop's processes get (OMP_NUM_THREADS=1): a tiny model gains little from two, and on
    # a busy machine the second one spin-waits (measured on 2 shared cores at load ~10: 7.5 s a step with
    # two threads, 0.2 s with one)
    torch.set_num_threads(1)
    try:
        warm_start(d / "base", d / "warm", packing.warm_start_conversations(s.warm_start_examples, seed=s.seed,
                                                                     right=s.warm_start_right),
                   steps=s.warm_start_steps, lr=s.warm_start_lr, batch_size=s.warm_start_batch, seed=s.seed)
    finally:
        torch.set_num_threads(threads)
    packing.write_tasks(d / "tasks.jsonl", s.tasks, seed=s.seed + 1)
    cmds = commands(s, d / "warm")
    say("[3/4] collect and learn, concurrently on one store:")
    for name, cmd in cmds.items():
        say(f"      {_shown(cmd)}")
    deadline = time.monotonic() + s.time_limit_s
    logs = {name: open(d / f"{name}.log", "w") for name in cmds}  # noqa: SIM115 - closed below
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    store = open_store(d / "store")  # created here: `learn` refuses a store that does not exist
    procs = {name: spawn_child(cmd, stdout=logs[name], stderr=subprocess.STDOUT, env=env)  # die with the demo
             for name, cmd in cmds.items()}
    try:
        last = ""
        while procs["learn"].poll() is None and time.monotonic() < deadline:
            if procs["collect"].poll() is not None:
                raise ChildProcessError(f"the collector stopped (exit {procs['collect'].returncode}); see "
                                   f"{d / 'collect.log'}")
            time.sleep(2.0)
            line = _progress(store)
            if line != last:
                say("      " + line)
                last = line
    finally:
        stopped = [name for name in ("collect", "learn") if procs[name].poll() is None]  # by us, at the time limit
        for name in stopped:
            procs[name].send_signal(signal.SIGINT)
        for name, proc in procs.items():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            logs[name].close()
    if "learn" not in stopped and procs["learn"].returncode != 0:
        raise ChildProcessError(f"the learner failed (exit {procs['learn'].returncode}); see {d / 'learn.log'}")
    say("[4/4] summary")
    result = _summary(s, store, time.monotonic() - started, [_shown(c) for c in cmds.values()])
    result.cut_short = cut_short(s, result.steps, timed_out="learn" in stopped)
    if result.cut_short:
        say(f"      CUT SHORT: {result.cut_short}")
    return result


def cut_short(s: DemoSettings, steps: int, timed_out: bool) -> str | None:
    """Why a loop that made `steps` learner steps of `s.steps` ended early; None when it ran them all."""
    if timed_out:
        return (f"the time limit ({s.time_limit_s / 60:g} min) stopped the demo at learner step {steps} of {s.steps}, "
                "so its numbers are those of a shorter run; this machine is slower than the limit allows: give it "
                "more time (--minutes) or fewer steps (--steps)")
    if steps < s.steps:
        return (f"the learner stopped at step {steps} of {s.steps}: it waited {s.time_limit_s / 60:g} min without a "
                f"full step of new groups (see {s.directory / 'learn.log'} and {s.directory / 'collect.log'})")
    return None


def _progress(store: Any) -> str:
    row = store.query("""
        SELECT (SELECT coalesce(max(version), 0) FROM checkpoints WHERE run = $run) AS version,
               (SELECT count(*) FROM rollouts WHERE run = $run AND trainable) AS rollouts,
               (SELECT avg(reward) FROM rollouts WHERE run = $run AND trainable AND min_version = (
                    SELECT max(min_version) FROM rollouts WHERE run = $run AND trainable)) AS reward
    """, {"run": RUN}).to_pylist()[0]
    reward = "-" if row["reward"] is None else f"{row['reward']:.3f}"
    return f"learner at version {row['version']}, {row['rollouts']} rewarded rollouts, latest version's reward {reward}"


def wilson(successes: float, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of a success rate (hand-written: five lines, where scipy or
    statsmodels would be a dependency for one formula). Unlike the normal interval it stays in
    [0, 1] and is not empty at a rate of 0 or 1, which the first and last versions reach."""
    if n == 0:
        return 0.0, 1.0
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def correct_by_version(store: Any) -> list[dict[str, Any]]:
    """Per policy version, its rollouts (complete groups only): how many, the `correct` rate with
    its 95% Wilson interval (`low`, `high`), the share that called the forecast tool, the mean
    reward, tokens, and the mean staleness at which the learner trained on them."""
    rows = store.query("""
        WITH r AS (SELECT o.rollout_id, o.min_version AS version, o.reward, o.tokens
                   FROM rollouts o JOIN groups g USING (run, group_id)
                   WHERE o.run = $run AND o.trainable AND g.complete),
             c AS (SELECT rollout_id, version AS consumed_by FROM consumed WHERE run = $run),
             k AS (SELECT rollout_id, last(reward ORDER BY time) FILTER (WHERE reward_name = 'correct') AS correct
                   FROM events WHERE kind = 'reward' AND run = $run GROUP BY rollout_id),
             t AS (SELECT rollout_id, count(*) > 1 AS called FROM turns WHERE run = $run GROUP BY rollout_id)
        SELECT r.version, count(*) AS rollouts, coalesce(sum(k.correct), 0) AS solved,
               avg(CASE WHEN t.called THEN 1.0 ELSE 0.0 END) AS called_tool, avg(r.reward) AS reward,
               sum(r.tokens)::BIGINT AS tokens, avg(c.consumed_by - 1 - r.version) AS staleness
        FROM r LEFT JOIN c USING (rollout_id) LEFT JOIN k USING (rollout_id) LEFT JOIN t USING (rollout_id)
        GROUP BY r.version ORDER BY r.version
    """, {"run": RUN}).to_pylist()
    for row in rows:
        row["correct"] = row["solved"] / row["rollouts"]
        row["low"], row["high"] = wilson(row["solved"], row["rollouts"])
    return rows


def last_quarter(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The pooled `correct` rate (and interval) of the last quarter of the versions in `rows`."""
    tail = rows[len(rows) - max(1, len(rows) // 4):]
    solved, n = sum(r["solved"] for r in tail), sum(r["rollouts"] for r in tail)
    low, high = wilson(solved, n)
    return {"versions": [r["version"] for r in tail], "rollouts": n, "correct": solved / n if n else 0.0,
            "low": low, "high": high}


def _example(store: Any, where: str) -> str | None:
    rows = store.query(f"""
        SELECT o.rollout_id FROM rollouts o JOIN events e USING (rollout_id)
        WHERE o.run = $run AND o.trainable AND e.kind = 'reward' AND e.reward_name = 'correct' AND {where}
        ORDER BY o.min_version DESC, o.rollout_id LIMIT 1""", {"run": RUN}).to_pylist()
    return rows[0]["rollout_id"] if rows else None


def _summary(s: DemoSettings, store: Any, seconds: float, shown: list[str]) -> DemoResult:
    rows = correct_by_version(store)
    totals = store.query("""
        SELECT (SELECT count(*) FROM rollouts WHERE run = $run) AS rollouts,
               (SELECT coalesce(sum(tokens), 0) FROM rollouts WHERE run = $run)::BIGINT AS tokens,
               (SELECT coalesce(max(step), 0) FROM events WHERE kind = 'metric' AND run = $run) AS steps
    """, {"run": RUN}).to_pylist()[0]
    late = last_quarter(rows)["versions"][0] if rows else 0
    failure = _example(store, "o.min_version = 0 AND e.reward = 0")
    success = _example(store, f"o.min_version >= {int(late)} AND e.reward = 1")
    plot = plot_by_version(rows, s.directory / "correct_by_version.png") if rows else None
    return DemoResult(s.directory, s.directory / "store", plot, rows, int(totals["steps"]), int(totals["rollouts"]),
                      int(totals["tokens"]), seconds, shown, s.steps, failure=failure, success=success)


def plot_by_version(rows: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    versions = [r["version"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.fill_between(versions, [r["low"] for r in rows], [r["high"] for r in rows], alpha=0.25,
                    label="95% interval (Wilson)")
    ax.plot(versions, [r["correct"] for r in rows], marker="o", label="correct: packed the right item")
    ax.plot(versions, [r["called_tool"] for r in rows], linestyle="--", color="gray", label="called the forecast")
    ax.axhline(1 / 4, color="red", linestyle=":", label="best without reading the forecast (1/4)")
    ax.set_xlabel("policy version that sampled the rollouts")
    ax.set_ylabel("rate")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("trajstore demo: correct by policy version")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
