"""The example environments: coding (graded by running its tests) and subagent (three segments per rollout)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from collectors.agents.context import AgentContext, RolloutInfo
from collectors.envs import coding, subagent
from tests.collectors.proxy_harness import MODEL, Harness, Scripted, running_proxy


def info(rollout: dict[str, Any], workdir: Path) -> RolloutInfo:
    return RolloutInfo(run="test", group_id=rollout["group_id"], rollout_id=rollout["rollout_id"], slot=0, attempt=0,
                       workdir=workdir, policy_version=0)


def play(h: Harness, agent: Any, task: dict[str, Any], workdir: Path, *, max_tokens: int = 64) -> tuple[Any, str]:
    """One episode of `agent` against the proxy; (its result, the rollout id)."""
    rollout = h.open(group_id=task["id"], group_size=1)
    ctx = AgentContext(info(rollout, workdir), base_urls=rollout["base_urls"], api_key=rollout["api_key"],
                       model=MODEL, max_turns=4, max_tokens=max_tokens, sampling={"temperature": 1.0, "seed": 3})

    async def episode() -> Any:
        try:
            return await agent(task, ctx)
        finally:
            await ctx.aclose()

    return asyncio.run(episode()), rollout["rollout_id"]


def write_files(task: dict[str, Any], workdir: Path) -> None:
    for name, text in task["files"].items():
        (workdir / name).write_text(text)


def passed(task: dict[str, Any], workdir: Path) -> float:
    return asyncio.run(coding.reward(task, None, info({"group_id": "g", "rollout_id": "r"}, workdir)))["tests_passed"]


def test_coding_tasks_are_deterministic_and_cover_every_spec() -> None:
    tasks = coding.tasks(len(coding.SPECS), seed=5)
    assert tasks == coding.tasks(len(coding.SPECS), seed=5) and tasks != coding.tasks(len(coding.SPECS), seed=6)
    assert sorted(t["function"] for t in tasks) == sorted({t["function"] for t in tasks})
    assert len({t["id"] for t in coding.tasks(20, seed=5)}) == 20


def test_every_reference_passes_and_every_stub_fails(tmp_path: Path) -> None:
    for task in coding.tasks(len(coding.SPECS), seed=1):
        workdir = tmp_path / task["id"]
        workdir.mkdir()
        write_files(task, workdir)
        assert passed(task, workdir) == 0.0, task["id"]
        (workdir / "solution.py").write_text(task["reference"])
        assert passed(task, workdir) == 1.0, task["id"]


def test_the_reward_command_runs_with_plain_python(tmp_path: Path) -> None:
    task = coding.tasks(1, seed=2)[0]
    write_files(task, tmp_path)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    run = subprocess.run(coding.REWARD_CMD, check=False, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode != 0 and "NotImplementedError" in run.stderr
    (tmp_path / "solution.py").write_text(task["reference"])
    run = subprocess.run(coding.REWARD_CMD, check=False, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0 and "tests passed" in run.stdout


def test_edited_tests_are_restored_and_a_hanging_solution_is_killed(tmp_path: Path) -> None:
    task = coding.tasks(1, seed=3)[0]
    write_files(task, tmp_path)
    (tmp_path / "test_solution.py").write_text("print('all good')\n")  # an agent that games the grader
    assert passed(task, tmp_path) == 0.0
    (tmp_path / "solution.py").write_text("while True:\n    pass\n")
    assert not asyncio.run(coding.run_tests(task, tmp_path, timeout_s=1.0))


def test_extract_code() -> None:
    assert coding.extract_code("Here:\n```python\ndef f():\n    return 1\n```\nDone.") == "def f():\n    return 1\n"
    assert coding.extract_code("```\nx = 1\n```\n```py\ny = 2\n```") == "y = 2\n"
    assert coding.extract_code("def f(): return 2") == "def f(): return 2\n"


@pytest.fixture(scope="module")
def scripted(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    upstream = Scripted(AutoTokenizer.from_pretrained(tiny_model))
    with running_proxy(upstream, tmp_path_factory.mktemp("store"), tiny_model) as h:
        yield h


def test_the_coding_agent_writes_the_models_code_to_the_workdir(scripted: Harness, tmp_path: Path) -> None:
    task = coding.tasks(1, seed=4)[0]
    write_files(task, tmp_path)
    scripted.upstream.replies[:] = [f"Sure.\n```python\n{task['reference']}```"]
    code, _ = play(scripted, coding.agent, task, tmp_path, max_tokens=512)
    assert code == task["reference"] == (tmp_path / "solution.py").read_text()
    assert passed(task, tmp_path) == 1.0


def test_subagent_episode_fans_out_into_three_segments(proxy: Harness, tmp_path: Path) -> None:
    """The real tiny model (random text) behind the proxy: segmentation does not depend on what it says."""
    task = subagent.tasks(1, seed=0)[0]
    result, rollout_id = play(proxy, subagent.agent, task, tmp_path, max_tokens=8)
    rows = proxy.store.query("SELECT session_id, segment_id, turns FROM samples WHERE rollout_id = ? "
                             "ORDER BY first_time", [rollout_id]).to_pylist()
    assert [(r["session_id"], r["turns"]) for r in rows] == [("main", 1), ("sub", 1), ("main", 1)]
    assert len({r["segment_id"] for r in rows}) == 3
    last = proxy.store.query("SELECT meta FROM turns WHERE segment_id = ?", [rows[2]["segment_id"]]).to_pylist()[0]
    assert json.loads(last["meta"])["fork"] == "history_rewrite"
    assert isinstance(result, subagent.SubagentResult)


def test_subagent_tasks_and_reward_are_deterministic() -> None:
    tasks = subagent.tasks(4, seed=1)
    assert tasks == subagent.tasks(4, seed=1) and all(t["topic"] in t["question"] for t in tasks)
    task = tasks[0]
    rollout = info({"group_id": "g", "rollout_id": "r"}, Path("."))
    hit = subagent.SubagentResult(plan="", notes="", answer=f"About {task['topic'].upper()}.")
    miss = subagent.SubagentResult(plan="", notes="", answer="Something else.")
    assert subagent.reward(task, hit, rollout) == {"on_topic": 1.0}
    assert subagent.reward(task, miss, rollout) == {"on_topic": 0.0}
