"""A small coding environment: write one function in `solution.py`, graded by running its tests.

Each task asks for one short function (reverse a string, sum the even numbers, a FizzBuzz
variant, ...); its inputs, and for some specs its rules, are drawn from the seed:

    {"id": "coding-0-3-fizzbuzz", "prompt": "Write the function fizzbuzz in solution.py ...",
     "files": {"solution.py": "<stub that raises NotImplementedError>",
               "test_solution.py": "<plain-assert tests>"},
     "function": "fizzbuzz", "reference": "<a correct solution.py>"}

The runner writes `task["files"]` into the rollout's working directory before the agent
starts. `agent` asks the model (OpenAI SDK, one call) for the code and writes the first
```python block of its reply (or the whole reply) to `solution.py`. Grading is either
`--reward-cmd "python test_solution.py"` (`REWARD_CMD`, exit 0 = pass) or `reward`, which
restores the test file (an agent must not pass by editing it), runs it with a time limit and
returns `{"tests_passed": 1.0 or 0.0}`. The tests need nothing but `python`.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from collectors.agents import AgentContext, RolloutInfo

REWARD_CMD = "python test_solution.py"
TEST_TIMEOUT_S = 10.0
SYSTEM = ("You are a careful Python programmer. Reply with the complete contents of solution.py "
          "in one ```python code block.")


@dataclass(frozen=True)
class Spec:
    """One function to write: its prompt text, a correct implementation and test inputs."""

    function: str
    signature: str  # "def f(x: int) -> int:"
    description: str
    reference: str  # the body of a correct implementation, indented by 4
    inputs: list[tuple[Any, ...]]


def _words(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("abcdeiouxyz ") for _ in range(n))


def _reverse(rng: random.Random) -> Spec:
    return Spec("reverse_string", "def reverse_string(s: str) -> str:", "returns s reversed",
                "    return s[::-1]\n", [("",), ("a",)] + [(_words(rng, rng.randint(2, 12)),) for _ in range(4)])


def _sum_evens(rng: random.Random) -> Spec:
    lists = [[rng.randint(-20, 20) for _ in range(rng.randint(0, 8))] for _ in range(5)]
    return Spec("sum_of_evens", "def sum_of_evens(numbers: list[int]) -> int:",
                "returns the sum of the even numbers in the list (0 for an empty list)",
                "    return sum(n for n in numbers if n % 2 == 0)\n", [([],), *[(x,) for x in lists]])


def _fizzbuzz(rng: random.Random) -> Spec:
    a, b = rng.sample([2, 3, 5, 7], 2)
    return Spec("fizzbuzz", "def fizzbuzz(n: int) -> str:",
                f'returns "FizzBuzz" if n is divisible by both {a} and {b}, "Fizz" if only by {a}, '
                f'"Buzz" if only by {b}, and otherwise str(n)',
                f'    if n % {a} == 0 and n % {b} == 0:\n        return "FizzBuzz"\n'
                f'    if n % {a} == 0:\n        return "Fizz"\n    if n % {b} == 0:\n        return "Buzz"\n'
                "    return str(n)\n", [(a * b,), (a,), (b,), (1,), *[(rng.randint(1, 100),) for _ in range(4)]])


def _count_vowels(rng: random.Random) -> Spec:
    return Spec("count_vowels", "def count_vowels(s: str) -> int:",
                "returns how many characters of s are vowels (a, e, i, o, u, upper or lower case)",
                '    return sum(1 for c in s.lower() if c in "aeiou")\n',
                [("",), ("AEIOU",), *[(_words(rng, rng.randint(3, 15)),) for _ in range(4)]])


def _palindrome(rng: random.Random) -> Spec:
    word = _words(rng, rng.randint(2, 6)).replace(" ", "x")
    return Spec("is_palindrome", "def is_palindrome(s: str) -> bool:",
                "returns True if s reads the same backwards, ignoring case and every character that is not "
                "a letter or a digit",
                "    t = [c.lower() for c in s if c.isalnum()]\n    return t == t[::-1]\n",
                [("",), ("Racecar",), ("A man, a plan, a canal: Panama",), (word + word[::-1],),
                 (word + "q",), (_words(rng, 7),)])


def _longest_run(rng: random.Random) -> Spec:
    lists = [[rng.randint(0, 2) for _ in range(rng.randint(1, 10))] for _ in range(5)]
    return Spec("longest_run", "def longest_run(numbers: list[int]) -> int:",
                "returns the length of the longest stretch of equal consecutive numbers (0 for an empty list)",
                "    best = run = 0\n    for i, n in enumerate(numbers):\n"
                "        run = run + 1 if i and numbers[i - 1] == n else 1\n        best = max(best, run)\n"
                "    return best\n", [([],), *[(x,) for x in lists]])


def _clamp(rng: random.Random) -> Spec:
    lo, hi = sorted(rng.sample(range(-10, 11), 2))
    return Spec("clamp", "def clamp(x: int, lo: int, hi: int) -> int:",
                "returns x limited to the range lo..hi (lo if x < lo, hi if x > hi, else x)",
                "    return max(lo, min(hi, x))\n",
                [(lo - 5, lo, hi), (hi + 5, lo, hi), (lo, lo, hi), (hi, lo, hi),
                 *[(rng.randint(-15, 15), lo, hi) for _ in range(3)]])


SPECS: tuple[Callable[[random.Random], Spec], ...] = (
    _reverse, _sum_evens, _fizzbuzz, _count_vowels, _palindrome, _longest_run, _clamp)


def tasks(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """`count` tasks, the same for the same seed; every spec appears before any repeats."""
    rng = random.Random(seed)
    order: list[Callable[[random.Random], Spec]] = []
    out = []
    for i in range(count):
        if not order:
            order = rng.sample(SPECS, len(SPECS))
        spec = order.pop()(rng)
        out.append(_task(f"coding-{seed}-{i}-{spec.function}", spec))
    return out


def _task(task_id: str, spec: Spec) -> dict[str, Any]:
    stub = f"{spec.signature}\n    raise NotImplementedError\n"
    reference = f"{spec.signature}\n{spec.reference}"
    namespace: dict[str, Any] = {}
    exec(reference, namespace)  # noqa: S102 - our own reference code, to compute the expected values
    cases = [(args, namespace[spec.function](*args)) for args in spec.inputs]
    lines = ",\n".join(f"    ({args!r}, {expected!r})" for args, expected in cases)
    test = (f'"""Tests of solution.py: `python test_solution.py` exits 0 when all pass."""\n\n'
            f"from solution import {spec.function}\n\nCASES = [\n{lines},\n]\n\n"
            "for args, expected in CASES:\n"
            f"    got = {spec.function}(*args)\n"
            f"    assert got == expected, f'{spec.function}{{args!r}} returned {{got!r}}, expected {{expected!r}}'\n"
            'print(f"all {len(CASES)} tests passed")\n')
    prompt = (f"Write the function {spec.function} in solution.py: it {spec.description}.\n\n"
              f"solution.py now holds this stub:\n```python\n{stub}```\n"
              "Reply with the complete new solution.py in one ```python code block.")
    return {"id": task_id, "prompt": prompt, "files": {"solution.py": stub, "test_solution.py": test},
            "function": spec.function, "reference": reference}


_BLOCK = re.compile(r"```[ \t]*(python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(reply: str) -> str:
    """The first ```python block of a reply, else its first ``` block, else the whole reply."""
    blocks = _BLOCK.findall(reply)
    tagged = [code for lang, code in blocks if lang]
    if tagged or blocks:
        return (tagged or [code for _, code in blocks])[0]
    return reply.strip() + "\n"


async def agent(task: dict[str, Any], ctx: AgentContext) -> str:
    """Ask the model for solution.py once, write what it gave to the workdir; returns the code written."""
    response = await ctx.openai.chat.completions.create(
        model=ctx.model, max_tokens=ctx.max_tokens, **ctx.sampling,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["prompt"]}])
    choice = response.choices[0]
    if choice.finish_reason == "length":
        ctx.truncate("max_tokens")
    code = extract_code(choice.message.content or "")
    (ctx.workdir / "solution.py").write_text(code)
    return code


async def reward(task: dict[str, Any], result: Any, rollout: RolloutInfo) -> dict[str, float]:
    """`{"tests_passed": 1.0}` when the task's tests pass in the rollout's workdir, else 0.0."""
    return {"tests_passed": 1.0 if await run_tests(task, Path(rollout.workdir)) else 0.0}


async def run_tests(task: dict[str, Any], workdir: Path, timeout_s: float = TEST_TIMEOUT_S) -> bool:
    """Restore the task's test file in `workdir`, run it with `python`; True when it exits 0 in time."""
    (workdir / "test_solution.py").write_text(task["files"]["test_solution.py"])
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "test_solution.py", cwd=workdir, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        start_new_session=True)  # its own process group: a solution that forks is killed whole
    try:
        return await asyncio.wait_for(proc.wait(), timeout_s) == 0
    except TimeoutError:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # it ended between the timeout and the kill
        await proc.wait()
        return False
