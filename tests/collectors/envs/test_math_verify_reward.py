"""`--reward math_verify`: symbolic answer checking with math-verify, by short name or import path."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("math_verify")

from collectors.agents.context import RolloutInfo  # noqa: E402
from collectors.collect.rewards import call_reward, load_reward  # noqa: E402
from collectors.envs import math_verify  # noqa: E402

INFO = RolloutInfo(run="r", group_id="g", rollout_id="x", slot=0, attempt=0, workdir=Path("."), policy_version=0)


@pytest.mark.parametrize(("answer", "reply", "score"), [
    ("1/2", "So the answer is $\\frac{1}{2}$.", 1.0),
    ("1/2", "The answer is \\boxed{0.5}", 1.0),
    ("\\frac{1}{2}", "1/2", 1.0),
    (42, "I think it is 42", 1.0),
    ("$x^2+1$", "$1 + x^2$", 1.0),
    ("1/2", "The answer is \\boxed{3}", 0.0),
    ("7", "no number here", 0.0),
    ("7", "", 0.0),
])
def test_equal_answers_score_one_whatever_their_form(answer: Any, reply: str, score: float) -> None:
    assert math_verify.reward({"answer": answer}, reply) == {"math_verify": score}


def test_the_reply_text_comes_from_an_agent_result_or_its_stored_form() -> None:
    class Result:
        text = "\\boxed{5}"

    assert math_verify.reward({"answer": "5"}, Result()) == {"math_verify": 1.0}
    assert math_verify.reward({"answer": "5"}, {"text": "5"}) == {"math_verify": 1.0}
    assert math_verify.reward({"answer": "5"}, None) == {"math_verify": 0.0}


@pytest.mark.parametrize(("answer", "says"), [(None, "needs `answer`"), (True, "needs `answer`"),
                                               ("\\frac{", "cannot parse the task's answer"),
                                               ("  ", "cannot parse the task's answer")])
def test_a_bad_gold_answer_is_an_error_in_the_task(answer: Any, says: str) -> None:
    with pytest.raises(math_verify.GoldAnswerError) as info:
        math_verify.reward({"answer": answer}, "1")
    assert says in str(info.value)


def test_the_short_name_loads_it_and_it_runs_in_the_collectors_worker_thread() -> None:
    """collect runs sync rewards in a worker thread, where math-verify's SIGALRM timeouts cannot work."""
    fn = load_reward("math_verify")
    assert fn is math_verify.reward
    seen: list[str] = []

    def traced(task: dict[str, Any], result: Any, rollout: Any) -> dict[str, float]:
        seen.append(threading.current_thread().name)
        return fn(task, result, rollout)

    assert asyncio.run(call_reward(traced, {"answer": "2/4"}, "\\boxed{1/2}", INFO)) == {"math_verify": 1.0}
    assert seen and seen[0] != threading.main_thread().name


def test_an_unknown_short_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="math_verify, reasoning_gym"):
        load_reward("math_verfy")
