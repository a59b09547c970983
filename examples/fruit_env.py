"""An example environment to copy for your own task: tasks, a tool, a reward, worked episodes.

An episode (two model calls, one tool call):

    user:       What colour is a banana?
    assistant:  <tool_call>\\n{"name": "look_up", "arguments": {}}\\n</tool_call>
    tool:       yellow yellow yellow ...
    assistant:  It is yellow.

Every piece is plugged into a command by its import path or file (run them from the
repository root, so `examples.fruit_env` imports):

    python -m examples.fruit_env my/                   # my/tasks.jsonl and my/sft.jsonl
    trajstore sft --model my/base --data my/sft.jsonl --out my/warm --steps 150 --threads 1
    trajstore collect ... --tasks my/tasks.jsonl --tools examples.fruit_env:look_up \\
        --reward examples.fruit_env:reward

Why it suits a model built on the spot: the tool takes no arguments (it reads the episode's
task with `current_task()`, so nothing has to be copied from the question into the call), and
it repeats the colour, which makes repeating it in the reply learnable by a short warm start.
The reward gives partial credit (`tool`: the look-up was made; `colour`: the reply names the
right colour and no other), so a model that has the format but not yet the answer still scores,
and the members of a group differ: that spread is what RL learns from.
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path
from typing import Any

SYSTEM = "Look the fruit up, then say its colour."
COLOUR_OF = {"banana": "yellow", "lime": "green", "cherry": "red", "plum": "purple"}
COLOURS = tuple(COLOUR_OF.values())
# The tool as the model sees it: what the built-in tool agent derives from `look_up` (its signature and
# docstring), spelled out for agent programs and the warm start, which must show the model the same prompt.
TOOL = {"type": "function", "function": {
    "name": "look_up", "description": "Look up the colour of the fruit the user asked about.",
    "parameters": {"type": "object", "properties": {}, "required": []}}}
REPEATS = 12  # the tool says the colour this many times: a tiny model learns to repeat a word it saw often
_WORD = re.compile(r"[a-z]+")


def look_up() -> str:
    """Look up the colour of the fruit the user asked about."""
    from collectors.agents.tool_agent import current_task  # the episode's task, set by the built-in tool agent

    return colour_text(COLOUR_OF[current_task()["fruit"]])


def colour_text(colour: str) -> str:
    """What the tool answers for `colour`."""
    return " ".join([colour] * REPEATS)


def tasks(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """`count` tasks `{"id", "system", "prompt", "fruit", "answer"}`: the task-file lines of `trajstore collect`."""
    rng = random.Random(f"fruit-tasks-{seed}")
    out = []
    for i in range(count):
        fruit = rng.choice(sorted(COLOUR_OF))
        out.append({"id": f"fruit-{seed}-{i}", "system": SYSTEM, "prompt": f"What colour is a {fruit}?",
                    "fruit": fruit, "answer": COLOUR_OF[fruit]})
    return out


def named_colours(text: str | None) -> set[str]:
    """The known colours a reply names (whole words, any case)."""
    return set(_WORD.findall((text or "").lower())) & set(COLOURS)


def reward(task: dict[str, Any], result: Any, rollout: Any = None) -> dict[str, float]:
    """`tool` 0.5 when the look-up was called, `colour` 0.5 when the final reply names the right colour only.

    `result` is the built-in tool agent's result (`text`, `tool_calls` as `(name, arguments,
    output)`), or an agent command's standard output (a string: only `colour` can be judged).
    """
    if isinstance(result, str):
        text, called = result, False
    else:
        text = getattr(result, "text", None)
        called = any(name == "look_up" for name, _, _ in getattr(result, "tool_calls", None) or ())
    return {"tool": 0.5 if called else 0.0, "colour": 0.5 if named_colours(text) == {task["answer"]} else 0.0}


def conversations(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """`count` worked episodes `{"messages", "tools"}` for `trajstore sft`, in the messages the tool agent sends."""
    rng = random.Random(f"fruit-sft-{seed}")
    out = []
    for i in range(count):
        fruit = rng.choice(sorted(COLOUR_OF))
        call = {"id": f"call_{i}", "type": "function", "function": {"name": "look_up", "arguments": "{}"}}
        out.append({"tools": [TOOL], "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"What colour is a {fruit}?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": colour_text(COLOUR_OF[fruit])},
            {"role": "assistant", "content": f"It is {COLOUR_OF[fruit]}."},
        ]})
    return out


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def main(argv: list[str]) -> None:
    """`python -m examples.fruit_env DIR [TASKS [EPISODES]]`: DIR/tasks.jsonl and DIR/sft.jsonl."""
    if not 1 <= len(argv) <= 3:
        sys.exit("usage: python -m examples.fruit_env DIR [TASKS=16] [EPISODES=400]")
    out = Path(argv[0])
    count = int(argv[1]) if len(argv) > 1 else 16
    episodes = int(argv[2]) if len(argv) > 2 else 400
    print(write_jsonl(out / "tasks.jsonl", tasks(count)), write_jsonl(out / "sft.jsonl", conversations(episodes)))


if __name__ == "__main__":
    main(sys.argv[1:])
