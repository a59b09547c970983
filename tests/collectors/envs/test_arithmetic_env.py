"""The demo's arithmetic environment: the calculator, tasks, the reward and the warm-start episodes.

The episodes are checked against the real chat template of a model made by init-model and
against the proxy's own tool-call parser: what the warm start teaches must be exactly what the
capture proxy renders for, and parses back from, a tool-agent episode.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from collectors.agents.tool_agent import ToolAgentResult
from collectors.agents.tools import tool_schema
from collectors.envs import arithmetic
from collectors.model.toolcalls import parse_output


@pytest.mark.parametrize(("expression", "value"), [
    ("37 * 48", "1776"), ("12 * (3 + 4)", "84"), ("-5 + 2", "-3"), ("7 // 2", "3"), ("7 % 3", "1"),
    ("7 / 2", "3.5"), ("8 / 2", "4"), ("  90 - 91 ", "-1"), ("((1))", "1"), ("2 / 3", "0.666667"),
])
def test_calculator_evaluates_integer_arithmetic(expression: str, value: str) -> None:
    assert arithmetic.calculator(expression) == value


@pytest.mark.parametrize(("expression", "says"), [
    ("5 / 0", "division by zero"), ("5 // 0", "division by zero"), ("5 % (3 - 3)", "division by zero"),
    ("2 ** 10", "operator ** is not supported"), ("1.5 + 2", "only integers"), ("", "empty expression"),
    ("1 +", "cannot parse"), ("x + 1", "is not arithmetic"), ("__import__('os').getcwd()", "is not arithmetic"),
    ("'a' * 3", "only integers"), ("9" * 300, "longer than"), ("[1, 2]", "is not arithmetic"),
])
def test_calculator_answers_bad_expressions_with_error_text_not_exceptions(expression: str, says: str) -> None:
    out = arithmetic.calculator(expression)
    assert out.startswith("Error: ") and says in out and len(out) < 300, out


def test_the_calculator_schema_is_short_and_typed() -> None:
    schema = tool_schema(arithmetic.calculator)["function"]
    assert schema["name"] == "calculator" and schema["description"] == "Evaluate an arithmetic expression."
    assert schema["parameters"]["properties"]["expression"]["type"] == "string"
    assert schema["parameters"]["required"] == ["expression"]
    assert arithmetic.TOOLS == [arithmetic.calculator]


def test_tasks_are_deterministic_and_need_the_tool() -> None:
    tasks = arithmetic.tasks(200, seed=3)
    assert tasks == arithmetic.tasks(200, seed=3) and tasks != arithmetic.tasks(200, seed=4)
    assert len({t["id"] for t in tasks}) == 200
    low, high = 10 ** (arithmetic.DIGITS - 1), 10 ** arithmetic.DIGITS
    for task in tasks:
        expression = task["prompt"].removeprefix("What is ").removesuffix("?")
        a, op, b = expression.split(" ")
        assert op in arithmetic.OPERATORS and all(low <= int(x) < high for x in (a, b, task["answer"]))
        assert arithmetic.calculator(expression) == str(task["answer"])
        assert task["system"] == arithmetic.SYSTEM
    assert {t["prompt"].split(" ")[3] for t in tasks} == set(arithmetic.OPERATORS)
    assert len({t["answer"] for t in tasks}) > 50  # not a handful of answers a model could memorize


def test_write_tasks_writes_the_same_tasks_as_json_lines(tmp_path: Path) -> None:
    path = arithmetic.write_tasks(tmp_path / "sub" / "tasks.jsonl", 5, seed=1)
    assert [json.loads(line) for line in path.read_text().splitlines()] == arithmetic.tasks(5, seed=1)


def Result(text: str, calls: list[tuple[str, str, str]] | None = None) -> ToolAgentResult:  # noqa: N802
    """What the built-in tool agent hands the reward."""
    return ToolAgentResult(text=text, messages=[], tool_calls=calls or [], turns=1 + bool(calls))


def test_reward_scores_the_final_answer() -> None:
    task = {"id": "t", "prompt": "What is 12 + 30?", "answer": 42}
    call = [("calculator", '{"expression": "12 + 30"}', "42")]
    right = arithmetic.reward(task, Result("The answer is 42.", call))
    assert right["correct"] == 1.0 and sum(right.values()) > 1.0  # the call earns its small extra
    assert arithmetic.reward(task, "The answer is 42.")["correct"] == 1.0  # a plain string is a final reply
    assert arithmetic.reward(task, Result("12 + 30 is 42"))["correct"] == 1.0  # the last number counts
    assert arithmetic.reward(task, Result("The answer is 43.", call))["correct"] == 0.0
    assert arithmetic.reward(task, Result("The answer is 420."))["correct"] == 0.0
    for garbage in (Result(""), Result("no idea"), None, 42, Result('<tool_call>\n{"name": "calc'), {"text": 42}):
        assert arithmetic.reward(task, garbage) == {name: 0.0 for name in right}, garbage


def test_only_a_call_the_calculator_evaluated_earns_the_tool_component() -> None:
    task = {"id": "t", "prompt": "What is 12 + 30?", "answer": 42}
    failed = [("calculator", '{"expression": "12 +"}', arithmetic.calculator("12 +"))]
    other = [("search", '{"q": "12 + 30"}', "42")]
    assert arithmetic.reward(task, Result("The answer is 7.", failed)) == {"correct": 0.0, "tool": 0.0}
    assert arithmetic.reward(task, Result("The answer is 7.", other)) == {"correct": 0.0, "tool": 0.0}
    wrong_sum = [("calculator", '{"expression": "12 + 31"}', "43")]
    assert arithmetic.reward(task, Result("The answer is 43.", wrong_sum)) == {"correct": 0.0,
                                                                             "tool": arithmetic.TOOL_REWARD}


CALL = '<tool_call>\n{"name": "calculator"'


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model))


def test_worked_episodes_render_as_the_proxy_renders_a_tool_agent_episode(tokenizer: Any) -> None:
    conversations = arithmetic.warm_start_conversations(40, seed=2, tool_fraction=1.0)
    assert conversations == arithmetic.warm_start_conversations(40, seed=2, tool_fraction=1.0)
    questions = {t["prompt"] for t in arithmetic.tasks(40, seed=2)}
    assert len(questions & {c["messages"][1]["content"] for c in conversations}) < 5  # their own stream
    for conv in conversations:
        system, user, call, result, answer = conv["messages"]
        assert conv["tools"] == [tool_schema(arithmetic.calculator)]
        assert system == {"role": "system", "content": arithmetic.SYSTEM} and user["role"] == "user"
        text = tokenizer.apply_chat_template(conv["messages"], tools=conv["tools"], tokenize=False)
        assert text.count(CALL) == 1  # (the tools block mentions `<tool_call>` too, but calls nothing)
        assert text.count("<tool_response>") == 1 and text.count("<|im_start|>assistant") == 2
        expression = user["content"].removeprefix("What is ").removesuffix("?")
        # the first assistant turn, as the model would sample it, parses back into this very call
        prompt = tokenizer.apply_chat_template(conv["messages"][:2], tools=conv["tools"], tokenize=False,
                                               add_generation_prompt=True)
        sampled = text[len(prompt):text.index("<|im_end|>", len(prompt))]
        assert sampled == ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "'
                           + expression + '"}}\n</tool_call>')
        (parsed,) = parse_output(sampled).tool_calls
        assert (parsed.name, parsed.arguments) == ("calculator", call["tool_calls"][0]["function"]["arguments"])
        assert result == {"role": "tool", "tool_call_id": call["tool_calls"][0]["id"],
                          "content": arithmetic.calculator(expression)}
        assert f"<tool_response>\n{result['content']}\n</tool_response>" in text
        assert answer == {"role": "assistant", "content": arithmetic.answer_text(int(result["content"]))}
        assert arithmetic.reward({"answer": int(result["content"])}, answer["content"])["correct"] == 1.0


def test_a_tool_fraction_of_episodes_call_the_calculator(tokenizer: Any) -> None:
    conversations = arithmetic.warm_start_conversations(400, seed=0, tool_fraction=0.25)
    calls = [c for c in conversations if len(c["messages"]) == 5]
    assert 70 <= len(calls) <= 130
    for conv in conversations:
        if len(conv["messages"]) == 3:  # a direct answer: no call, the right number
            system, user, answer = conv["messages"]
            text = tokenizer.apply_chat_template(conv["messages"], tools=conv["tools"], tokenize=False)
            assert CALL not in text and "<tool_response>" not in text
            expected = int(arithmetic.calculator(user["content"].removeprefix("What is ").removesuffix("?")))
            assert answer == {"role": "assistant", "content": arithmetic.answer_text(expected)}
    assert all(len(c["messages"]) == 3 for c in arithmetic.warm_start_conversations(20, tool_fraction=0.0))
    with pytest.raises(ValueError, match="tool_fraction"):
        arithmetic.warm_start_conversations(1, tool_fraction=1.5)


def test_bare_episodes_are_the_same_episodes_without_system_prompt_and_tools(tokenizer: Any) -> None:
    full = arithmetic.warm_start_conversations(10, seed=4)
    bare = arithmetic.warm_start_conversations(10, seed=4, bare=True)
    for f, b in zip(full, bare, strict=True):
        assert b["tools"] is None and b["messages"] == f["messages"][1:]
        text = tokenizer.apply_chat_template(b["messages"], tools=b["tools"], tokenize=False)
        assert text.startswith("<|im_start|>user\nWhat is ") and text.count(CALL) == 1
        assert len(tokenizer.encode(text)) < 80  # the short context where copying is learned fast
