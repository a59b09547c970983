"""reasoning-gym tasks as collect tasks: seeded generation, a task file collect loads, and rewards from
reasoning-gym's own `score_answer` on the very entry it generated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("reasoning_gym")

from collectors.collect.rewards import load_reward  # noqa: E402
from collectors.collect.tasks import load_tasks  # noqa: E402
from collectors.envs import reasoning_gym as rg  # noqa: E402


def test_tasks_are_seeded_and_load_as_a_task_file(tmp_path: Path) -> None:
    tasks = rg.tasks("leg_counting", 5, seed=3)
    assert tasks == rg.tasks("leg_counting", 5, seed=3) != rg.tasks("leg_counting", 5, seed=4)
    assert len({t["id"] for t in tasks}) == 5
    assert tasks[0]["messages"][0] == {"role": "system", "content": rg.system_prompt()}
    assert [m["role"] for m in rg.tasks("leg_counting", 1, system=False)[0]["messages"]] == ["user"]
    path = rg.write_tasks(tmp_path / "t.jsonl", "leg_counting", 5, seed=3)
    assert load_tasks(path) == tasks


@pytest.mark.parametrize("name", ["leg_counting", "basic_arithmetic", "countdown", "spell_backward"])
def test_the_right_answer_scores_one_and_a_wrong_one_less(name: str) -> None:
    """countdown has many right answers: its verifier needs the entry's metadata, which the reward regenerates."""
    for task in rg.tasks(name, 3, seed=1):
        entry = rg.entry(task)
        right = rg.reward(task, f"Thinking...\n<answer>{entry['answer']}</answer>")
        assert right == {"score": 1.0, "format": rg.FORMAT_REWARD}
        wrong = rg.reward(task, "<answer>certainly not this</answer>")
        assert wrong["score"] < 1.0 and wrong["format"] == rg.FORMAT_REWARD


def test_an_untagged_reply_is_scored_whole_without_the_format_component() -> None:
    task = rg.tasks("leg_counting", 1, seed=0)[0]
    assert rg.reward(task, f" {task['answer']} ") == {"score": 1.0, "format": 0.0}
    assert rg.reward(task, {"text": task["answer"]})["score"] == 1.0  # as `trajstore reward` hands it back


def test_the_generators_options_pass_through() -> None:
    config = {"min_animals": 2, "max_animals": 2}
    task = rg.tasks("leg_counting", 1, seed=0, config=config)[0]
    assert task[rg.KEY]["config"] == config and len(rg.entry(task)["metadata"]["animals"]) == 2


def test_short_name_loads_the_reward() -> None:
    assert load_reward("reasoning_gym") is rg.reward


def test_bad_input_gets_clear_errors() -> None:
    with pytest.raises(rg.ReasoningGymError, match="no generator 'leg_countin'.*leg_counting"):
        rg.tasks("leg_countin", 2)
    with pytest.raises(rg.ReasoningGymError, match="cannot build 'leg_counting'"):
        rg.tasks("leg_counting", 2, config={"no_such_option": 1})
    with pytest.raises(rg.ReasoningGymError, match="count must be at least 1"):
        rg.tasks("leg_counting", 0)
    with pytest.raises(rg.ReasoningGymError, match="tasks written by collectors.envs.reasoning_gym"):
        rg.reward({"id": "x", "prompt": "2+2?"}, "4")
    task = rg.tasks("leg_counting", 2, seed=0)[0]
    task["messages"][-1]["content"] = "something else"
    with pytest.raises(rg.ReasoningGymError, match="generates a different question"):
        rg.reward(task, "4")


def test_the_command_writes_a_task_file_and_lists_generators(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t.jsonl"
    assert rg.main(["basic_arithmetic", "--count", "3", "--seed", "2", "--out", str(out), "--no-system"]) == 0
    assert [json.loads(line) for line in out.read_text().splitlines()] == rg.tasks("basic_arithmetic", 3, 2,
                                                                                    system=False)
    assert rg.main(["list"]) == 0 and "leg_counting" in capsys.readouterr().out.split()
    assert rg.main(["leg_counting", "--config", "[1]", "--out", str(out)]) == 2
    assert rg.main(["leg_counting"]) == 2
    assert "give --out FILE" in capsys.readouterr().err
