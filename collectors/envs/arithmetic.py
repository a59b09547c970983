"""The demo environment: arithmetic a tiny model can only get right by calling a calculator tool.

An episode is one question, `What is 37 + 48?`. Operands and answers have DIGITS digits, beyond
what a model of a few hundred thousand parameters can compute in its head; it has to copy the
expression into a `calculator` call, then copy the tool's answer into its reply:

    user:       What is 37 + 48?
    assistant:  <tool_call>\\n{"name": "calculator", "arguments": {"expression": "37 + 48"}}\\n</tool_call>
    tool:       85
    assistant:  The answer is 85.

Pieces, each plugged into `trajstore collect` / the warm start by import path:
- `calculator` and `TOOLS`: the tool the built-in tool agent offers (its schema comes from the
  signature and docstring, `collectors.agents.tools.tool_schema`);
- `SYSTEM`: the system prompt (every task carries it, so collection renders the same prompt as
  the warm start); `tasks` / `write_tasks`: deterministic task lists;
- `reward`: `{"correct": 1 or 0, "tool": TOOL_REWARD or 0}` for a finished episode;
- `warm_start_conversations`: worked episodes in exactly the message format the tool agent
  sends through the capture proxy, for the supervised warm start (`learner.sft`); a
  `tool_fraction` of them use the calculator, the others answer at once.

Why fixed-width numbers and the two-stage warm start (measured with a 0.56M-parameter model,
hidden 128, 2 layers, 8 heads of 16): everything the model must learn here is copying digits,
and a random model learns to copy only after a sudden transition whose timing varies a lot
from seed to seed. With the numbers at fixed offsets (two digits everywhere) and about 45
tokens of context, the transition comes after 150 to 300 steps of batch 16; behind the 250
tokens of system prompt and tool list that every real prompt starts with, it came after 300
to more than 500 steps, or not at all in a 500-step budget. Hence `bare=True` episodes (no
system prompt, no tool list) for a first warm-start stage until copying works, then the real
format with a `tool_fraction` of tool use, which takes the copying along in a few dozen steps.
Head size matters too: with heads of 8 dimensions the transition rarely came at all. (`trajstore
demo` does not use the two stages yet: its 230k-parameter model, 8 heads of 8, learns to use
the tool within its 10-minute budget but copies digits only rarely.)

Why the small `tool` component: a tiny model copies digits unreliably, so right after a warm
start many episodes are wrong whether or not they called the tool, and a reward that only says
"wrong" gives such groups no signal at all (every member scores 0). A call that the calculator
evaluated is the step every correct episode shares, so it separates the better half of a
failing group; it is worth a tenth of a correct answer so it can never outweigh one.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from collectors.errors import CollectorError

SYSTEM = "Use the calculator tool, then give the answer."
OPERATORS = ("+", "-")
DIGITS = 2  # operands and answers have exactly this many digits (see the module docstring)
TOOL_REWARD = 0.1
MAX_EXPRESSION = 200  # characters; keeps a sampled expression from costing real time

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_SYMBOL = {ast.Pow: "**", ast.BitXor: "^", ast.BitAnd: "&", ast.BitOr: "|", ast.LShift: "<<", ast.RShift: ">>",
           ast.MatMult: "@"}
_INTEGER = re.compile(r"-?\d+")


class CalculatorError(CollectorError, ValueError):
    """An expression the calculator does not evaluate; the message is the tool's answer."""


# The docstring becomes the tool's description in every prompt, so it writes no operator or digit:
# a tiny model's copy attention confuses those with the question's own (with "+ - * / // %" in it,
# warm-started models copied the operator from the description in some seeds).
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The arithmetic to evaluate, in integers.
    """
    try:
        return _format(_evaluate(expression))
    except CalculatorError as exc:
        return f"Error: {exc}"


TOOLS = [calculator]


def _evaluate(expression: str) -> int | float:
    if not isinstance(expression, str) or not expression.strip():
        raise CalculatorError("empty expression; write one such as 12 * (3 + 4)")
    if len(expression) > MAX_EXPRESSION:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError(f"cannot parse {expression!r}; use integers, + - * / // % and parentheses") from None
    return _node(tree.body)


def _node(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _node(node.left), _node(node.right)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalculatorError("division by zero")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_node(node.operand))
    if isinstance(node, ast.BinOp):
        symbol = _SYMBOL.get(type(node.op), type(node.op).__name__)
        raise CalculatorError(f"operator {symbol} is not supported; use + - * / // %")
    if isinstance(node, ast.Constant):
        raise CalculatorError(f"only integers are supported, got {node.value!r}")
    raise CalculatorError(f"{ast.unparse(node)!r} is not arithmetic; use integers, + - * / // % and parentheses")


def _format(value: int | float) -> str:
    """Integers as such; a true division's result as an integer when exact, else to 6 decimals."""
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else f"{value:.6f}".rstrip("0")
    return str(value)


def tasks(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """`count` questions `{"id", "prompt", "answer"}`, the same for the same seed."""
    rng = random.Random(f"arithmetic-tasks-{seed}")
    return [_task(rng, f"arith-{seed}-{i}") for i in range(count)]


def _task(rng: random.Random, task_id: str) -> dict[str, Any]:
    low, high = 10 ** (DIGITS - 1), 10 ** DIGITS - 1
    while True:  # rejection sampling: a few draws on average
        a, b, op = rng.randint(low, high), rng.randint(low, high), rng.choice(OPERATORS)
        expression = f"{a} {op} {b}"
        answer = int(_evaluate(expression))
        if low <= answer <= high:
            return {"id": task_id, "system": SYSTEM, "prompt": f"What is {expression}?", "answer": answer}


def write_tasks(path: str | Path, count: int, seed: int = 0) -> Path:
    """Write `tasks(count, seed)` as JSON lines, the task-file format of `trajstore collect`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks(count, seed)))
    return path


def final_answer(text: str) -> int | None:
    """The last integer in a reply's text, or None when it has none."""
    found = _INTEGER.findall(text or "")
    return int(found[-1]) if found else None


def reward(task: dict[str, Any], result: Any, rollout: Any = None) -> dict[str, float]:
    """Score one episode: `correct` (1 or 0) and `tool` (TOOL_REWARD for a call the calculator evaluated).

    `result` is the tool agent's result (its `text` is the final reply, its `tool_calls` a
    list of `(name, arguments, output)`) or the final reply as a plain string.
    """
    text = result if isinstance(result, str) else getattr(result, "text", None)
    calls = () if isinstance(result, str) else getattr(result, "tool_calls", None) or ()
    correct = isinstance(text, str) and final_answer(text) == task["answer"]
    used_tool = any(name == "calculator" and _INTEGER.fullmatch(str(output).strip()) for name, _, output in calls)
    return {"correct": 1.0 if correct else 0.0, "tool": TOOL_REWARD if used_tool else 0.0}


def answer_text(answer: int) -> str:
    """How a worked episode states its answer."""
    return f"The answer is {answer}."


def warm_start_conversations(count: int, seed: int = 0, *, tool_fraction: float = 1.0,
                             bare: bool = False) -> list[dict[str, Any]]:
    """`count` worked episodes `{"messages", "tools"}`, in exactly the messages the tool agent sends.

    A `tool_fraction` of them call the calculator and copy its answer; the others state the
    right answer at once, as a teacher that does the sum in its head would. A tiny model cannot
    imitate the second kind (its direct answers are guesses), so a warm start on a mix leaves a
    policy that calls the tool only some of the time: RL then has to find out that it pays.

    `bare=True` leaves out the system prompt and the tool list (`tools` is None), so an episode
    is about 45 tokens instead of 300: the first stage of the warm start (see the module docstring).
    The questions come from their own random stream, so they are not the tasks of `tasks(n, seed)`.
    """
    from collectors.agents.tools import tool_schema  # imported here: the task and reward functions need nothing else

    if not 0.0 <= tool_fraction <= 1.0:
        raise ValueError(f"tool_fraction must be between 0 and 1 (got {tool_fraction})")
    rng = random.Random(f"arithmetic-warm-start-{seed}")
    schema = None if bare else [tool_schema(calculator)]
    out = []
    for i in range(count):
        task = _task(rng, f"warm-{seed}-{i}")
        messages: list[dict[str, Any]] = [] if bare else [{"role": "system", "content": SYSTEM}]
        messages.append({"role": "user", "content": task["prompt"]})
        if rng.random() < tool_fraction:
            expression = task["prompt"].removeprefix("What is ").removesuffix("?")
            call_id = f"call_{i}"
            messages += [
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": call_id, "type": "function",
                    "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})}}]},
                {"role": "tool", "tool_call_id": call_id, "content": calculator(expression)},
            ]
        messages.append({"role": "assistant", "content": answer_text(task["answer"])})
        out.append({"messages": messages, "tools": schema})
    return out
