"""The demo's packing environment: the forecast table, tasks, the reward, the warm-start episodes,
and the claim the demo rests on: nothing that ignores the episode's input beats version 0.

The episodes are checked against the real chat template of a model made by init-model and
against the proxy's own tool-call parser, as for `arithmetic`: what the warm start teaches must
be what the capture proxy renders for, and parses back from, a tool-agent episode.
"""

from __future__ import annotations

import importlib
import itertools
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from collectors.agents.tool_agent import ToolAgentResult
from collectors.agents.tools import tool_schema
from collectors.envs import packing
from collectors.errors import CollectorError
from collectors.model.toolcalls import parse_output

TASK = importlib.import_module("collectors.agents.tool_agent")._TASK  # what the tool agent sets per episode
ROUND = len(packing.PLACES)  # tasks per round: every (city, day) once


def test_the_forecast_table_is_fixed_and_balanced() -> None:
    assert set(packing.FORECAST) == set(itertools.product(packing.CITIES, packing.DAYS))
    assert Counter(packing.FORECAST.values()) == {w: ROUND // len(packing.ITEM_FOR) for w in packing.ITEM_FOR}
    assert len(set(packing.ITEMS)) == len(packing.ITEM_FOR)  # one right item per weather, all different
    # every city and every day sees more than one weather: the question alone does not name the item
    for city in packing.CITIES:
        assert len({packing.FORECAST[city, d] for d in packing.DAYS}) > 1
    for day in packing.DAYS:
        assert len({packing.FORECAST[c, day] for c in packing.CITIES}) > 1


def test_the_tool_reads_the_episodes_trip_and_needs_one() -> None:
    token = TASK.set({"city": "Oslo", "day": 4})
    try:
        assert packing.forecast() == packing.hourly(packing.FORECAST["Oslo", 4])
    finally:
        TASK.reset(token)
    assert packing.hourly("snow").split() == ["snow"] * packing.HOURS
    with pytest.raises(CollectorError, match="tool_agent episode"):
        packing.forecast()
    schema = tool_schema(packing.forecast)["function"]
    assert schema["name"] == "forecast" and schema["parameters"]["properties"] == {}


def test_tasks_come_in_balanced_rounds_and_are_deterministic() -> None:
    tasks = packing.tasks(3 * ROUND + 5, seed=3)
    assert tasks == packing.tasks(3 * ROUND + 5, seed=3) and tasks != packing.tasks(3 * ROUND + 5, seed=4)
    assert len({t["id"] for t in tasks}) == len(tasks)
    for n in range(3):
        block = tasks[n * ROUND:(n + 1) * ROUND]
        assert {(t["city"], t["day"]) for t in block} == set(packing.PLACES)
    for t in tasks:
        assert t["answer"] == packing.ITEM_FOR[packing.FORECAST[t["city"], t["day"]]]
        assert t["system"] == packing.SYSTEM and t["prompt"] == packing.question(t["city"], t["day"])
        assert not packing.named_items(t["prompt"])  # the question names no item


def test_write_tasks_writes_the_same_tasks_as_json_lines(tmp_path: Path) -> None:
    path = packing.write_tasks(tmp_path / "sub" / "tasks.jsonl", 5, seed=1)
    assert [json.loads(line) for line in path.read_text().splitlines()] == packing.tasks(5, seed=1)


def Result(text: str, forecast: str | None = "snow") -> ToolAgentResult:  # noqa: N802
    """What the built-in tool agent hands the reward: an episode that read `forecast` (None: called no tool)."""
    calls = [] if forecast is None else [("forecast", "{}", packing.hourly(forecast))]
    return ToolAgentResult(text=text, messages=[], tool_calls=calls, turns=1 + len(calls))


def test_reward_wants_the_forecast_read_then_the_right_item_and_no_other() -> None:
    task = {"answer": "boots"}
    assert packing.reward(task, Result("Pack the snow boots.")) == {"correct": 1.0}
    assert packing.reward(task, Result("BOOTS!")) == {"correct": 1.0}
    for wrong in ("Pack the snow coat.", "Pack the boots and the hat.", "coat boots hat lamp", "bootsy", ""):
        assert packing.reward(task, Result(wrong)) == {"correct": 0.0}, wrong
    # a right guess without reading the forecast is not a decision from it
    assert packing.reward(task, Result("Pack the boots.", forecast=None)) == {"correct": 0.0}
    failed = ToolAgentResult(text="Pack the boots.", messages=[], turns=2,
                             tool_calls=[("forecast", '{"city": "Oslo"}', "error: invalid arguments")])
    assert packing.reward(task, failed) == {"correct": 0.0}
    for garbage in (None, 42, "Pack the boots.", {"text": "boots"}):
        assert packing.reward(task, garbage) == {"correct": 0.0}


def test_nothing_that_ignores_the_input_beats_version_0() -> None:
    """The claim the demo rests on, for a task file like the demo's (512 tasks): a fixed reply after
    reading the forecast, whatever it says, and any policy that ignores the episode (a fixed mix of
    items) score at most 1/4 (plus the part round at the end), the rate the warm start was built for
    (an item at random); a reply without the forecast scores 0; only reading it does better."""
    tasks = packing.tasks(512, seed=1)
    blind = packing.best_blind_rate(tasks)
    assert blind <= 0.25 + 8 / 512  # 512 = 14 whole rounds + 8 tasks: at most 8 more of one item
    replies = [f"Pack the {w} {i}." for w in [*packing.ITEM_FOR, "clear"] for i in packing.ITEMS]
    replies += ["Pack the snow.", "Pack everything: coat, boots, hat, lamp.", "I do not know."]
    for reply in replies:
        rate = sum(packing.reward(t, Result(reply, weather(t)))["correct"] for t in tasks) / len(tasks)
        assert rate <= blind, (reply, rate)
        assert sum(packing.reward(t, Result(reply, None))["correct"] for t in tasks) == 0
    reading = sum(packing.reward(t, Result(packing.ITEM_FOR[weather(t)], weather(t)))["correct"] for t in tasks)
    assert reading == len(tasks)


def weather(task: dict[str, Any]) -> str:
    return packing.FORECAST[task["city"], task["day"]]


@pytest.mark.parametrize("right", [0.25, 0.3])
def test_the_warm_start_is_a_weak_demonstrator(right: float) -> None:
    """The worked episodes pack the right item with probability `right` (binomial bounds, 4000
    episodes) and, when wrong, any of the three wrong items alike (a chi-square test per weather,
    2 degrees of freedom each, 8 in all): with `right` = 1/4 the item is independent of the
    weather, as random as an input-blind policy."""
    right_count, wrong = 0, Counter()
    for conv in packing.warm_start_conversations(4000, seed=0, right=right):
        weather = conv["messages"][3]["content"].split()[0]
        (item,) = packing.named_items(conv["messages"][4]["content"])
        if item == packing.ITEM_FOR[weather]:
            right_count += 1
        else:
            wrong[weather, item] += 1
    sd = (right * (1 - right) / 4000) ** 0.5
    assert abs(right_count / 4000 - right) < 4 * sd, right_count
    chi2 = 0.0
    for w, answer in packing.ITEM_FOR.items():
        counts = [wrong[w, i] for i in packing.ITEMS if i != answer]
        expected = sum(counts) / 3
        chi2 += sum((c - expected) ** 2 / expected for c in counts)
    assert chi2 < 26.1, chi2  # the 0.999 quantile of chi-square with 8 degrees of freedom


def test_the_demonstrated_share_must_be_a_probability() -> None:
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="right must be"):
            packing.warm_start_conversations(4, right=bad)


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model))


def test_worked_episodes_render_as_the_proxy_renders_a_tool_agent_episode(tokenizer: Any) -> None:
    conversations = packing.warm_start_conversations(40, seed=2)
    assert conversations == packing.warm_start_conversations(40, seed=2)
    for conv in conversations:
        system, user, call, result, answer = conv["messages"]
        assert conv["tools"] == [tool_schema(packing.forecast)]
        assert system == {"role": "system", "content": packing.SYSTEM} and user["role"] == "user"
        prompt = tokenizer.apply_chat_template(conv["messages"][:2], tools=conv["tools"], tokenize=False,
                                               add_generation_prompt=True)
        text = tokenizer.apply_chat_template(conv["messages"], tools=conv["tools"], tokenize=False)
        sampled = text[len(prompt):text.index("<|im_end|>", len(prompt))]
        assert sampled == '<tool_call>\n{"name": "forecast", "arguments": {}}\n</tool_call>'
        (parsed,) = parse_output(sampled).tool_calls
        assert (parsed.name, parsed.arguments) == ("forecast", call["tool_calls"][0]["function"]["arguments"])
        weather = result["content"].split()[0]
        assert result == {"role": "tool", "tool_call_id": call["tool_calls"][0]["id"],
                          "content": packing.hourly(weather)}
        assert f"<tool_response>\n{result['content']}\n</tool_response>" in text
        assert answer["content"].startswith(f"Pack the {weather} ") and len(packing.named_items(answer["content"])) == 1
        # the repeated weather is the very token the forecast repeats: copying it is what the warm start teaches
        reply_ids = tokenizer.encode(answer["content"], add_special_tokens=False)
        assert tokenizer.encode(" " + weather, add_special_tokens=False)[0] in reply_ids
        assert tokenizer.encode(" " + weather, add_special_tokens=False)[0] in tokenizer.encode(
            result["content"], add_special_tokens=False)


def test_weathers_and_items_are_single_tokens_of_init_models_tokenizer(tokenizer: Any) -> None:
    """What RL learns is one token after another (the repeated weather, then the item); a word split
    into pieces would make the first piece the decision and blur it."""
    for word in [*packing.ITEM_FOR, *packing.ITEMS]:
        assert len(tokenizer.encode(" " + word, add_special_tokens=False)) == 1, word
    for weather in packing.ITEM_FOR:
        assert len(tokenizer.encode(weather, add_special_tokens=False)) == 1, weather  # the forecast's first hour
