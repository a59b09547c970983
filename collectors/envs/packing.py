"""The demo's packing environment: check the forecast with a tool, then decide what to pack from it.

An episode (two model calls, one tool call):

    user:       I will be in Oslo in 4 days. What should I pack?
    assistant:  <tool_call>\\n{"name": "forecast", "arguments": {}}\\n</tool_call>
    tool:       snow snow snow ... (one word per hour of the trip day)
    assistant:  Pack the snow boots.

The forecast of each (city, days ahead) comes from a fixed table (`FORECAST`, every weather
equally often), and each weather has one right item (`ITEM_FOR`: snow -> boots, rain -> coat,
sun -> hat, fog -> lamp). The reward `correct` is 1 when the episode called the forecast and its
final reply names the right item and no other item.

What makes it a test of RL rather than of memory:
- success depends on each episode's input: the forecast differs by city and day, and the
  task list (`tasks`) cycles through every (city, day) in shuffled rounds, so every weather
  and every item is the answer equally often; any fixed item, and any policy that ignores
  the input, is right in exactly 1/4 of the tasks of a whole round (`best_blind_rate`);
- the warm start (`warm_start_conversations`) teaches the format and the tool protocol (call
  `forecast`, repeat the weather it returned, then name an item) from a demonstrator that
  packs the right item in a share `right` of its episodes and a random wrong one otherwise,
  so above 1/4 it shows the mapping only as a weak preference;
- what RL must learn is one decision the model makes from what the tool returned: which item
  goes with which weather, an association from a token the tool wrote (and the model
  repeated) to the next token the model writes.

Pieces, each plugged into `trajstore collect` / the warm start by import path: `forecast`
(the tool), `SYSTEM`, `tasks` / `write_tasks`, `reward`, `warm_start_conversations`, and
`best_blind_rate` (the best that a policy ignoring the input can score on a task list).
"""

from __future__ import annotations

import itertools
import json
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from collectors.agents.tool_agent import current_task
from collectors.agents.tools import tool_schema

SYSTEM = "Check the forecast, then say which one item to pack."
CITIES = ("Paris", "London", "Tokyo", "Berlin", "Sydney", "Oslo")
DAYS = (2, 3, 4, 5, 6, 7)  # days ahead: single digits, and "in N days" stays plural
ITEM_FOR = {"rain": "coat", "snow": "boots", "sun": "hat", "fog": "lamp"}
ITEMS = tuple(ITEM_FOR.values())
HOURS = 24  # the forecast tool returns one weather word per hour of the trip day
PLACES = tuple(itertools.product(CITIES, DAYS))  # one round of tasks: every (city, days ahead) once

# Every weather the same number of times (36 places = 4 weathers x 9), spread by a fixed
# shuffle: a world, not a random draw, so a forecast never changes between runs.
_WEATHERS = [w for w in ITEM_FOR for _ in range(len(PLACES) // len(ITEM_FOR))]
random.Random("packing-forecast").shuffle(_WEATHERS)
FORECAST: dict[tuple[str, int], str] = dict(zip(PLACES, _WEATHERS, strict=True))
_WORD = re.compile(r"[a-z]+")


def forecast() -> str:
    """Get the hourly forecast for the user's trip."""
    task = current_task()
    return hourly(FORECAST[task["city"], task["day"]])


def hourly(weather: str) -> str:
    """The forecast tool's text: the weather of each of the trip day's `HOURS` hours."""
    return " ".join([weather] * HOURS)


def question(city: str, days_ahead: int) -> str:
    return f"I will be in {city} in {days_ahead} days. What should I pack?"


def tasks(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """`count` tasks `{"id", "system", "prompt", "city", "day", "answer"}`, the same for the same seed.

    The (city, day) pairs come in rounds: each round is every pair of `PLACES` once, in a
    shuffled order, so in any whole number of rounds every weather and item is the answer
    equally often."""
    rng = random.Random(f"packing-tasks-{seed}")
    places: list[tuple[str, int]] = []
    while len(places) < count:
        places += rng.sample(PLACES, len(PLACES))
    return [_task(city, day, f"pack-{seed}-{i}") for i, (city, day) in enumerate(places[:count])]


def _task(city: str, day: int, task_id: str) -> dict[str, Any]:
    return {"id": task_id, "system": SYSTEM, "prompt": question(city, day), "city": city, "day": day,
            "answer": ITEM_FOR[FORECAST[city, day]]}


def write_tasks(path: str | Path, count: int, seed: int = 0) -> Path:
    """Write `tasks(count, seed)` as JSON lines, the task-file format of `trajstore collect`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks(count, seed)))
    return path


def named_items(text: str | None) -> set[str]:
    """The known items a reply names (whole words, any case)."""
    return set(_WORD.findall((text or "").lower())) & set(ITEMS)


def reward(task: dict[str, Any], result: Any, rollout: Any = None) -> dict[str, float]:
    """`{"correct": 1.0}` when the episode read the forecast and its final reply names the task's
    answer and no other item, else 0.0.

    `result` is the tool agent's result: its `tool_calls` must hold a `forecast` call that
    returned the forecast (a guess made without reading it is not a decision from the forecast,
    and scoring it would let the policy drift away from the tool while guessing pays as well),
    and its `text` is the final reply. Naming several items is not an answer, so it scores 0.
    """
    calls = getattr(result, "tool_calls", None) or []
    read = any(name == "forecast" and output in map(hourly, ITEM_FOR) for name, _, output in calls)
    text = getattr(result, "text", None)
    return {"correct": 1.0 if read and named_items(text) == {task["answer"]} else 0.0}


def answer_text(weather: str, item: str) -> str:
    """How an episode states its decision: the forecast it read, then the item ("Pack the snow boots.")."""
    return f"Pack the {weather} {item}."


def best_blind_rate(task_list: Sequence[dict[str, Any]]) -> float:
    """The best expected success rate on `task_list` of a policy that ignores the input.

    Such a policy names item i with some probability p_i whatever the task, so it scores
    sum_i p_i * share(i) <= max_i share(i): the best fixed item bounds them all."""
    return max(sum(t["answer"] == item for t in task_list) for item in ITEMS) / len(task_list)


def _demonstrated_item(rng: random.Random, weather: str, right: float) -> str:
    """The right item with probability `right`, else one of the three wrong ones, uniformly."""
    if rng.random() < right:
        return ITEM_FOR[weather]
    return rng.choice([item for item in ITEMS if item != ITEM_FOR[weather]])


def warm_start_conversations(count: int, seed: int = 0, right: float = 0.25) -> list[dict[str, Any]]:
    """`count` worked episodes `{"messages", "tools"}`, in exactly the messages the tool agent sends.

    Each one calls the forecast, repeats the weather it got and names the right item with
    probability `right`, else one of the three wrong items alike: with `right` = 1/4 the item is
    independent of the weather (the model learns the format and the tool protocol, not which
    item); above 1/4 the episodes also show a weak preference for the right one. The questions
    come from their own random stream, so they are not the tasks of `tasks(n, seed)`.
    """
    if not 0.0 <= right <= 1.0:  # also refuses NaN
        raise ValueError(f"right must be a probability in [0, 1], got {right}")
    rng = random.Random(f"packing-warm-start-{seed}")
    schema = [tool_schema(forecast)]
    out = []
    for i in range(count):
        city, day = rng.choice(PLACES)
        call_id = f"call_{i}"
        weather = FORECAST[city, day]
        out.append({"tools": schema, "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question(city, day)},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": call_id, "type": "function", "function": {"name": "forecast", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": call_id, "content": hourly(weather)},
            {"role": "assistant", "content": answer_text(weather, _demonstrated_item(rng, weather, right))},
        ]})
    return out
