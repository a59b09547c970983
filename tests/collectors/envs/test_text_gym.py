"""The gymnasium-style text-environment adapter: observations become user messages, replies become actions,
and the environment's step rewards become the reward; played against a scripted model behind the real proxy."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("gymnasium")

from transformers import AutoTokenizer  # noqa: E402

from collectors.envs import text_gym  # noqa: E402
from tests.collectors.envs.test_envs import play  # noqa: E402
from tests.collectors.envs.text_envs_for_tests import GuessNumber  # noqa: E402
from tests.collectors.proxy_harness import Harness, Scripted, running_proxy  # noqa: E402

ENV = "tests.collectors.envs.text_envs_for_tests:GuessNumber"


@pytest.fixture(scope="module")
def scripted(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    upstream = Scripted(AutoTokenizer.from_pretrained(tiny_model))
    with running_proxy(upstream, tmp_path_factory.mktemp("store"), tiny_model) as h:
        yield h


def secret(seed: int, high: int = 10) -> int:
    env = GuessNumber(high=high)
    env.reset(seed=seed)
    return env.secret


def task(seed: int, **extra: Any) -> dict[str, Any]:
    return {"id": f"guess-{seed}", "env": ENV, "env_kwargs": {"high": 10, "tries": 3}, "seed": seed, **extra}


def test_each_observation_is_the_next_user_message_and_step_rewards_are_the_reward(scripted: Harness,
                                                                                   tmp_path: Path) -> None:
    number = secret(5)
    wrong = 1 if number != 1 else 2
    scripted.upstream.replies[:] = [f"Is it {wrong}?", f"It is {number}."]
    result, rollout_id = play(scripted, text_gym.agent, task(5, system="Guess well."), tmp_path)
    assert result.rewards == [-0.1, 1.0] and result.terminated and not result.truncated
    assert result.messages == [
        {"role": "system", "content": "Guess well."},
        {"role": "user", "content": "Guess my number from 1 to 10."},
        {"role": "assistant", "content": f"Is it {wrong}?"},
        {"role": "user", "content": "higher" if wrong < number else "lower"},
        {"role": "assistant", "content": f"It is {number}."},
    ]
    assert text_gym.reward(task(5), result) == {"return": pytest.approx(0.9)}
    # one growing conversation: the proxy extends one segment over both turns
    rows = scripted.store.query("SELECT turns FROM samples WHERE rollout_id = ?", [rollout_id]).to_pylist()
    assert [r["turns"] for r in rows] == [2]


def test_the_environment_ending_the_episode_is_truncation_not_failure(scripted: Harness, tmp_path: Path) -> None:
    scripted.upstream.replies[:] = ["no idea", "still none", "nope"]
    result, _ = play(scripted, text_gym.agent, task(6), tmp_path)
    assert result.rewards == [-0.2, -0.2, -0.2] and result.truncated and not result.terminated
    assert text_gym.reward(task(6), result) == {"return": pytest.approx(-0.6)}


def test_the_turn_limit_cuts_a_long_episode(scripted: Harness, tmp_path: Path) -> None:
    """play() gives the agent max_turns=4; the environment would allow 10 tries."""
    scripted.upstream.replies[:] = ["none"] * 10
    long = task(7, env_kwargs={"high": 10, "tries": 10})
    result, _ = play(scripted, text_gym.agent, long, tmp_path)
    assert len(result.rewards) == 4 and result.truncated


def test_a_registered_gymnasium_id_works_too(scripted: Harness, tmp_path: Path) -> None:
    number = secret(8)
    scripted.upstream.replies[:] = [str(number)]
    result, _ = play(scripted, text_gym.agent, task(8, env="TestGuessNumber-v0"), tmp_path)
    assert result.rewards == [1.0] and result.terminated


def test_the_rescoring_path_reads_the_stored_result() -> None:
    """`trajstore reward` hands the reward the result as stored in the final status: the dataclass as JSON."""
    assert text_gym.reward({}, {"text": "x", "rewards": [0.5, 0.25]}) == {"return": 0.75}


@pytest.mark.parametrize(("bad", "says"), [
    ({"env": None}, "needs `env`"),
    ({"env_kwargs": [1]}, "`env_kwargs` must be an object"),
    ({"env": "tests.collectors.envs.text_envs_for_tests:MAX_TEXT"}, "not a class or factory"),
    ({"env": "tests.collectors.envs.text_envs_for_tests:NoSuchEnv"}, "has no 'NoSuchEnv'"),
    ({"env": "NoSuchEnv-v0"}, "gymnasium cannot make 'NoSuchEnv-v0'"),
])
def test_bad_environments_are_named_clearly(bad: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError) as info:
        text_gym.make_env({**task(1), **bad})
    assert says in str(info.value)


def test_an_environment_that_does_not_speak_text_is_refused(scripted: Harness, tmp_path: Path) -> None:
    with pytest.raises(text_gym.TextEnvError, match="observations must be str"):
        play(scripted, text_gym.agent, task(1, env="tests.collectors.envs.text_envs_for_tests:NotText"), tmp_path)


def test_a_result_that_is_not_an_episode_is_refused() -> None:
    with pytest.raises(text_gym.TextEnvError, match="scores the result of text_gym.agent"):
        text_gym.reward({}, "just text")


def test_a_task_file_of_environments_loads_and_the_plain_chat_agent_refuses_it(tmp_path: Path) -> None:
    """An environment task has no prompt: its first observation is the prompt."""
    from collectors.collect.tasks import TaskFileError, chat_messages, load_tasks

    path = tmp_path / "tasks.jsonl"
    path.write_text('{"id": "g1", "env": "TestGuessNumber-v0", "seed": 1}\n{"id": "g2"}\n')
    with pytest.raises(TaskFileError, match="line 2: needs `prompt`.* or `env`") as info:
        load_tasks(path)
    assert "line 1" not in str(info.value)
    with pytest.raises(TaskFileError, match="--agent collectors.envs.text_gym:agent"):
        chat_messages(task(1))
