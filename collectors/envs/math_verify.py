"""`math-verify` as a reward: is a reply's final math answer equal to the task's `answer`?

    trajstore collect ... --tasks tasks.jsonl --reward math_verify
    (the same as --reward collectors.envs.math_verify:reward)

Each task carries its gold answer in `answer` (`"1/2"`, `"\\frac{1}{2}"`, `"$x^2+1$"`, `42`);
the reward parses it and the reply's text (the agent's result: text, or its `text`) with
math-verify's LaTeX and plain-expression extractors and compares them symbolically, so
`0.5`, `1/2` and `\\boxed{\\frac12}` all match a gold `1/2`:

    {"math_verify": 1.0 when they are equal, else 0.0}

A gold answer math-verify cannot parse is an error in the task, reported as such (the
rollout fails with that message) rather than silently scored 0 for every rollout.

math-verify bounds parsing and comparison with SIGALRM, which exists only in the main
thread; rewards run in worker threads (so one cannot stall the collector's event loop), so
its own timeouts are off here and collect's --rollout-timeout bounds the reward instead.
"""

from __future__ import annotations

from typing import Any

from collectors.agents.context import result_text
from collectors.errors import CollectorError

NAME = "math_verify"


class GoldAnswerError(CollectorError, ValueError):
    """The task's gold answer is missing or not parseable math."""


def _parse(text: str) -> list[Any]:
    import math_verify

    return math_verify.parse(text, parsing_timeout=None)  # type: ignore[arg-type]


def gold(answer: Any) -> list[Any]:
    """The parsed gold answer; a bare LaTeX answer (`\\frac{1}{2}`) is read as inline math."""
    if answer is None or isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise GoldAnswerError(f"a math_verify task needs `answer`: the gold answer as text or a number, got {answer!r}")
    text = str(answer)
    parsed = _parse(text) or _parse(f"${text}$")
    if not parsed:
        raise GoldAnswerError(f"math-verify cannot parse the task's answer {text!r}; write it as LaTeX "
                              "($\\frac{1}{2}$) or a plain expression (1/2)")
    return parsed


def matches(expected: list[Any], reply: str | None) -> bool:
    """Whether `reply`'s final answer equals the parsed gold answer `expected`, as math-verify judges it."""
    import math_verify

    found = _parse(reply) if reply else []
    return bool(found) and bool(math_verify.verify(expected, found, timeout_seconds=None))  # type: ignore[arg-type]


def reward(task: dict[str, Any], result: Any, rollout: Any = None) -> dict[str, float]:
    """`{"math_verify": 1.0 or 0.0}` (see the module docstring)."""
    return {NAME: 1.0 if matches(gold(task.get("answer")), result_text(result)) else 0.0}
