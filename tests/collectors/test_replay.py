"""`trajstore replay` over a real store whose turns hold token ids of the tiny model's tokenizer.

The episode: a tool-calling turn, the tool's answer and a final turn (one segment, with a
masked preamble), then a compaction that forks a second segment sampled by policy v2;
rewards (one component updated), a segment reward and a status.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from rich.console import Console

import trajstore
from cli.main import main
from cli.replay_cmd import render
from collectors.model.replies import response_calls
from collectors.model.toolcalls import ToolCall, parse_output
from collectors.replay import ToolResult, load_episode, spans, tokenizer_decode, tool_results
from trajstore import Reward, Status, Turn

REPO = Path(__file__).resolve().parents[2]
ROLLOUT = "rollout-weather-1"
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function",
          "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": CITY}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
OBSERVATION = ('\n<|im_start|>user\n<tool_response>\n{"temperature": 21}\n</tool_response><|im_end|>\n'
               '<|im_start|>assistant\n')
PREAMBLE, ANSWER = "Let me check. ", "It is 21 degrees in Paris.<|im_end|>"


def logprobs(n: int) -> list[float]:
    return [-(i % 4 + 1) / 4 for i in range(n)]  # exact in float32


@pytest.fixture(scope="module")
def tok(tiny_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def episode_store(tmp_path_factory: pytest.TempPathFactory, tok: Any) -> tuple[str, dict[str, Any]]:
    """The store location and the exact ids written, by name."""
    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    messages = [{"role": "system", "content": "You are a weather bot."},
                {"role": "user", "content": "What is the weather in Paris?"}]
    assistant = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    tool = {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"temperature": 21}'}
    ids = {"p0": enc(tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)),
           "o0": enc(CALL), "p1": enc(OBSERVATION), "pre": enc(PREAMBLE), "ans": enc(ANSWER),
           "p2": enc(tok.apply_chat_template([{"role": "user", "content": "Weather in Paris: 21."}],
                                             add_generation_prompt=True, tokenize=False)),
           "o2": enc("Paris: 21 degrees.<|im_end|>")}
    o1 = ids["pre"] + ids["ans"]
    base: dict[str, Any] = dict(group_id="g1", rollout_id=ROLLOUT, session_id="main")
    events: list[Any] = [
        Status(**{k: v for k, v in base.items() if k != "session_id"}, status="started", group_size=1),
        Turn(**base, segment_id="seg-a", turn_index=0, policy_version=1, prompt_ids=ids["p0"], output_ids=ids["o0"],
             output_logprobs=logprobs(len(ids["o0"])), finish_reason="tool_calls",
             sampling={"temperature": 1.0, "max_tokens": 64},
             request={"messages": messages, "tools": TOOLS},
             response={"choices": [{"message": assistant, "finish_reason": "tool_calls"}]}),
        Turn(**base, segment_id="seg-a", turn_index=1, policy_version=1, prompt_ids=ids["p1"], output_ids=o1,
             output_logprobs=logprobs(len(o1)), output_mask=[False] * len(ids["pre"]) + [True] * len(ids["ans"]),
             finish_reason="stop", request={"messages": [*messages, assistant, tool], "tools": TOOLS},
             response={"choices": [{"message": {"role": "assistant", "content": PREAMBLE + ANSWER}}]}),
        Turn(**base, segment_id="seg-b", turn_index=2, policy_version=2, prompt_ids=ids["p2"], output_ids=ids["o2"],
             output_logprobs=logprobs(len(ids["o2"])), finish_reason="stop"),
        Reward(group_id="g1", rollout_id=ROLLOUT, reward=1.0, reward_name="correct"),
        Reward(group_id="g1", rollout_id=ROLLOUT, reward=0.5, reward_name="format"),
        Reward(group_id="g1", rollout_id=ROLLOUT, reward=0.25, reward_name="format"),  # the latest value counts
        Reward(group_id="g1", rollout_id=ROLLOUT, reward=0.1, segment_id="seg-b"),
        Status(group_id="g1", rollout_id=ROLLOUT, status="completed"),
        Turn(group_id="g2", rollout_id="rollout-other", segment_id="seg-x", turn_index=0, policy_version=1,
             prompt_ids=[1, 2], output_ids=[3], output_logprobs=[-0.5]),
    ]
    loc = str(tmp_path_factory.mktemp("replay") / "store")
    with trajstore.open_store(loc).writer("test") as writer:
        for event in events:  # one append per event: distinct times, so "latest" is well defined
            writer.append([event])
    return loc, ids


def invoke(*args: str) -> Any:
    result = CliRunner().invoke(main, ["replay", *args], catch_exceptions=False)
    return result


def test_json_has_the_exact_tokens_the_masks_and_the_decoded_text(episode_store: tuple[str, dict], tiny_model: Path,
                                                                 tok: Any) -> None:
    loc, ids = episode_store
    result = invoke("--store", loc, ROLLOUT, "--model", str(tiny_model), "--json", "--tokens")
    assert result.exit_code == 0, result.output
    ep = json.loads(result.output)
    assert (ep["rollout_id"], ep["status"], ep["group_id"]) == (ROLLOUT, "completed", "g1")
    assert ep["rewards"] == {"correct": 1.0, "format": 0.25} and ep["reward"] == 1.25
    assert ep["policy_versions"] == [1, 2] and ep["decoded"]
    seg_a, seg_b = ep["segments"]
    assert (seg_a["segment_id"], seg_b["segment_id"], seg_b["reward"]) == ("seg-a", "seg-b", pytest.approx(0.1))
    t0, t1 = seg_a["turns"]
    assert t0["prompt_ids"] == ids["p0"] and t0["output_ids"] == ids["o0"]
    assert [s["kind"] for s in t0["spans"]] == ["prompt", "sampled"]
    assert t0["spans"][0]["text"] == tok.decode(ids["p0"]) and "What is the weather in Paris?" in t0["spans"][0]["text"]
    assert t0["spans"][1]["text"] == CALL and t0["spans"][1]["logprobs"] == logprobs(len(ids["o0"]))
    assert t0["tool_calls"] == [{"name": "get_weather", "arguments": '{"city": "Paris"}', "input": {"city": "Paris"},
                                 "id": "call_1"}]
    assert t1["tool_results"] == [{"content": '{"temperature": 21}', "name": "get_weather", "call_id": "call_1"}]
    assert [(s["kind"], s["text"]) for s in t1["spans"]] == [
        ("prompt", OBSERVATION), ("sampled_masked", PREAMBLE), ("sampled", ANSWER)]
    assert t1["output_mask"] == [False] * len(ids["pre"]) + [True] * len(ids["ans"])
    assert t1["output_logprobs"] == logprobs(len(ids["pre"]) + len(ids["ans"]))
    rows = t1["tokens"]
    assert [r["id"] for r in rows] == ids["p1"] + ids["pre"] + ids["ans"]
    assert [r["kind"] for r in rows].count("sampled_masked") == len(ids["pre"])
    assert [r["logprob"] for r in rows if r["kind"] != "prompt"] == t1["output_logprobs"]
    assert seg_b["turns"][0]["policy_version"] == 2 and seg_b["turns"][0]["tool_calls"] == []


def test_the_rendering_shows_text_tool_traffic_and_versions(episode_store: tuple[str, dict],
                                                           tiny_model: Path) -> None:
    loc, _ = episode_store
    result = invoke("--store", loc, ROLLOUT, "--model", str(tiny_model), "--tokens")
    assert result.exit_code == 0, result.output
    out = result.output
    for expected in ("status completed", "reward 1.25 (correct=1, format=0.25)", "policy versions 1, 2",
                     "segment 1/2 seg-a", "segment 2/2 seg-b", "segment reward 0.1", "What is the weather in Paris?",
                     '→ tool call get_weather {"city": "Paris"}', '← tool result (get_weather): {"temperature": 21}',
                     "It is 21 degrees in Paris.", "policy v2", "sampled_masked", "-0.2500"):
        assert expected in out, expected


def test_prompt_and_sampled_tokens_are_styled_apart(episode_store: tuple[str, dict], tiny_model: Path) -> None:
    loc, _ = episode_store
    decode = tokenizer_decode(str(tiny_model))
    episode = load_episode(trajstore.open_store(loc), ROLLOUT, decode=decode)
    sink = io.StringIO()
    render(episode, Console(file=sink, force_terminal=True, color_system="standard", width=300), decode=decode)
    out = sink.getvalue()
    assert "\x1b[1;32mIt is 21 degrees in Paris." in out  # sampled, trainable: bold green
    assert "\x1b[33mLet me check." in out  # sampled, masked: yellow
    assert "\x1b[2m<tool_response>\x1b[0m" in out  # tool observation: dim (rich styles each line)


def test_without_a_model_the_ids_are_shown(episode_store: tuple[str, dict]) -> None:
    loc, ids = episode_store
    result = invoke("--store", loc, ROLLOUT)
    assert result.exit_code == 0, result.output
    assert "pass --model DIR to decode" in result.output
    assert "[" + " ".join(map(str, ids["o0"][:3])) in result.output.replace("\n", " ")


def test_an_unknown_rollout_says_how_to_find_ids(episode_store: tuple[str, dict], tmp_path: Path) -> None:
    loc, _ = episode_store
    result = CliRunner().invoke(main, ["replay", "--store", loc, "rollout-weather-9"])
    assert result.exit_code == 1
    assert "no rollout 'rollout-weather-9'" in result.output and "SELECT rollout_id" in result.output
    assert ROLLOUT in result.output  # a similar id is suggested
    missing = CliRunner().invoke(main, ["replay", "--store", str(tmp_path / "nowhere"), ROLLOUT])
    assert missing.exit_code == 1 and "no trajstore store" in missing.output


def test_replay_runs_as_a_program(episode_store: tuple[str, dict]) -> None:
    loc, ids = episode_store
    proc = subprocess.run([sys.executable, "-m", "cli.replay_cmd", "--store", loc, ROLLOUT, "--json"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    episode = json.loads(proc.stdout)
    assert [t["output_ids"] for s in episode["segments"] for t in s["turns"]] == [
        ids["o0"], ids["pre"] + ids["ans"], ids["o2"]]
    assert all(s["text"] is None for s in episode["segments"][0]["turns"][0]["spans"])


def test_tool_traffic_is_read_from_openai_anthropic_and_sampled_text() -> None:
    anthropic_response = {"role": "assistant", "content": [
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "tu_1", "name": "search", "input": {"q": "x"}}]}
    assert response_calls(anthropic_response) == [ToolCall("search", '{"q": "x"}', {"q": "x"}, "tu_1")]
    anthropic_request = {"messages": [
        {"role": "user", "content": "hi"}, anthropic_response,
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu_1",
                                      "content": [{"type": "text", "text": "found"}]}]}]}
    assert tool_results(anthropic_request) == [ToolResult("found", None, "tu_1")]
    assert tool_results({"messages": [{"role": "user", "content": "hi"}]}) == []
    assert response_calls({"choices": [{"message": {"content": "no tools"}}]}) == []
    assert parse_output(CALL).tool_calls == (ToolCall("get_weather", '{"city": "Paris"}', {"city": "Paris"}),)


def test_spans_split_the_output_where_the_mask_flips() -> None:
    got = spans([1, 2], [3, 4, 5, 6], [-1.0, -2.0, -3.0, -4.0], [True, False, False, True], None)
    assert [(s.kind, s.ids, s.logprobs) for s in got] == [
        ("prompt", [1, 2], None), ("sampled", [3], [-1.0]), ("sampled_masked", [4, 5], [-2.0, -3.0]),
        ("sampled", [6], [-4.0])]
