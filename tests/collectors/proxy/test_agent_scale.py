"""Agent-scale capture (issue 22): fixed costs per call paid once, nothing of one call's size on the event loop.

- A tool list is sent again on every call of an agent; each distinct JSON Schema is checked
  against its metaschema once (`collectors.proxy.chat.schema_problem`), and a bad one is still
  refused on every call with the same message.
- The embedded server leaves the prompt's ids out of its answer when asked
  (`return_prompt_token_ids: false`, which the proxy's client sends): an 80k-token prompt is
  not sent back on every call; the client checks the server's count of it instead.
- The renderer tokenizes with the offset-free batch call (the same ids, the GIL released, ~30% less
  time).
- The hop to the policy server writes a prompt of hundreds of thousands of token ids on a
  thread: held there, /health and another rollout's call are answered meanwhile.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import collectors.policy.http as policy_http
from collectors.embedded.app import RunningServer
from collectors.embedded.engine import Completion
from collectors.embedded.protocol import completion_response, parse_completion_request, stream_event
from collectors.policy import EmbeddedClient, PolicyServerBadResponse, parse_completion
from collectors.proxy import chat
from collectors.proxy.chat import ChatError
from collectors.proxy.wire import OpenAIChat
from tests.collectors import http
from tests.collectors.proxy_harness import MODEL, Harness, Recording, call, running_proxy


def _tool(name: str, props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": props}}}


def test_each_distinct_tool_schema_is_checked_once(monkeypatch: pytest.MonkeyPatch) -> None:
    checked: list[Any] = []
    check = chat._check_schema

    def counted(schema: dict[str, Any]) -> str | None:
        checked.append(schema)
        return check(schema)

    monkeypatch.setattr(chat, "_check_schema", counted)
    monkeypatch.setattr(chat, "_SCHEMA_CHECKS", type(chat._SCHEMA_CHECKS)())
    tools = [_tool("read", {"path": {"type": "string"}}), _tool("grep", {"pattern": {"type": "string"}})]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools}
    first = OpenAIChat().parse_request(body)
    assert len(checked) == 2
    # the same schemas again, keys in another order (an SDK's serialization): nothing checked again
    again = [_tool("grep", {"pattern": {"type": "string"}}),
             {"function": {"parameters": {"properties": {"path": {"type": "string"}}, "type": "object"},
                           "name": "read"}, "type": "function"}]
    assert OpenAIChat().parse_request({**body, "tools": again}).tools is not None
    assert OpenAIChat().parse_request(body).tools == first.tools
    assert len(checked) == 2
    bad = [_tool("read", {"path": {"type": "strin"}})]
    for _ in range(2):  # refused on every call, with the same message, though checked once
        with pytest.raises(ChatError, match="is not a valid JSON Schema") as refused:
            OpenAIChat().parse_request({**body, "tools": bad})
        assert "tools[0]" in refused.value.message
    assert len(checked) == 3


def test_the_embedded_server_leaves_the_prompt_out_when_asked() -> None:
    job = parse_completion_request({"prompt": [5, 6, 7], "return_token_ids": True, "return_prompt_token_ids": False,
                                    "logprobs": 0})
    result = Completion(prompt_ids=[5, 6, 7], output_ids=[8], logprobs=[-0.5], top_logprobs=None, text="x",
                        finish_reason="stop", stop_reason=None, policy_version=0)
    body = completion_response(job, result, model_name="m", decode_one=str)
    assert body["choices"][0]["prompt_token_ids"] is None and body["choices"][0]["token_ids"] == [8]
    assert body["usage"]["prompt_tokens"] == 3
    event = stream_event(job, "r", 0, "m", 0, "x", [8], None, prompt_ids=[5, 6, 7])
    assert "prompt_token_ids" not in event["choices"][0] and event["choices"][0]["token_ids"] == [8]
    echoed = parse_completion_request({"prompt": [5, 6, 7], "return_token_ids": True, "logprobs": 0})  # vLLM's default: echoed
    assert completion_response(echoed, result, model_name="m", decode_one=str)["choices"][0]["prompt_token_ids"] \
        == [5, 6, 7]
    sample = parse_completion(body, [5, 6, 7], policy_version=0, url="u")
    assert sample.prompt_ids == [5, 6, 7] and sample.output_ids == [8]
    with pytest.raises(PolicyServerBadResponse, match="a prompt of 3 tokens but was sent 2"):
        parse_completion(body, [5, 6], policy_version=0, url="u")


def test_the_client_asks_the_embedded_server_for_no_echo(proxy: Harness) -> None:
    rollout = proxy.open()
    reply = call(proxy.url + "/v1/chat/completions",
                 {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]},
                 key=rollout["api_key"])
    assert reply.status == 200, reply.body
    body = policy_http.completion_body([1, 2], policy_http.SamplingParams(), None, echo_prompt=False)
    assert body["return_prompt_token_ids"] is False
    assert "return_prompt_token_ids" not in policy_http.completion_body([1, 2], policy_http.SamplingParams(), None)


def test_json_the_fast_parser_refuses_still_reads_and_writes() -> None:
    assert policy_http.loads(b'{"a": NaN}')["a"] != policy_http.loads(b'{"a": NaN}')["a"]  # NaN, as json reads it
    assert policy_http.loads('{"a": [1, 2]}') == {"a": [1, 2]}
    assert policy_http.dumps({"seed": 2**70}) == b'{"seed": 1180591620717411303424}'
    with pytest.raises(ValueError):
        policy_http.loads(b"<html>")


@pytest.fixture(scope="module")
def roomy(server: RunningServer, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A proxy whose context admits a prompt of hundreds of thousands of tokens."""
    with running_proxy(Recording(EmbeddedClient(server.url)), tmp_path_factory.mktemp("store"), tiny_model,
                       max_model_len=1 << 40) as proxy:
        yield proxy


def test_a_huge_prompt_is_written_to_the_policy_server_off_the_event_loop(roomy: Harness,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    writing, answered, held_out = threading.Event(), threading.Event(), threading.Event()
    dumps = policy_http.dumps

    def held(body: Any) -> bytes:
        prompt = body.get("prompt", body.get("prompt_token_ids_b64")) if isinstance(body, dict) else None
        if len(prompt or ()) > policy_http.OFF_LOOP_TOKENS:  # a list or `TokenIds`, or `PackedIds`
            writing.set()
            if not answered.wait(20):  # on the event loop nothing else can be answered: give up, say so
                held_out.set()
        return dumps(body)

    monkeypatch.setattr(policy_http, "dumps", held)
    big, small = roomy.open(), roomy.open()
    words = policy_http.OFF_LOOP_TOKENS + 1000  # "w" and " w" are one token each in the tiny model's vocabulary
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "w" + " w" * words}]}
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(call, roomy.url + "/v1/chat/completions", body, key=big["api_key"])
        assert writing.wait(180), "the big call's prompt never reached the hop to the policy server"
        health = http.get(roomy.url + "/health", timeout=60)
        other = call(roomy.url + "/v1/chat/completions", {"model": MODEL, "max_tokens": 2,
                                                          "messages": [{"role": "user", "content": "hi"}]},
                     key=small["api_key"])
        big_done_first = pending.done()
        answered.set()
        reply = pending.result()
    assert not held_out.is_set(), "/health and the other rollout waited for the big call's hop"
    assert not big_done_first
    assert health.status == 200 and other.status == 200, other.body
    assert reply.status in (200, 400, 502), reply.body  # the upstream's context is smaller than the proxy's


def test_a_long_text_is_tokenized_while_other_threads_run(tiny_model: Path) -> None:
    """The tokenizer's `encode` holds the GIL for its whole run (seconds for a multi-MB prompt): a render thread
    would then hold the event loop all the same. Long texts go through the call that lets other threads run."""
    from transformers import AutoTokenizer

    from collectors.proxy.render import ChatRenderer

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(tiny_model))
    text = "word and more words, def f(x): return x\n" * 50_000  # 2 MB
    started, ids = threading.Event(), []

    def tokenize() -> None:
        started.set()
        ids.append(renderer.encode(text))

    worker = threading.Thread(target=tokenize)
    worker.start()
    started.wait()
    turns = 0  # times this thread ran while the other tokenized
    while worker.is_alive():
        turns += 1
        threading.Event().wait(0.001)
    assert turns > 20, f"this thread ran {turns} time(s) while the text was tokenized: the GIL was held"
    assert ids == [renderer.tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids]


def test_the_renderer_tokenizes_every_kind_of_text_as_the_tokenizer_does(tiny_model: Path) -> None:
    """`ChatRenderer.encode` takes the tokenizer's offset-free batch call at every length; its ids must be those of
    the plain `encode` (and of transformers' own) for control tokens written in the text, non-ASCII, whitespace runs
    and empty text alike."""
    from transformers import AutoTokenizer

    from collectors.proxy.render import ChatRenderer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    renderer = ChatRenderer(tok)
    texts = ["", " ", "\n\n\n", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "naïve café — 東京 🚀",
             "def f(x):\n\treturn x  # trailing   \n", "<|im_end|><|im_end|>text<think>\nhm\n</think>", "x" * 70_000]
    for text in texts:
        expected = tok.backend_tokenizer.encode(text, add_special_tokens=False).ids
        assert renderer.encode(text) == expected == tok.encode(text, add_special_tokens=False), text[:40]


def test_a_turn_stores_the_request_body_as_the_agent_sent_it(proxy: Harness) -> None:
    """Strict JSON is stored as its own text (never written again from its value: an 80k-token history costs
    nothing more to store); a body only Python's json reads (NaN) is stored as its value, written as JSON."""
    rollout = proxy.open()
    sent = ('{ "model" : "%s",\n  "max_tokens": 3, "temperature": 1.0,\n'
            '  "messages": [ {"role": "user", "content": "caf\\u00e9 \u00e9t\u00e9"} ] }' % MODEL).encode()
    assert call(proxy.url + "/v1/chat/completions", data=sent, key=rollout["api_key"]).status == 200
    loose = json.dumps({"model": MODEL, "max_tokens": 3, "metadata": {"x": float("nan")},
                        "messages": [{"role": "user", "content": "hi"}]}).encode()
    assert b"NaN" in loose
    reply = call(proxy.url + "/v1/chat/completions", data=loose, key=rollout["api_key"],
                 headers={"X-Trajstore-Session": "other"})
    assert reply.status == 200, reply.body
    stored = {t["session_id"]: t["request"] for t in proxy.turns(rollout["rollout_id"])}
    assert stored["main"] == sent.decode()
    assert json.loads(stored["other"])["messages"] == [{"role": "user", "content": "hi"}]
