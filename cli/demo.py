"""`trajstore demo`: the closed loop on one CPU machine, from a random model to a better one.

The only module that joins collectors and learner (DESIGN.md: they meet in the store and the
checkpoint directory), so it lives with the CLI. It runs the real commands as real processes,
exactly as a user would, and prints each one:

1. `trajstore init-model`: a tiny random Qwen2 with its own tokenizer (no downloads);
2. a short supervised warm start on worked calculator episodes (`learner.sft` over
   `collectors.envs.arithmetic.warm_start_conversations`): the random model learns the
   tool-call format, not yet to copy digits reliably;
3. `trajstore learn` and `trajstore collect --follow` side by side on one store: the
   collector runs the built-in tool agent with the calculator through the capture proxy and
   the embedded server, admits rollouts only within `max_staleness` versions of the learner,
   and hot-reloads every checkpoint the learner publishes;
4. a summary from the store by SQL (reward by policy version, tokens, rollouts, steps), a
   PNG plot of reward and staleness by version, and the next commands to try.

The demo stops when the learner has published its last version (or at the time limit);
the collector is then interrupted, which marks its in-flight rollouts aborted.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from collectors.envs import arithmetic
from collectors.model.build import ModelSize, init_model
from learner.sft import warm_start
from trajstore import open_store

RUN = "demo"


@dataclass(frozen=True)
class DemoSettings:
    """One closed-loop demo; `quick()` is the CI-sized version of the same loop."""

    directory: Path
    seed: int = 0
    # 2 layers, 2 heads of 32 dimensions (vLLM's CPU attention takes no smaller): the whole loop fits 10 minutes
    # on 2 CPU cores (see arithmetic.py on copying)
    size: ModelSize = ModelSize(vocab_size=2048, hidden_size=64, layers=2, heads=2, kv_heads=1,
                                intermediate_size=192, max_positions=1024)
    engine: str = "embedded"  # the collector's policy server: the embedded one, or "vllm" (collect --vllm)
    warm_start_examples: int = 2000
    warm_start_steps: int = 400
    warm_start_lr: float = 1e-2
    warm_start_batch: int = 16
    warm_start_tool_fraction: float = 0.5  # share of worked episodes that call the calculator (the rest answer at once)
    tasks: int = 512
    n: int = 8  # rollouts per task: one GRPO group
    groups_per_step: int = 4
    steps: int = 24
    publish_every: int = 1
    max_staleness: int = 1
    lr: float = 2e-3
    temperature: float = 1.0
    max_tokens: int = 48
    max_turns: int = 3
    concurrency: int = 16
    time_limit_s: float = 480.0  # collect + learn; with init and warm start the demo stays within 10 minutes

    def problems(self) -> list[str]:
        out = [f"{name} must be >= 1, got {value}" for name, value in asdict(self).items()
               if isinstance(value, int) and name != "seed" and value < 1]
        out += [f"{name} must be > 0, got {value}" for name, value in asdict(self).items()
                if isinstance(value, float) and value <= 0]
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
        """The CI-sized loop (tests/cli/test_demo.py): a shorter warm start and 10 learner steps."""
        return cls(directory, seed=seed, warm_start_steps=200, tasks=160, steps=10, lr=3e-3, time_limit_s=600.0)


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
    example_rollout: str | None = None  # the best-rewarded rollout of the newest version, to replay


def _cli(*args: Any) -> list[str]:
    return [sys.executable, "-m", "cli.main", *map(str, args)]


def _shown(cmd: list[str]) -> str:
    return "trajstore " + shlex.join(cmd[3:])


def commands(s: DemoSettings, model: Path) -> dict[str, list[str]]:
    """The two concurrent commands of the loop, exactly as run."""
    d = s.directory
    learn = _cli("learn", "--store", d / "store", "--run", RUN, "--model", model, "--checkpoints", d / "checkpoints",
                 "--max-staleness", s.max_staleness, "--groups-per-step", s.groups_per_step, "--steps", s.steps,
                 "--publish-every", s.publish_every, "--lr", s.lr, "--seed", s.seed)
    collect = _cli("collect", "--store", d / "store", "--run", RUN, "--tasks", d / "tasks.jsonl", "--n", s.n,
                   "--model", model, "--tools", "collectors.envs.arithmetic:calculator",
                   "--reward", "collectors.envs.arithmetic:reward",
                   "--max-turns", s.max_turns, "--max-tokens", s.max_tokens, "--temperature", s.temperature,
                   "--concurrency", s.concurrency, "--max-staleness", s.max_staleness,
                   "--groups-per-version", s.groups_per_step * s.publish_every, "--follow", "--plain",
                   "--seed", s.seed, *(["--vllm"] if s.engine == "vllm" else []))
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
    say(f"[2/4] warm start: {s.warm_start_steps} supervised steps on {s.warm_start_examples} worked calculator "
        f"episodes -> {d / 'warm'}")
    warm_start(d / "base", d / "warm", arithmetic.warm_start_conversations(s.warm_start_examples, seed=s.seed,
                                                                  tool_fraction=s.warm_start_tool_fraction),
               steps=s.warm_start_steps, lr=s.warm_start_lr, batch_size=s.warm_start_batch, seed=s.seed)
    arithmetic.write_tasks(d / "tasks.jsonl", s.tasks, seed=s.seed + 1)
    cmds = commands(s, d / "warm")
    say("[3/4] collect and learn, concurrently on one store:")
    for name, cmd in cmds.items():
        say(f"      {_shown(cmd)}")
    deadline = time.monotonic() + s.time_limit_s
    logs = {name: open(d / f"{name}.log", "w") for name in cmds}  # noqa: SIM115 - closed below
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    store = open_store(d / "store")  # created here: `learn` refuses a store that does not exist
    procs = {name: subprocess.Popen(cmd, stdout=logs[name], stderr=subprocess.STDOUT, env=env)
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
        for name in ("collect", "learn"):
            proc = procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for name, proc in procs.items():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            logs[name].close()
    if procs["learn"].returncode not in (0, None, -signal.SIGINT, 130):
        raise ChildProcessError(f"the learner failed (exit {procs['learn'].returncode}); see {d / 'learn.log'}")
    say("[4/4] summary")
    return _summary(s, store, time.monotonic() - started, [_shown(c) for c in cmds.values()])


def _progress(store: Any) -> str:
    row = store.query("""
        SELECT (SELECT coalesce(max(version), 0) FROM checkpoints WHERE run = $run) AS version,
               (SELECT count(*) FROM rollouts WHERE run = $run AND trainable) AS rollouts,
               (SELECT avg(reward) FROM rollouts WHERE run = $run AND trainable AND min_version = (
                    SELECT max(min_version) FROM rollouts WHERE run = $run AND trainable)) AS reward
    """, {"run": RUN}).to_pylist()[0]
    reward = "-" if row["reward"] is None else f"{row['reward']:.3f}"
    return f"learner at version {row['version']}, {row['rollouts']} rewarded rollouts, latest version's reward {reward}"


def reward_by_version(store: Any) -> list[dict[str, Any]]:
    """Mean reward, correct-answer rate and calculator-use rate of the rollouts each policy version
    sampled (complete groups only), with the mean staleness at which the learner trained on them."""
    return store.query("""
        WITH r AS (SELECT o.rollout_id, o.min_version AS version, o.reward, o.tokens
                   FROM rollouts o JOIN groups g USING (run, group_id)
                   WHERE o.run = $run AND o.trainable AND g.complete),
             c AS (SELECT rollout_id, version AS consumed_by FROM consumed WHERE run = $run),
             k AS (SELECT rollout_id,
                          last(reward ORDER BY time) FILTER (WHERE reward_name = 'correct') AS correct,
                          last(reward ORDER BY time) FILTER (WHERE reward_name = 'tool') AS tool
                   FROM events WHERE kind = 'reward' AND run = $run GROUP BY rollout_id)
        SELECT r.version, count(*) AS rollouts, avg(r.reward) AS reward, avg(k.correct) AS correct,
               avg(CASE WHEN k.tool > 0 THEN 1.0 ELSE 0.0 END) AS used_calculator,
               sum(r.tokens)::BIGINT AS tokens, avg(c.consumed_by - 1 - r.version) AS staleness
        FROM r LEFT JOIN c USING (rollout_id) LEFT JOIN k USING (rollout_id)
        GROUP BY r.version ORDER BY r.version
    """, {"run": RUN}).to_pylist()


def _summary(s: DemoSettings, store: Any, seconds: float, shown: list[str]) -> DemoResult:
    rows = reward_by_version(store)
    totals = store.query("""
        SELECT (SELECT count(*) FROM rollouts WHERE run = $run) AS rollouts,
               (SELECT coalesce(sum(tokens), 0) FROM rollouts WHERE run = $run)::BIGINT AS tokens,
               (SELECT coalesce(max(step), 0) FROM events WHERE kind = 'metric' AND run = $run) AS steps
    """, {"run": RUN}).to_pylist()[0]
    best = store.query("SELECT rollout_id FROM rollouts WHERE run = $run AND trainable "
                       "ORDER BY reward DESC, min_version DESC LIMIT 1", {"run": RUN}).to_pylist()
    plot = plot_by_version(rows, s.directory / "reward_by_version.png") if rows else None
    return DemoResult(s.directory, s.directory / "store", plot, rows, int(totals["steps"]), int(totals["rollouts"]),
                      int(totals["tokens"]), seconds, shown, best[0]["rollout_id"] if best else None)


def plot_by_version(rows: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    versions = [r["version"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(versions, [r["reward"] for r in rows], marker="o", label="mean reward")
    if any(r["correct"] is not None for r in rows):
        ax.plot(versions, [r["correct"] for r in rows], marker="s", label="correct answers (rate)")
    ax.plot(versions, [r["used_calculator"] / 10 for r in rows], marker="^", linestyle="--",
            label="used the calculator (rate / 10)")
    ax.set_xlabel("policy version that sampled the rollouts")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    stale = ax.twinx()
    stale.bar(versions, [r["staleness"] or 0 for r in rows], alpha=0.2, color="gray", label="mean staleness")
    stale.set_ylabel("staleness when trained (versions)")
    lines, labels = ax.get_legend_handles_labels()
    more, more_labels = stale.get_legend_handles_labels()
    ax.legend(lines + more, labels + more_labels, loc="upper left")
    ax.set_title("trajstore demo: calculator episodes, reward by policy version")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
