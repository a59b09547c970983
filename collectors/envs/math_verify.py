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

import logging
from typing import Any

from collectors.agents.context import result_text
from collectors.errors import CollectorError

NAME = "math_verify"


class GoldAnswerError(CollectorError, ValueError):
    """The task's gold answer is missing or not parseable math."""


class _NoTimeoutNotice(logging.Filter):
    """Drops math-verify's warning that its timeout is off (on purpose here, see the module docstring),
    which it would log at every call."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_NoTimeoutNotice())


def _parse(text: str) -> list[Any]:
    import math_verify

    return math_verify.parse(text, parsing_timeout=None)  # type: ignore[arg-type]


def _is_math(parsed: list[Any]) -> bool:
    """Whether math-verify found math: it falls back to the raw string when it found none."""
    return any(not isinstance(p, str) for p in parsed)


def gold(answer: Any) -> list[Any]:
    """The parsed gold answer; a bare LaTeX answer (`\\frac{1}{2}`) is read as inline math."""
    if answer is None or isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise GoldAnswerError(f"a math_verify task needs `answer`: the gold answer as text or a number, got {answer!r}")
    text = str(answer)
    parsed = _parse(text)
    if not _is_math(parsed):
        parsed = _parse(f"${text}$")
    if not _is_math(parsed):
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
