"""Closed loops on the ecosystem adapters, CI-sized: a tiny model built on the spot collects reasoning-gym
tasks and gymnasium text-environment episodes with `trajstore collect`, then `trajstore learn` trains a few
steps on them; every reward component is stored as its own reward event."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from cli.main import main  # noqa: E402
from collectors.model.build import init_model  # noqa: E402
from tests.collectors.conftest import TINY  # noqa: E402
from trajstore import open_store  # noqa: E402

GROUPS, N = 4, 4


def cli(*args: str) -> str:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("adapter-models") / "tiny"
    init_model(path, TINY, seed=0)
    return path


def collect_and_learn(root: Path, model: Path, tasks: Path, *agent: str) -> str:
    """Collect GROUPS groups of N, then learn 2 steps of 2 groups; the store's location."""
    store = str(root / "store")
    threads = torch.get_num_threads()
    try:
        cli("collect", "--store", store, "--run", "loop", "--tasks", str(tasks), "--n", str(N), "--model", str(model),
            "--max-turns", "3", "--max-tokens", "8", "--concurrency", "8", "--seed", "0", "--threads", "1",
            "--device", "cpu", "--plain", "--workdir", str(root / "work"), *agent)
        out = cli("learn", "--store", store, "--run", "loop", "--model", str(model), "--checkpoints",
                  str(root / "checkpoints"), "--steps", "2", "--groups-per-step", "2", "--max-staleness", "2",
                  "--lr", "1e-3", "--device", "cpu", "--wait-timeout", "30")
    finally:
        torch.set_num_threads(threads)
    assert "2 steps trained" in out, out
    return store


def advantage_spread(store: str) -> list[float]:
    """The learner's advantage_std of each step (0 when every rollout of every group scored the same)."""
    return open_store(store).query("SELECT value FROM metrics WHERE name = 'advantage_std' ORDER BY step"
                                   ).column("value").to_pylist()


def reward_components(store: str) -> dict[str, int]:
    rows = open_store(store).query("SELECT reward_name, count(DISTINCT rollout_id) AS n FROM events "
                                   "WHERE kind = 'reward' AND run = 'loop' GROUP BY reward_name").to_pylist()
    return {r["reward_name"]: r["n"] for r in rows}


def usable(store: str) -> int:
    return open_store(store).query("SELECT count(*) AS n FROM rollouts WHERE run = 'loop' AND status IN "
                                   "('completed', 'truncated')").to_pylist()[0]["n"]


def test_reasoning_gym_collect_then_learn(model: Path, tmp_path: Path) -> None:
    pytest.importorskip("reasoning_gym")
    from collectors.envs import reasoning_gym

    tasks = reasoning_gym.write_tasks(tmp_path / "tasks.jsonl", "leg_counting", GROUPS, seed=0, system=False)
    store = collect_and_learn(tmp_path, model, tasks, "--reward", "reasoning_gym")
    assert usable(store) == GROUPS * N
    assert reward_components(store) == {"score": GROUPS * N, "format": GROUPS * N}
    assert len(advantage_spread(store)) == 2  # a random tiny model scores 0 here: the loop, not learning


def test_text_environment_collect_then_learn(model: Path, tmp_path: Path) -> None:
    """Echo rewards how alike reply and word are, so even a random model's rollouts differ: the learner
    trains on a real signal."""
    pytest.importorskip("gymnasium")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({
        "id": f"echo-{i}", "env": "tests.collectors.envs.text_envs_for_tests:Echo", "env_kwargs": {"rounds": 3},
        "seed": i}) + "\n" for i in range(GROUPS)))
    store = collect_and_learn(tmp_path, model, tasks, "--agent", "collectors.envs.text_gym:agent",
                              "--reward", "collectors.envs.text_gym:reward")
    assert usable(store) == GROUPS * N
    assert reward_components(store) == {"return": GROUPS * N}
    # every rollout's turns are the model calls of its episode: 1 to 3 (the env allows 3 tries)
    turns = open_store(store).query("SELECT rollout_id, count(*) AS n FROM turns WHERE run = 'loop' "
                                    "GROUP BY rollout_id").to_pylist()
    assert len(turns) == GROUPS * N and all(1 <= t["n"] <= 3 for t in turns)
    assert all(spread > 0 for spread in advantage_spread(store))
