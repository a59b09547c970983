"""`trajstore collect --env reasoning_gym:NAME`: tasks generated when collect starts, seeded, scored by
reasoning-gym's own verifier unless --reward says otherwise; bad names and options are one-line errors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from cli.main import main
from collectors.collect.settings import CollectSettings
from trajstore import open_store


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def test_tasks_come_from_a_file_or_an_env_never_both_nor_neither(tmp_path: Path) -> None:
    tasks = tmp_path / "t.jsonl"
    tasks.write_text('{"prompt": "hi"}\n')
    base = {"store": "s", "run": "r", "model": None, "server": "http://127.0.0.1:1", "no_reward": True}
    assert any("--tasks FILE" in p and "--env PACKAGE:NAME" in p for p in CollectSettings(**base).problems())
    both = CollectSettings(**base, tasks=str(tasks), env="reasoning_gym:leg_counting").problems()
    assert any("one of the two" in p for p in both)
    assert CollectSettings(**base, env="reasoning_gym:leg_counting").problems() == []


@pytest.mark.parametrize(("env", "count", "config", "says"), [
    ("gsm8k:main", 4, None, "unknown package 'gsm8k'; --env takes reasoning_gym:NAME"),
    ("reasoning_gym", 4, None, "names no generator: write reasoning_gym:NAME"),
    ("reasoning_gym:leg_counting", 0, None, "--env-count must be at least 1"),
    ("reasoning_gym:leg_counting", 4, "{bad", "--env-config is not valid JSON"),
    ("reasoning_gym:leg_counting", 4, "[1]", "--env-config must be a JSON object"),
])
def test_bad_env_options_are_named(env: str, count: int, config: str | None, says: str) -> None:
    settings = CollectSettings(store="s", run="r", server="http://127.0.0.1:1", env=env, env_count=count,
                               env_config=config)
    assert any(says in p for p in settings.problems()), settings.problems()


def test_an_env_brings_its_own_reward_unless_another_is_given() -> None:
    own = CollectSettings(store="s", run="r", env="reasoning_gym:leg_counting")
    assert own.reward_spec == "reasoning_gym"
    assert CollectSettings(store="s", run="r", env="reasoning_gym:x", reward="m:f").reward_spec == "m:f"
    assert CollectSettings(store="s", run="r", env="reasoning_gym:x", no_reward=True).reward_spec is None
    assert CollectSettings(store="s", run="r", tasks="t.jsonl").reward_spec is None


def test_an_unknown_generator_lists_close_matches_in_one_line(tiny_model: Path, tmp_path: Path) -> None:
    pytest.importorskip("reasoning_gym")
    code, out = run("collect", "--store", str(tmp_path / "s"), "--run", "r", "--model", str(tiny_model),
                    "--env", "reasoning_gym:leg_countin", "--device", "cpu", "--plain")
    assert code == 1 and "Traceback" not in out, out
    assert "no generator 'leg_countin'; did you mean leg_counting, " in out
    assert "python -m collectors.envs.reasoning_gym list" in out
    assert not (tmp_path / "s").exists()  # nothing was started
    code, out = run("collect", "--store", str(tmp_path / "s"), "--run", "r", "--model", str(tiny_model),
                    "--env", "reasoning_gym:leg_counting", "--env-config", '{"no_such_option": 1}', "--plain")
    assert code == 1 and "cannot build 'leg_counting'" in out and "Traceback" not in out, out


def test_collect_generates_scores_and_resumes(tiny_model: Path, tmp_path: Path) -> None:
    """Two generated tasks, two rollouts each, rewarded per component by reasoning-gym; the same command
    again generates the same tasks (same ids), so it finds every group done and adds nothing."""
    pytest.importorskip("reasoning_gym")
    from collectors.envs import reasoning_gym as rg

    store = str(tmp_path / "store")
    args = ("collect", "--store", store, "--run", "rg", "--model", str(tiny_model), "--env",
            "reasoning_gym:basic_arithmetic", "--env-count", "2", "--env-seed", "5", "--n", "2", "--max-tokens", "4",
            "--seed", "0", "--threads", "1", "--device", "cpu", "--plain", "--workdir", str(tmp_path / "work"))
    code, out = run(*args)
    assert code == 0, out
    s = open_store(store)
    rows = s.query("SELECT reward_name, count(*) AS n FROM events WHERE kind = 'reward' GROUP BY reward_name"
                   ).to_pylist()
    assert {r["reward_name"]: r["n"] for r in rows} == {"score": 4, "format": 4}
    groups = s.query("SELECT DISTINCT json_extract_string(meta, '$.task_id') AS t FROM events WHERE kind = 'status' "
                     "AND status = 'started' ORDER BY t").column("t").to_pylist()
    assert groups == [t["id"] for t in rg.tasks("basic_arithmetic", 2, seed=5)]
    # the prompt is the generated question, reasoning-gym's system prompt first
    first = s.query("SELECT request FROM turns ORDER BY time LIMIT 1").to_pylist()[0]["request"]
    assert rg.system_prompt()[:40] in first
    code, out = run(*args)
    assert code == 0, out
    assert s.query("SELECT count(*) AS n FROM rollouts").to_pylist()[0]["n"] == 4
