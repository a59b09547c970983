"""The "your own task" path runs as the docs write it (issue 21): docs/own-task.md's commands (the same
block the README shows), one after the other in a fresh directory, as a shell runs them: `init-model`,
the example environment's files, `trajstore sft`, `collect` with the example tool and reward, `collect`
with the example agent command and reward command, `query`, `learn`; and docs/models.md's check of a
model, on the checkpoint those commands built.

Only sizes are cut, so the test stays within minutes on a loaded 2-core machine (`SMALLER`: fewer
tasks and worked episodes); every other word runs as written. The warm start keeps its 150 steps:
after 60, the colour was right in about half the episodes (the agent command's binary reward
0.48), after 150 (on the docs' 400 episodes) in all of them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import trajstore
from tests.test_readme import ROOT, fenced_block

OWN_TASK = (ROOT / "docs" / "own-task.md").read_text()
MODELS = (ROOT / "docs" / "models.md").read_text()
SMALLER = {  # what the docs write -> what the test runs
    "python -m examples.fruit_env my/": "python -m examples.fruit_env my/ 8 200",  # learn takes 2 steps of 4 groups
}


def shell_commands(block: str) -> list[str]:
    """A bash block's commands: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\s*\\\n\s*", " ", block)
    return [line for line in (re.sub(r"(^|\s+)#(\s.*)?$", "", raw).strip() for raw in joined.splitlines()) if line]


def test_shell_commands_are_read_as_a_shell_reads_them() -> None:
    block = 'a --x 1 \\\n    --y "2 3"   # a comment\n# only a comment\n\nb\n'
    assert shell_commands(block) == ['a --x 1 --y "2 3"', "b"]


def test_the_example_agent_shows_the_model_the_tool_the_built_in_agent_does() -> None:
    """The warm start and examples/fruit_agent.py use `fruit_env.TOOL`; `--tools` derives the schema from
    `look_up`. A tiny model wrote garbled calls when the two differed by one key."""
    from collectors.agents.tools import tool_schema
    from examples import fruit_env

    assert tool_schema(fruit_env.look_up) == fruit_env.TOOL
    assert all(c["tools"] == [fruit_env.TOOL] for c in fruit_env.conversations(3))


@pytest.mark.slow
def test_the_own_task_commands_run_as_written(tmp_path: Path) -> None:
    commands = shell_commands(fenced_block(OWN_TASK, "trajstore init-model my/base"))
    assert [c.split()[1] for c in commands] == ["init-model", "-m", "sft", "collect", "collect", "query", "learn"]
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # "from the repository root": its examples/ here
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    outputs = []
    for command in commands:
        for written, smaller in SMALLER.items():
            command = command.replace(written, smaller)
        done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        outputs.append(done.stdout)
        if command.startswith("trajstore init-model"):
            check_model_as_models_md_says(tmp_path / "my" / "base")

    my = tmp_path / "my"
    warm = json.loads((my / "warm" / "trajstore_warm_start.json").read_text())
    assert warm["steps"] == 150 and warm["loss"][-1] < warm["loss"][0] / 10  # the warm start learned the format
    store = trajstore.open_store(my / "store", create=False)
    runs = {r["run"]: r for r in store.query(
        "SELECT run, count(*) AS rollouts, count(*) FILTER (WHERE status = 'failed') AS failed, "
        "avg(reward) AS reward FROM rollouts GROUP BY run").to_pylist()}
    assert runs.keys() == {"fruit", "fruit-cmd"} and all(r["rollouts"] == 32 for r in runs.values())
    assert all(r["failed"] == 0 for r in runs.values()), runs  # no rollout of either agent failed
    names = {r["reward_name"] for r in store.query(
        "SELECT DISTINCT run, reward_name FROM events WHERE kind = 'reward'").to_pylist()}
    assert names == {"tool", "colour", "reward"}  # the function's two components; the command's exit status
    assert runs["fruit"]["reward"] > 0.5  # warm-started, the model calls the tool (and, mostly, names the colour)
    assert runs["fruit-cmd"]["reward"] > 0.5  # the agent program shows the model the warm start's prompt too
    assert "fruit-cmd" in outputs[5] and "fruit" in outputs[5]  # the query printed both runs
    assert (my / "ckpt" / "v000002").is_dir()  # learn published its two versions
    assert store.query("SELECT max(version) AS v FROM checkpoints WHERE run = 'fruit'").to_pylist() == [{"v": 2}]


def check_model_as_models_md_says(model: Path) -> None:
    """docs/models.md's check, with its MODEL set to `model`, prints ok for an init-model checkpoint."""
    code = fenced_block(MODELS, "from collectors.model.toolcalls import parse_output")
    assert 'MODEL = "my/base"' in code
    done = subprocess.run([sys.executable, "-c", code.replace('MODEL = "my/base"', f"MODEL = {str(model)!r}")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok: a tool call is written as '<tool_call>"), done.stdout
