"""The arithmetic environment: the calculator, the tasks, the reward and the warm-start episodes."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from collectors.envs import arithmetic  # noqa: E402
from collectors.tool_agent import ToolAgentResult  # noqa: E402


@pytest.mark.parametrize(("expression", "value"), [("37 + 48", "85"), ("(2 + 3) * 4", "20"), ("-5 - 7", "-12"),
                                                   ("7 // 2", "3"), ("7 % 4", "3"), ("7 / 2", "3.5")])
def test_calculator_evaluates(expression: str, value: str) -> None:
    assert arithmetic.calculator(expression) == value


@pytest.mark.parametrize("expression", ["3 +", "2 ** 10", "__import__('os')", "1 / 0", "x + 1", "9" * 300])
def test_calculator_errors_are_answers_not_exceptions(expression: str) -> None:
    out = arithmetic.calculator(expression)
    assert out.startswith("Error") and len(out) < 300


def test_tasks_are_deterministic_and_fit_the_format() -> None:
    tasks = arithmetic.tasks(50, seed=3)
    assert tasks == arithmetic.tasks(50, seed=3) and tasks != arithmetic.tasks(50, seed=4)
    low, high = 10 ** (arithmetic.DIGITS - 1), 10 ** arithmetic.DIGITS - 1
    for t in tasks:
        expression = t["prompt"].removeprefix("What is ").removesuffix("?")
        assert arithmetic.calculator(expression) == str(t["answer"]) and low <= t["answer"] <= high
        assert t["system"] == arithmetic.SYSTEM  # collection renders the warm start's system prompt


def test_reward_components() -> None:
    task = {"prompt": "What is 37 + 48?", "answer": 85}
    called = [("calculator", '{"expression": "37 + 48"}', "85")]
    assert arithmetic.reward(task, ToolAgentResult("The answer is 85.", [], called, 2)) == {"correct": 1.0,
                                                                                            "tool": 0.1}
    assert arithmetic.reward(task, ToolAgentResult("The answer is 84.", [], called, 2)) == {"correct": 0.0,
                                                                                            "tool": 0.1}
    failed_call = [("calculator", '{"expression": "37 +"}', "Error: cannot parse '37 +'")]
    assert arithmetic.reward(task, ToolAgentResult("85", [], failed_call, 2)) == {"correct": 1.0, "tool": 0.0}
    assert arithmetic.reward(task, "The answer is 85.") == {"correct": 1.0, "tool": 0.0}
    assert arithmetic.reward(task, None) == {"correct": 0.0, "tool": 0.0}


def test_warm_start_conversations_render_with_one_tool_call(tiny_model) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    conversations = arithmetic.warm_start_conversations(40, seed=0, tool_fraction=0.5)
    with_tool = 0
    for c in conversations:
        text = tok.apply_chat_template(c["messages"], tools=c["tools"], tokenize=False)
        calls = text.count("<tool_call>\n{\"name\": \"calculator\"")
        assert calls in (0, 1)
        with_tool += calls
        if calls:  # the tool's answer is what the final message states
            answer = arithmetic.final_answer(c["messages"][-1]["content"])
            assert f"<tool_response>\n{answer}\n</tool_response>" in text
    assert 10 <= with_tool <= 30  # about half, from a seeded stream
    assert all(text.count("<tool_call>\n{\"name\": \"calculator\"") == 1 for text in (
        tok.apply_chat_template(c["messages"], tools=c["tools"], tokenize=False)
        for c in arithmetic.warm_start_conversations(5, seed=1)))
