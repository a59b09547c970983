"""A small real run for the viewer's tests and the screenshots of docs/viewer.md, made the way a user makes one.

`trajstore collect` with the built-in tool agent and the calculator on a tiny model that a short
warm start taught the tool-call format (arithmetic environment, version 0); `trajstore learn` for
two steps (versions 1 and 2, with metric and checkpoint events); `collect` again, which loads the
newest checkpoint first (version 2); and a second run with the sub-agent example, whose
compaction forks each rollout into three segments (`history_rewrite`). Every event comes from the
real capture proxy, embedded server and learner. About a minute on 2 cores.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from click.testing import CliRunner

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from cli.main import main  # noqa: E402
from collectors.envs import arithmetic, subagent  # noqa: E402
from collectors.model.build import init_model  # noqa: E402
from learner.sft import warm_start  # noqa: E402
from tests.collectors.agents_for_tests import write_tasks  # noqa: E402
from tests.collectors.conftest import TINY  # noqa: E402


@dataclass(frozen=True)
class DemoRun:
    store: str
    model: Path  # the warm-started checkpoint whose tokenizer decodes every run's tokens
    checkpoints: Path


def _cli(*args: str) -> str:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def _collect(store: str, run: str, tasks: Path, n: int, model: Path, work: Path, *extra: str) -> None:
    _cli("collect", "--store", store, "--run", run, "--tasks", str(tasks), "--n", str(n), "--model", str(model),
         "--max-turns", "3", "--max-tokens", "40", "--concurrency", "16", "--seed", "0", "--threads", "1",
         "--device", "cpu", "--plain", "--workdir", str(work), *extra)


def build(root: Path) -> DemoRun:
    """The run under `root` (a fresh directory)."""
    store = str(root / "store")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        init_model(root / "base", TINY, seed=0)
        model = warm_start(root / "base", root / "warm", arithmetic.warm_start_conversations(256, seed=0),
                           steps=120, lr=1e-2, batch_size=16, seed=0)
        tools = ("--tools", "collectors.envs.arithmetic:calculator", "--reward", "collectors.envs.arithmetic:reward")
        _collect(store, "arith", arithmetic.write_tasks(root / "tasks-1.jsonl", 8, seed=3), 4, model,
                 root / "work-1", *tools)
        _cli("learn", "--store", store, "--run", "arith", "--model", str(model), "--checkpoints",
             str(root / "checkpoints"), "--steps", "2", "--groups-per-step", "4", "--max-staleness", "2",
             "--lr", "1e-3", "--device", "cpu", "--wait-timeout", "30")
        _collect(store, "arith", arithmetic.write_tasks(root / "tasks-2.jsonl", 4, seed=4), 4, model,
                 root / "work-2", *tools)
        _collect(store, "fanout", Path(write_tasks(root / "tasks-sub.jsonl", subagent.tasks(2, seed=0))), 2,
                 model, root / "work-sub", "--agent", "collectors.envs.subagent:agent",
                 "--reward", "collectors.envs.subagent:reward", "--max-tokens", "12")
    finally:
        torch.set_num_threads(threads)
    return DemoRun(store, Path(model), root / "checkpoints")


if __name__ == "__main__":  # python -m tests.collectors.viewer.demo_run DIR: keep one to browse
    import sys

    run = build(Path(sys.argv[1]))
    print(f"trajstore view --store {run.store} --model {run.model}")
