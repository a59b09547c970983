"""The `--render vllm` path's own parts, without vLLM: segment plans on rendered ids, the requests it sends
vLLM, the answers it reads, and the clear errors for a policy server that cannot serve the path.

What needs real vLLM is in test_vllm_render_hermes.py, test_vllm_render_llama3.py and
test_vllm_render_errors.py (marked `vllm`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest

from collectors.embedded.app import RunningServer
from collectors.policy import (
    EmbeddedClient,
    PolicyServerBadResponse,
    SamplingParams,
    VLLMClient,
)
from collectors.policy.http import parse_chunk, parse_completion
from collectors.policy.token_ids import TokenLog
from collectors.policy.vllm_generate import as_completion, generate_body
from collectors.policy.vllm_server import _parser_problem, render_args
from collectors.proxy.chat import ChatRequest
from collectors.proxy.segmenter import Held, SessionState
from collectors.proxy.vllm_render import (
    RenderUnavailable,
    chat_body,
    plan_rendered,
    routes_problem,
    token_boundary,
    tool_choice,
)
from tests.collectors.proxy_harness import MODEL, openai_client, running_proxy

PIECES = {1: "<s>", 2: "he", 3: "llo", 4: "hello", 5: "</s>", 6: "\n", 7: "user", 8: "hel", 9: "lo"}


def decode(ids: list[int]) -> str:
    return "".join(PIECES[i] for i in ids)


def encode(text: str) -> list[int]:  # greedy longest match: never the sampled spelling "he" + "llo"
    out, rest = [], text
    while rest:
        i = max((i for i, p in PIECES.items() if rest.startswith(p)), key=lambda i: len(PIECES[i]))
        out.append(i)
        rest = rest[len(PIECES[i]):]
    return out


def test_token_boundary_finds_the_end_of_a_text_or_none() -> None:
    assert token_boundary([1, 2, 3, 5, 6], "<s>hello", decode) == 3
    assert token_boundary([1, 2, 3, 5, 6], "<s>hello</s>\n", decode) == 5
    assert token_boundary([1, 8, 9, 5], "<s>hell", decode) is None  # inside a token
    assert token_boundary([1, 2], "", decode) == 0


def test_a_continued_segment_sends_the_sampled_ids_and_vllms_own_ids_after_them() -> None:
    state = SessionState("main", segment_id="s1", next_turn=1,  # sampled "he" + "llo"
                         held=Held(prompt=("<s>",), sampled_text="hello", ids=TokenLog([1, 2, 3])))
    rendered = [1, 4, 5, 6, 7]  # vLLM re-tokenizes the reply as "hello"
    plan = plan_rendered(state, decode(rendered), rendered, decode, encode, lambda: "new")
    assert (plan.segment_id, plan.turn_index, plan.fork) == ("s1", 1, None)
    assert plan.prompt_ids == [5, 6, 7] and plan.full_ids == [1, 2, 3, 5, 6, 7]


def test_no_boundary_after_the_held_text_tokenizes_the_rest_here() -> None:
    state = SessionState("main", segment_id="s1", next_turn=1, held=Held(("<s>",), "hel", TokenLog([1, 8])))
    rendered = [1, 4, 5]  # "hello" straddles the end of the held "hel"
    plan = plan_rendered(state, decode(rendered), rendered, decode, encode, lambda: "new")
    assert plan.fork is None and plan.prompt_ids == encode("lo</s>") and plan.full_ids == [1, 8, *encode("lo</s>")]


def test_a_prompt_that_does_not_extend_the_held_text_forks_with_vllms_ids() -> None:
    state = SessionState("main", segment_id="s1", next_turn=1, held=Held(("<s>",), "hello", TokenLog([1, 2, 3])))
    drift = [1, 2, 6]  # the reply came back other than sampled ("he"), after the same prompt
    plan = plan_rendered(state, decode(drift), drift, decode, encode, lambda: "s2")
    assert (plan.segment_id, plan.turn_index, plan.fork, plan.previous_segment) == ("s2", 0, "template_drift", "s1")
    assert plan.prompt_ids == plan.full_ids == drift
    rewrite = [7, 6]
    assert plan_rendered(state, decode(rewrite), rewrite, decode, encode, lambda: "s3").fork == "history_rewrite"


def test_tool_choice_of_each_protocol_in_chat_terms() -> None:
    named = {"type": "function", "function": {"name": "add"}}
    assert tool_choice("openai", {"tool_choice": "required"}) == "required"
    assert tool_choice("openai", {"tool_choice": named}) == named
    assert tool_choice("openai", {}) is None
    assert tool_choice("anthropic", {"tool_choice": {"type": "any"}}) == "required"
    assert tool_choice("anthropic", {"tool_choice": {"type": "tool", "name": "add"}}) == named
    assert tool_choice("anthropic", {"tool_choice": {"type": "auto"}}) == "auto"
    assert tool_choice("responses", {"tool_choice": {"type": "function", "name": "add"}}) == named


def test_the_render_request_carries_ids_for_tool_calls_and_vllms_structured_outputs() -> None:
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    call = {"type": "function", "function": {"name": "add", "arguments": "{}"}}
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    req = ChatRequest(protocol="openai", model=MODEL, messages=messages, tools=tools, parse_tools=True,
                      max_tokens=None)
    body = chat_body(req, messages, {"tool_choice": "auto", "structured_outputs": {"regex": "a"}}, "served")
    assert body["model"] == "served" and body["tool_choice"] == "auto" and body["structured_outputs"] == {"regex": "a"}
    assert body["messages"][1]["tool_calls"][0]["id"] == "call_0" and body["add_generation_prompt"] is True


def test_generate_body_and_answers() -> None:
    """The render route's extra fields ride in the generate request (SamplingParams winning), and the
    generate answer reads as the completion it stands for."""
    body = generate_body([5, 6], SamplingParams(max_tokens=4, seed=3, logprobs=2), "m", 3, stream=True,
                         extra={"sampling_params": {"structured_outputs": {"regex": "x"}, "max_tokens": 99},
                                "reasoning_ended": True})
    assert body["token_ids"] == [5, 6] and body["model"] == "m" and body["stream"] is True
    assert body["reasoning_ended"] is True and body["output_mode"] == "text"
    assert body["sampling_params"]["max_tokens"] == 4 and body["sampling_params"]["structured_outputs"] == {"regex": "x"}
    entry = {"token": "a", "logprob": -0.5, "top_logprobs": [{"token": "a", "logprob": -0.5},
                                                             {"token": "b", "logprob": -1.0}]}
    answer = {"choices": [{"index": 0, "token_ids": [7], "text": "a", "finish_reason": "length", "stop_reason": None,
                           "logprobs": {"content": [entry]}}]}
    sample = parse_completion(as_completion(answer), [5, 6], policy_version=3, url="u", top_logprobs=True)
    assert (sample.output_ids, sample.output_logprobs, sample.policy_version) == ([7], [-0.5], 3)
    assert sample.top_logprobs == [{"a": -0.5, "b": -1.0}] and sample.finish_reason == "length"
    chunk = parse_chunk(as_completion(answer), [5, 6], policy_version=3, url="u")
    assert chunk is not None and chunk.output_ids == [7] and chunk.finish_reason == "length"
    assert parse_chunk(as_completion({"choices": []}), [5], policy_version=0, url="u") is None
    answer["choices"][0]["token_ids"] = [7, 8]
    with pytest.raises(PolicyServerBadResponse, match="logprob"):
        parse_completion(as_completion(answer), [5, 6], policy_version=3, url="u")


def test_vllm_options_and_their_errors() -> None:
    assert render_args("hermes", None) == ["--enable-scale-out", "--enable-auto-tool-choice", "--tool-call-parser",
                                           "hermes"]
    assert render_args(None, "qwen3") == ["--enable-scale-out", "--reasoning-parser", "qwen3"]
    log = "KeyError: 'invalid tool call parser: nope (chose from { llama3_json,hermes })'"
    assert _parser_problem(log) == ("vLLM 0.32.0 has no tool call parser 'nope' (--tool-call-parser); its names are: "
                                    "hermes, llama3_json")
    log = ("KeyError: \"Reasoning parser 'nope' not found. Available parsers: qwen3, deepseek_r1\"\n")
    assert _parser_problem(log) == ("vLLM 0.32.0 has no reasoning parser 'nope' (--reasoning-parser); its names are: "
                                    "deepseek_r1, qwen3")
    assert _parser_problem("something else") is None
    assert "--enable-scale-out" in (routes_problem("u", 403, "Scale-out endpoints are disabled. Restart") or "")
    assert "vLLM 0.32 or later" in (routes_problem("u", 404, "Not Found") or "")
    assert routes_problem("u", 400, "bad message") is None


def test_render_vllm_needs_a_generate_client(server: RunningServer, tiny_model: Path, tmp_path: Path) -> None:
    with pytest.raises(RenderUnavailable, match="--upstream-kind vllm"):
        with running_proxy(EmbeddedClient(server.url), tmp_path / "store", tiny_model, render="vllm"):
            pass


def test_a_server_without_the_render_routes_is_named_at_start(server: RunningServer, tiny_model: Path,
                                                              tmp_path: Path) -> None:
    """`trajstore serve` (or a vLLM before 0.32) has no render route: the proxy refuses to start, saying so."""
    with pytest.raises(RenderUnavailable, match="has no POST /v1/chat/completions/render"):
        with running_proxy(VLLMClient(server.url), tmp_path / "store", tiny_model, render="vllm"):
            pass


@contextmanager
def fake_vllm_in_thread(**options: Any) -> Iterator[Any]:
    """`tests.collectors.fake_vllm` served from a thread of its own, for the synchronous proxy harness."""
    from tests.collectors.fake_vllm import fake_vllm

    ready, box = threading.Event(), {}

    async def serve() -> None:
        box["stop"] = asyncio.Event()
        async with fake_vllm(**options) as fake:
            box["fake"] = fake
            ready.set()
            await box["stop"].wait()

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(30), "the fake vLLM did not start"
    try:
        yield box["fake"]
    finally:
        loop.call_soon_threadsafe(box["stop"].set)
        thread.join(10)


def test_a_vllm_without_scale_out_is_refused_at_start(tiny_model: Path, tmp_path: Path) -> None:
    """vLLM started without --enable-scale-out answers its render route 403 (its exact error, served by the
    fake): the proxy refuses to start and says which option vLLM needs."""
    with fake_vllm_in_thread(scale_out=False) as fake:
        with pytest.raises(RenderUnavailable, match="only when started with --enable-scale-out"):
            with running_proxy(VLLMClient(fake.url), tmp_path / "store", tiny_model, render="vllm"):
                pass


def test_an_unreachable_vllm_is_a_502_that_says_so(tiny_model: Path, tmp_path: Path) -> None:
    from collectors.policy.vllm_server import free_port

    url = f"http://127.0.0.1:{free_port()}"
    with running_proxy(VLLMClient(url, connect_retries=0), tmp_path / "store", tiny_model,
                       render="vllm", upstream_wait_s=0) as h:
        c = openai_client(h.open())
        with pytest.raises(openai.APIStatusError) as err:
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert err.value.status_code == 502 and "cannot connect" in err.value.message, err.value.message
        assert h.count() == 0


@pytest.mark.parametrize("args, says", [
    (["--upstream", "http://127.0.0.1:9", "--render", "vllm", "--tool-call-parser", "hermes"],
     "pass them with --render vllm and no --upstream"),
    (["--tool-call-parser", "hermes"], "pass them with --render vllm and no --upstream"),
    ([], "--upstream URL is required"),
])
def test_the_command_says_which_settings_go_together(args: list[str], says: str, tiny_model: Path,
                                                     tmp_path: Path) -> None:
    from click.testing import CliRunner

    from cli.main import main

    result = CliRunner().invoke(main, ["proxy", "--model", str(tiny_model), "--store", str(tmp_path / "s"), *args])
    assert result.exit_code == 2 and says in result.output, result.output
