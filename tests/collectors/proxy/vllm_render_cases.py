"""Shared parts of the `--render vllm` tests: a vLLM per family, a proxy in front of it, SDK tool loops.

A random tiny model writes no tool call by itself, so the agents ask vLLM for one the way any
vLLM client can: `structured_outputs` (vLLM's own request field, passed through by the proxy)
with a regular expression of the family's call format. vLLM then samples the call's tokens
under that constraint (the stored logprobs are those of the constrained distribution, as
vLLM reports them), and its family parser (`hermes`, `llama3_json`) turns them into tool
calls. Everything else is real: vLLM's CPU build renders, samples and parses, the SDKs speak
their own protocols, and the stored ids and logprobs are checked against vLLM's answers.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.collectors.conftest import vllm_or_skip

from collectors.model.build import ModelSize, init_model
from collectors.policy import Chunk, Sample, SamplingParams, StreamedSample, VLLMClient
from collectors.policy.vllm_server import (
    VLLMServer,
    start_vllm,
)
from tests.collectors.proxy_harness import (
    MODEL,
    Harness,
    anthropic_client,
    assert_exact,
    openai_client,
    running_proxy,
)

SIZE = ModelSize(vocab_size=2048, hidden_size=64, layers=2, heads=2, kv_heads=1, intermediate_size=128,
                 max_positions=2048)
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add one to a number",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "enum": [1, 2]}}, "required": ["a"],
                   "additionalProperties": False}}}]
A_TOOLS = [{"name": "add", "description": "Add one to a number", "input_schema": TOOLS[0]["function"]["parameters"]}]
ANSWER = r"The answer is (2|3)\."


@dataclass(frozen=True)
class Family:
    """A model family as vLLM serves it: init-model's family, vLLM's parser name, the call format's regex."""

    name: str
    parser: str
    call: str  # a regular expression of one call to `add` in the family's format
    end: str  # the token the family's template writes after a reply

    def structured(self, pattern: str) -> dict[str, Any]:
        return {"structured_outputs": {"regex": pattern}}


HERMES = Family("hermes", "hermes", '<tool_call>\n\\{"name": "add", "arguments": \\{"a": (1|2)\\}\\}\n</tool_call>',
                "<|im_end|>")
LLAMA3 = Family("llama3", "llama3_json", '\\{"name": "add", "parameters": \\{"a": (1|2)\\}\\}', "<|eot_id|>")


class RecordingVLLM(VLLMClient):
    """`VLLMClient` that keeps every (ids sent, Sample) it returned, as `Recording` does."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.calls: list[tuple[list[int], Sample]] = []

    async def complete(self, prompt_ids: Sequence[int], sampling: SamplingParams, *, session_id: str | None = None,
                       sampling_extra: Any = None) -> Sample:
        sample = await super().complete(prompt_ids, sampling, session_id=session_id, sampling_extra=sampling_extra)
        self.calls.append((list(prompt_ids), sample))
        return sample

    async def stream(self, prompt_ids: Sequence[int], sampling: SamplingParams, *, session_id: str | None = None,
                     sampling_extra: Any = None) -> AsyncIterator[Chunk]:
        joined = StreamedSample(list(prompt_ids))
        async for chunk in super().stream(prompt_ids, sampling, session_id=session_id, sampling_extra=sampling_extra):
            joined.add(chunk)
            yield chunk
        self.calls.append((list(prompt_ids), joined.sample()))


def one_stop(model: Path, end: str) -> None:
    """Make `end` the model's only stop token. A family's models may end a reply with other stop tokens than the
    one its template writes after it (Hermes: `<|endoftext|>` for `<|im_end|>`); such a reply forks with reason
    template_drift on either render path (measured in benchmarks/vllm_drift.py), which these tests keep out."""
    ids = {t["content"]: t["id"] for t in json.loads((model / "tokenizer.json").read_text())["added_tokens"]}
    config = json.loads((model / "generation_config.json").read_text())
    config["eos_token_id"] = [ids[end]]
    (model / "generation_config.json").write_text(json.dumps(config))


def family_proxy(family: Family, tmp: pytest.TempPathFactory) -> Iterator[Harness]:
    """A tiny model of `family`, a vLLM serving it with the family's parser, a `--render vllm` proxy in front
    (a module fixture's body: one vLLM per module)."""
    vllm_or_skip()
    model = tmp.mktemp("models") / family.name
    init_model(model, SIZE, seed=0, family=family.name)
    one_stop(model, family.end)
    server: VLLMServer = start_vllm(model, served_name=MODEL, render=True, tool_call_parser=family.parser,
                                    log_path=tmp.mktemp("vllm") / "vllm.log")
    try:
        with running_proxy(RecordingVLLM(server.url), tmp.mktemp("store"), model, render="vllm") as h:
            yield h
    finally:
        server.stop()


def metas(h: Harness, rollout: dict[str, Any]) -> list[dict[str, Any]]:
    return [{**json.loads(t["meta"]), "segment_id": t["segment_id"], "turn_index": t["turn_index"]}
            for t in h.turns(rollout["rollout_id"])]


def one_segment(h: Harness, rollout: dict[str, Any], turns: int) -> list[dict[str, Any]]:
    """The rollout's turns: `turns` of them, all in one segment, stored exactly as vLLM sampled them."""
    stored = assert_exact(h, rollout["rollout_id"])
    m = metas(h, rollout)
    assert len(stored) == turns
    assert [x["turn_index"] for x in m] == list(range(turns)), m
    assert len({x["segment_id"] for x in m}) == 1 and all(x["fork"] is None for x in m), m
    return m


def openai_tool_loop(h: Harness, family: Family, *, stream: bool = False) -> dict[str, Any]:
    """Two calls of `add` and an answer through the openai SDK (the last call streamed when `stream`)."""
    rollout = h.open()
    c = openai_client(rollout)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Add one to one, twice."}]
    for _ in range(2):
        r = c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=48, logprobs=True,
                                      extra_body=family.structured(family.call))
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        assert call.function.name == "add" and json.loads(call.function.arguments)["a"] in (1, 2)
        assert [t.logprob for t in choice.logprobs.content] == h.upstream.calls[-1][1].output_logprobs
        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "2"}]
    request = {"model": MODEL, "messages": messages, "tools": TOOLS, "max_tokens": 24, "extra_body": family.structured(ANSWER)}
    if stream:
        with c.chat.completions.stream(**request) as events:
            pieces = [e.delta for e in events if e.type == "content.delta"]
            answer = events.get_final_completion().choices[0].message.content
        assert "".join(pieces) == answer
    else:
        answer = c.chat.completions.create(**request).choices[0].message.content
    assert answer.startswith("The answer is ")
    one_segment(h, rollout, 3)
    return rollout


def anthropic_tool_loop(h: Harness, family: Family) -> dict[str, Any]:
    """A call of `add` and an answer through the anthropic SDK, the call streamed."""
    rollout = h.open()
    c = anthropic_client(rollout)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Add one to one."}]
    with c.messages.stream(model=MODEL, max_tokens=48, tools=A_TOOLS, messages=messages,
                           extra_body=family.structured(family.call)) as events:
        first = events.get_final_message()
    assert first.stop_reason == "tool_use", first
    use = next(b for b in first.content if b.type == "tool_use")
    assert use.name == "add" and use.input["a"] in (1, 2)
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "2"}]}]
    second = c.messages.create(model=MODEL, max_tokens=24, tools=A_TOOLS, messages=messages,
                               extra_body=family.structured(ANSWER))
    assert second.stop_reason == "end_turn" and second.content[0].text.startswith("The answer is ")
    one_segment(h, rollout, 2)
    return rollout


def rewritten_history_forks(h: Harness, family: Family) -> None:
    """An agent that edits the model's call rewrote history: nothing is reconciled and a new segment starts (the
    fan-out) with the whole prompt; its reason is template_drift, as the proxy's own path names a prompt that
    extends the last prompt but not the reply sampled after it."""
    rollout = h.open()
    c = openai_client(rollout)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Add one."}]
    r = c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=48,
                                  extra_body=family.structured(family.call))
    call = r.choices[0].message.tool_calls[0]
    edited = r.choices[0].message.model_dump(exclude_none=True)
    edited["tool_calls"][0]["function"]["arguments"] = json.dumps({"a": 7})
    messages += [edited, {"role": "tool", "tool_call_id": call.id, "content": "8"}]
    c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=8)
    m = metas(h, rollout)
    assert (m[1]["history"], m[1]["fork"], m[1]["turn_index"]) == ("rewritten", "template_drift", 0), m
    assert m[1]["segment_id"] != m[0]["segment_id"] and m[1]["previous_segment"] == m[0]["segment_id"]
    assert_exact(h, rollout["rollout_id"])




def responses_tool_loop(h: Harness, family: Family) -> dict[str, Any]:
    """A call of `add` and a streamed answer through the openai SDK's Responses API."""
    rollout = h.open()
    c = openai_client(rollout)
    tools = [{"type": "function", **TOOLS[0]["function"]}]
    first = c.responses.create(model=MODEL, input="Add one to one.", tools=tools, max_output_tokens=48,
                               extra_body=family.structured(family.call))
    (fc,) = [o for o in first.output if o.type == "function_call"]
    assert fc.name == "add" and json.loads(fc.arguments)["a"] in (1, 2)
    history = [{"role": "user", "content": "Add one to one."}, *[o.model_dump(exclude_none=True) for o in first.output],
               {"type": "function_call_output", "call_id": fc.call_id, "output": "2"}]
    with c.responses.stream(model=MODEL, input=history, tools=tools, max_output_tokens=24,
                            extra_body=family.structured(ANSWER)) as events:
        final = events.get_final_response()
    assert final.output_text.startswith("The answer is ")
    one_segment(h, rollout, 2)
    return rollout
