"""Bad input and upstream failures: each protocol's own error shape, a message naming the problem, nothing written."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from collectors.policy import EmbeddedClient
from tests.collectors.proxy_harness import MODEL, Harness, anthropic_client, call, openai_client, running_proxy

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def rollout(proxy: Harness) -> dict[str, Any]:
    return proxy.open()


def openai_error(proxy: Harness, rollout: dict[str, Any], body: Any, data: bytes | None) -> tuple[int, dict]:
    r = call(proxy.url + "/v1/chat/completions", body, data=data, key=rollout["api_key"])
    assert set(r.body) == {"error"} and set(r.body["error"]) == {"message", "type", "param", "code"}, r.body
    return r.status, r.body["error"]


def anthropic_error(proxy: Harness, rollout: dict[str, Any], body: Any, data: bytes | None) -> tuple[int, dict]:
    r = call(proxy.url + "/v1/messages", body, data=data, headers={"x-api-key": rollout["api_key"]})
    assert r.body["type"] == "error" and set(r.body["error"]) == {"type", "message"}, r.body
    return r.status, r.body["error"]


LONG = "lorem ipsum dolor sit amet " * 700  # well over the tiny model's 2048-token context

OPENAI_CASES = [
    ("malformed JSON", None, b'{"model": "tiny", "messages": [', 400, "not valid JSON"),
    ("not an object", [1, 2], None, 400, "JSON object"),
    ("unknown model", {"model": "gpt-9", "messages": USER}, None, 404, "gpt-9"),
    ("no messages", {"model": MODEL, "messages": []}, None, 400, "messages"),
    ("bad role", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, None, 400, "robot"),
    ("image part", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, None, 400, "image_url"),
    ("oversized prompt", {"model": MODEL, "messages": [{"role": "user", "content": LONG}]}, None, 400, "context"),
    ("invalid tool schema", {"model": MODEL, "messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "strin"}}}}}]}, None, 400,
     "tools[0].function.parameters is not a valid JSON Schema"),
    ("bad tool name", {"model": MODEL, "messages": USER, "tools": [{"type": "function", "function": {
        "name": "no spaces allowed"}}]}, None, 400, "tools[0].function.name"),
    ("unknown tool_choice", {"model": MODEL, "messages": USER, "tool_choice": {
        "type": "function", "function": {"name": "ghost"}}}, None, 400, "ghost"),
    ("n > 1", {"model": MODEL, "messages": USER, "n": 3}, None, 400, "n=3"),
    ("several problems", {"model": MODEL, "messages": USER, "temperature": 9, "max_tokens": 0}, None, 400,
     "temperature"),
]


@pytest.mark.parametrize(("name", "body", "data", "status", "text"), OPENAI_CASES, ids=[c[0] for c in OPENAI_CASES])
def test_openai_bad_requests(proxy: Harness, rollout: dict[str, Any], name: str, body: Any, data: bytes | None,
                             status: int, text: str) -> None:
    before = proxy.count()
    got, error = openai_error(proxy, rollout, body, data)
    assert got == status and text in error["message"], error
    assert proxy.count() == before


ANTHROPIC_CASES = [
    ("malformed JSON", None, b"{nope", 400, "not valid JSON"),
    ("missing max_tokens", {"model": MODEL, "messages": USER}, None, 400, "max_tokens` is required"),
    ("unknown model", {"model": "claude-x", "max_tokens": 5, "messages": USER}, None, 404, "claude-x"),
    ("missing input_schema", {"model": MODEL, "max_tokens": 5, "messages": USER, "tools": [{"name": "f"}]}, None, 400,
     "tools[0].input_schema is required"),
    ("invalid input_schema", {"model": MODEL, "max_tokens": 5, "messages": USER, "tools": [
        {"name": "f", "input_schema": {"type": "array"}}]}, None, 400, "must describe an object"),
    ("server tool", {"model": MODEL, "max_tokens": 5, "messages": USER, "tools": [
        {"type": "web_search_20250305", "name": "web_search"}]}, None, 400, "web_search_20250305"),
    ("image block", {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}, None, 400,
     "'image'"),
    ("oversized prompt", {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": LONG}]}, None,
     400, "context"),
    ("unknown role in messages", {"model": MODEL, "max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]},
     None, 400, "user, assistant or system"),
]


@pytest.mark.parametrize(("name", "body", "data", "status", "text"), ANTHROPIC_CASES,
                         ids=[c[0] for c in ANTHROPIC_CASES])
def test_anthropic_bad_requests(proxy: Harness, rollout: dict[str, Any], name: str, body: Any, data: bytes | None,
                                status: int, text: str) -> None:
    before = proxy.count()
    got, error = anthropic_error(proxy, rollout, body, data)
    assert got == status and text in error["message"], error
    assert error["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]
    assert proxy.count() == before


def test_sdks_raise_their_own_errors_and_the_proxy_keeps_serving(proxy: Harness, rollout: dict[str, Any]) -> None:
    o = openai_client(rollout)
    with pytest.raises(openai.NotFoundError, match="does not exist") as err:
        o.chat.completions.create(model="gpt-9", messages=USER)
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    a = anthropic_client(rollout)
    with pytest.raises(anthropic.BadRequestError, match="input_schema"):
        a.messages.create(model=MODEL, max_tokens=4, messages=USER, tools=[{"name": "f", "input_schema": {
            "type": "object", "properties": {"a": {"type": 5}}}}])
    assert o.chat.completions.create(model=MODEL, messages=USER, max_tokens=3).usage.completion_tokens >= 1
    assert call(proxy.url + "/nowhere").status == 404


def test_unknown_routes_and_session_names(proxy: Harness, rollout: dict[str, Any]) -> None:
    r = call(proxy.url + "/v1/chat/completions", {"model": MODEL, "messages": USER}, key=rollout["api_key"],
             headers={"X-Trajstore-Session": "no spaces"})
    assert r.status == 400 and "session name" in r.body["error"]["message"]


def test_anthropic_cache_warmup_samples_and_stores_nothing(proxy: Harness, rollout: dict[str, Any]) -> None:
    before = proxy.count()
    a = anthropic_client(rollout)
    m = a.messages.create(model=MODEL, max_tokens=0, messages=USER)
    assert m.usage.output_tokens == 0 and m.usage.input_tokens > 0 and proxy.count() == before


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_upstream_is_a_502_with_the_reason(tiny_model: Path, tmp_path: Path) -> None:
    """After waiting `upstream_wait_s` for it to come back (an outage is waited out, not failed at once)."""
    dead = f"http://127.0.0.1:{free_port()}"
    with running_proxy(EmbeddedClient(dead, connect_retries=0), tmp_path / "store", tiny_model,
                       upstream_wait_s=0.5) as h:
        rollout = h.open()
        o = openai_client(rollout)
        with pytest.raises(openai.APIStatusError) as err:
            o.chat.completions.create(model=MODEL, messages=USER, max_tokens=3)
        assert err.value.status_code == 502 and dead in err.value.body["message"]
        assert "waited 0.5 s for it to come back" in err.value.body["message"]
        assert err.value.body["type"] == "server_error"
        a = anthropic_client(rollout)
        with pytest.raises(anthropic.APIStatusError) as aerr:
            with a.messages.stream(model=MODEL, max_tokens=3, messages=USER) as stream:
                stream.get_final_message()
        assert aerr.value.status_code == 502 and aerr.value.body["error"]["type"] == "api_error"
        stats = call(h.url + "/stats").body
        assert h.count() == 0 and stats["upstream_failures"] == 2
        assert stats["upstream"] == {"waiting": 0, "waited": 2, "gave_up": 2, "cancelled": 0}
        assert h.proxy.capture.registry.by_id[rollout["rollout_id"]].sessions["main"].state.turns == 0


@pytest.mark.parametrize(("headers", "shape"), [({}, "openai"), ({"anthropic-version": "2023-06-01"}, "anthropic")])
def test_unknown_routes_under_a_base_url_answer_in_the_clients_shape_without_the_key(
        proxy: Harness, rollout: dict[str, Any], headers: dict[str, str], shape: str) -> None:
    key = rollout["api_key"]
    for path in (f"/r/{key}/v1/nowhere", f"/r/{key}/v1/completions", f"/r/{key}.sub/v1/embeddings"):
        r = call(proxy.url + path, {"model": MODEL}, headers={"x-api-key": key, **headers})
        assert r.status == 404 and key[3:] not in json.dumps(r.body), r.body
        message = r.body["error"]["message"]
        assert "/r/{key}/v1/" in message and "POST /v1/responses" in message
        if shape == "anthropic":
            assert r.body["type"] == "error" and r.body["error"]["type"] == "not_found_error"
        else:
            assert r.body["error"]["type"] == "invalid_request_error" and r.body["error"]["code"] == "model_not_found"
    r = call(proxy.url + f"/r/{key}/v1/messages/batches", {"model": MODEL}, headers={"x-api-key": key})
    assert r.status == 404 and r.body["type"] == "error" and key[3:] not in json.dumps(r.body)  # an Anthropic path
    wrong = call(proxy.url + f"/r/{key}/v1/messages", method="GET")
    assert wrong.status == 405 and wrong.body["type"] == "error" and key[3:] not in json.dumps(wrong.body)


def test_base_urls_answer_the_probes_agents_send(proxy: Harness, rollout: dict[str, Any]) -> None:
    for url in (proxy.url + "/", rollout["base_urls"]["anthropic"]):
        assert call(url).status == 200
        assert call(url, method="HEAD").status == 200


def test_count_tokens_is_the_prompt_the_next_call_is_sent(proxy: Harness) -> None:
    rollout = proxy.open()
    a = anthropic_client(rollout)
    messages = [{"role": "user", "content": "Count me."}]
    counted = a.messages.count_tokens(model=MODEL, system="Be brief.", messages=messages)
    before = proxy.count()
    sent = a.messages.create(model=MODEL, system="Be brief.", max_tokens=4, messages=messages)
    assert counted.input_tokens == sent.usage.input_tokens == len(proxy.upstream.calls[-1][0])
    assert proxy.count() == before + 1  # counting stored nothing
    messages += [{"role": "assistant", "content": [b.model_dump() for b in sent.content]},
                 {"role": "user", "content": "Again."}]
    again = a.messages.count_tokens(model=MODEL, system="Be brief.", messages=messages)
    assert again.input_tokens == a.messages.create(model=MODEL, system="Be brief.", max_tokens=4,
                                                   messages=messages).usage.input_tokens
    with pytest.raises(anthropic.NotFoundError):
        a.messages.count_tokens(model="claude-x", messages=messages)


def test_top_logprobs_are_the_policy_servers_alternatives(proxy: Harness, rollout: dict[str, Any]) -> None:
    o = openai_client(rollout)
    r = o.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, seed=4, logprobs=True, top_logprobs=3)
    sample = proxy.upstream.calls[-1][1]
    entries = r.choices[0].logprobs.content
    assert [e.logprob for e in entries] == pytest.approx(sample.output_logprobs, abs=1e-6)
    for entry, top in zip(entries, sample.top_logprobs, strict=True):
        assert len(entry.top_logprobs) == min(3, len(top))
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert {t.token for t in entry.top_logprobs} <= set(top)
    with pytest.raises(openai.BadRequestError, match="needs logprobs"):
        o.chat.completions.create(model=MODEL, messages=USER, top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="at most 20"):
        o.chat.completions.create(model=MODEL, messages=USER, logprobs=True, top_logprobs=21)


@pytest.mark.parametrize("header", ["Bearer \xff\xfe", "\xff", "Bearer ts-\xe9\xff"])
def test_a_non_utf8_authorization_header_is_a_401_and_the_scheme_any_case(proxy: Harness, header: str) -> None:
    """urllib sends header text as Latin-1, so these arrive as bytes that are not UTF-8."""
    opened = proxy.open()
    close_url = f"{proxy.url}/rollouts/{opened['rollout_id']}/close"
    r = call(close_url, {"status": "completed"}, headers={"Authorization": header})
    assert r.status == 401 and "api_key" in r.body["error"]["message"], r.body
    r = call(proxy.url + "/v1/chat/completions", {"model": MODEL, "messages": USER}, headers={"Authorization": header})
    assert r.status == 401, r.body
    r = call(proxy.url + "/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": USER},
             headers={"x-api-key": header})
    assert r.status == 401 and r.body["type"] == "error", r.body
    r = call(close_url, {"status": "completed"}, headers={"Authorization": f"BEARER {opened['api_key']}"})
    assert r.status == 200, r.body
