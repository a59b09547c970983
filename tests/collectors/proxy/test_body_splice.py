"""A session's body decoded onto its previous one gives the value a whole decode gives, or falls back to it.

`collectors.proxy.body_splice`: hypothesis bodies in any JSON formatting, the shapes agents send (a history
extended, a last message rewritten to move a cache marker, members changed after the list, a rewritten history),
the edges where a splice must give up (invalid JSON, a member named twice, a marker key, numbers `json` reads
otherwise, nesting `json` refuses), and real SDK sessions through the proxy, whose stored requests resolve to
the bodies sent.
"""

from __future__ import annotations

import json
from typing import Any

import httpx2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collectors.proxy import body_splice
from collectors.proxy.body_splice import HeldBody, anchor, decode_session, decode_whole, splice
from collectors.serving import BadRequest
from tests.collectors.proxy.test_request_delta import Sent, check_deltas, openai_session
from tests.collectors.proxy_harness import MODEL, Harness, anthropic_client, call

PAD = {"role": "system", "content": "You are an agent. " * 1200}  # past MIN_BYTES, as a real history is


def dumps(value: Any, style: int) -> bytes:
    """`value` as one of the formattings clients send (compact, Python's default, indented, ASCII-escaped)."""
    if style == 0:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
    if style == 1:
        return json.dumps(value).encode()
    if style == 2:
        return json.dumps(value, indent=2, ensure_ascii=False).encode()
    return json.dumps(value, separators=(", ", " : ")).encode()


def decoded(raw: bytes, last: body_splice.Last | None) -> tuple[Any, body_splice.Last | None, bool]:
    value, _, last, spliced = decode_session(raw, last, "messages")
    return value, last, spliced


def items_of(last: body_splice.Last) -> list[Any]:
    return last.items if isinstance(last, HeldBody) else last.value["messages"]


def same(value: Any, raw: bytes) -> None:
    """`value` is what `json` reads from `raw`, members in the same order at every level."""
    expected = json.loads(raw)
    assert value == expected
    assert json.dumps(value) == json.dumps(expected)


texts = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40) | st.sampled_from(
    ['"quoted" [brackets] {braces}', "back\\slash \\\" \\u0041", "\n\t\r", "é漢字🙂", "]", "},{", ""])
scalars = st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(-2.0 ** 40, 2.0 ** 40, width=32) | texts
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
                      max_leaves=8)
messages = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool"]), "content": texts | values},
                                 optional={"name": texts, "extra": values})
members = st.dictionaries(st.sampled_from(["model", "tools", "max_tokens", "stream", "temperature", "metadata"]),
                          values, max_size=4)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(before=members, after=members, history=st.lists(messages, min_size=1, max_size=6),
       calls=st.lists(st.tuples(st.lists(messages, max_size=3), st.integers(0, 3)), min_size=1, max_size=4),
       style=st.integers(0, 3), new_after=st.none() | members)
def test_a_session_s_bodies_decode_as_json_reads_them(before: dict[str, Any], after: dict[str, Any],
                                                      history: list[Any], calls: list[Any], style: int,
                                                      new_after: dict[str, Any] | None) -> None:
    after = {k: v for k, v in after.items() if k not in before}
    convo = [PAD, *history]
    raw = dumps({**before, "messages": convo, **after}, style)
    value, last, _ = decoded(raw, None)
    same(value, raw)
    assert last is not None  # a large body is kept for the next
    last_tail = after
    for i, (added, rewrite) in enumerate(calls):
        if rewrite == 1:  # the last message rewritten (a cache marker moved off it)
            convo = [*convo[:-1], {**convo[-1], "cache_control": {"type": "ephemeral"}}]
        convo = [*convo, *added]
        tail = new_after if new_after is not None and i == len(calls) - 1 else after
        tail = {k: v for k, v in tail.items() if k not in before}
        raw = dumps({**before, "messages": convo, **tail}, style)
        previous = last
        value, last, spliced = decoded(raw, last)
        same(value, raw)
        # a body with \u0000 after its list is not held (the marker would hide a member so named), nor spliced
        # when its members after the list changed and \u0000 comes after what it repeats
        marked = "\\u0000" in json.dumps([tail, last_tail]) or (tail != last_tail and "\\u0000" in json.dumps(added))
        if rewrite != 1 and previous is not None and not marked:
            assert spliced  # what the last body sent is sent again: never decoded whole
            assert all(a is b for a, b in zip(value["messages"], items_of(previous)))  # the very same objects
        last_tail = tail


# strings where the scan can go wrong: runs of backslashes before a quote, escaped quotes, brackets, long runs
tricky = st.text(st.sampled_from(['\\', '"', "[", "]", "{", "}", "a", "\n", "\u00e9", ","]), max_size=30) | st.builds(
    lambda n, s: "x" * n + s, st.integers(0, 3000), texts)


@settings(max_examples=200, deadline=None)
@given(items=st.lists(tricky | st.lists(tricky | scalars, max_size=3) | st.dictionaries(tricky, tricky | scalars,
                                                                                           max_size=3),
                      min_size=1, max_size=6), style=st.integers(0, 3))
def test_the_scan_finds_every_element_s_end(items: list[Any], style: int) -> None:
    """`_elements` (which skips a string by a search for its closing quote) ends each element of a list where its
    JSON ends: each slice between two ends reads as that element, and the list closes at its last bracket."""
    raw = dumps({"messages": items}, style)
    start = raw.index(b"[") + 1
    found = body_splice._elements(raw, start)
    assert found is not None
    ends, close = found
    assert close == raw.rindex(b"]") and len(ends) == len(items)
    for item, begin, end in zip(items, [start, *ends], ends):
        assert json.loads(raw[begin:end].lstrip(b", \n")) == item
    assert body_splice._elements(raw[:ends[0] - 1], start) is None  # the first string or bracket cut: no close


def long_body(convo: list[Any], **after: Any) -> bytes:
    return json.dumps({"model": "m", "messages": [PAD, *convo], **after}).encode()


def held_for(convo: list[Any], **after: Any) -> body_splice.HeldBody:
    raw = long_body(convo, **after)
    held = anchor(raw, json.loads(raw), "messages")
    assert held is not None
    return held


@pytest.mark.parametrize("raw", [
    b'{"model": "m", "messages": [%s, {"role": "user", "content": "a"}, {"role": "user", "content": "b"},]}',
    b'{"model": "m", "messages": [%s, {"role": "user", "content": "a"}, {"role": "user", "content": "b"}}',
    b'{"model": "m", "messages": [%s, {"role": "user", "content": "a"}, {"role": "user", "content": "b"]}',
    b'{"model": "m", "messages": [%s, {"role": "user", "content": "a"}, {"role": "user", "content": "b"}]} x',
    b'{"model": "m", "messages": [%s, {"role": "user", "content": "a"}, {"role": "user" "content": "b"}]}',
], ids=["trailing comma", "list not closed", "object not closed", "text after the body", "no colon"])
def test_a_body_that_is_not_json_is_never_spliced_and_its_error_is_the_whole_decode_s(raw: bytes) -> None:
    held = held_for([{"role": "user", "content": "a"}])
    raw = raw % json.dumps(PAD).encode()
    assert splice(raw, held) is None
    with pytest.raises(BadRequest, match="not valid JSON"):
        decode_whole(raw, "messages")


@pytest.mark.parametrize("rest", [
    b', "messages": []}',  # the list named again: `json` keeps the last
    b', "model": "other"}',  # a member before the list named again after it
    b', "\\u0000": [1]}',  # the marker the rest is parsed under
    b', "max_tokens": 1180591620717411303424}',  # past 64 bits: orjson reads a float, `json` an int
], ids=["list again", "member again", "marker", "big integer"])
def test_what_only_a_whole_decode_reads_right_falls_back_to_it(rest: bytes) -> None:
    held = held_for([{"role": "user", "content": "a"}])
    raw = long_body([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])[:-1] + rest
    assert splice(raw, held) is None
    value, _, _ = decode_whole(raw, "messages")
    assert value == json.loads(raw)


def nested(levels: int) -> Any:
    value: Any = "x"
    for _ in range(levels):
        value = [value]
    return value


def test_a_new_message_nested_past_json_s_limit_falls_back_to_the_whole_decode() -> None:
    held = held_for([{"role": "user", "content": "a"}])
    for levels, spliced in ((950, False), (890, True)):  # the whole body is 3 levels deeper: the body, its list,
        # the message
        raw = long_body([{"role": "user", "content": "a"}, {"role": "user", "content": nested(levels)}])
        got = splice(raw, held)
        assert (got is not None) == spliced
        if got is not None:
            assert got[0] == json.loads(raw)


def test_shapes_that_cannot_be_held() -> None:
    assert anchor(b'{"messages": [1, 2]}' + b" " * (64 << 10), {"messages": [1, 2]}, "messages") is None  # small
    raw = json.dumps({"messages": [PAD, 7, "text"]}).encode()
    assert anchor(raw, json.loads(raw), "messages") is None  # a number element: the scan does not see it
    raw = b'{"messages": [{"a": 1}], "messages": [%s]}' % json.dumps(PAD).encode()
    assert anchor(raw, json.loads(raw), "messages") is None  # the list named twice
    raw = json.dumps({"input": "one string", "pad": PAD}).encode()
    assert anchor(raw, json.loads(raw), "input") is None


def test_a_member_named_as_the_marker_after_the_list_is_never_held() -> None:
    raw = long_body([{"role": "user", "content": "a"}], **{"\x00": "kept"})
    assert anchor(raw, json.loads(raw), "messages") is None
    _, _, last = decode_whole(raw, "messages")
    raw = long_body([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], **{"\x00": "kept"})
    value, _, _, spliced = decode_session(raw, last, "messages")
    assert not spliced and value == json.loads(raw)


def test_a_body_is_scanned_only_when_the_next_repeats_half_of_it(monkeypatch: pytest.MonkeyPatch) -> None:
    scans = []
    monkeypatch.setattr(body_splice, "anchor", lambda *a: scans.append(1) or anchor(*a))
    last = None
    for i in range(4):  # the first message changes every call, as a system prompt with the time in it does
        raw = json.dumps({"model": "m", "messages": [{**PAD, "content": f"{i} " + PAD["content"]},
                                                     {"role": "user", "content": "a"}]}).encode()
        value, last, spliced = decoded(raw, last)
        assert not spliced and value == json.loads(raw)
    assert not scans  # never worth a scan: each body differs from the last early
    convo: list[Any] = []
    for i in range(4):
        convo.append({"role": "user", "content": f"step {i}"})
        value, last, spliced = decoded(long_body(convo), last if i else None)
        assert spliced == (i > 0) and value == json.loads(long_body(convo))
    assert len(scans) == 1  # the first body, once its next repeated it; the rest are spliced by the new bytes
    tools = [{"name": f"tool{i}", "description": PAD["content"][:3000]} for i in range(8)]
    convo, last = [], None
    for i in range(4):  # a short list, then the tools: what the next body repeats is mostly at the end
        convo.append({"role": "user", "content": f"step {i}"})
        raw = json.dumps({"model": "m", "messages": convo, "tools": tools}).encode()
        value, last, spliced = decoded(raw, last)
        assert spliced == (i > 0) and value == json.loads(raw)
    assert len(scans) == 2


def test_a_rewritten_history_decodes_whole() -> None:
    held = held_for([{"role": "user", "content": "a"}])
    raw = json.dumps({"model": "m", "messages": [{**PAD, "content": "compacted"}, {"role": "user", "content": "a"}]}
                     ).encode()
    assert splice(raw, held) is None


def stats(h: Harness) -> dict[str, Any]:
    return call(h.url + "/stats", method="GET").body


def test_sdk_sessions_are_spliced_and_store_each_body_exactly(proxy: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """The OpenAI and Anthropic SDKs through the proxy (bodies under MIN_BYTES spliced too, so that the tiny model
    serves them): every call after a session's first is decoded onto the one before, the Anthropic session moving
    its cache marker to its last message on every call as Claude Code does, and every stored request resolves to
    the body sent."""
    monkeypatch.setattr(body_splice, "MIN_BYTES", 0)
    before = stats(proxy)["bodies"]
    rollout = proxy.open()
    sent = Sent()
    openai_session(proxy, rollout, sent, calls=4)
    check_deltas(proxy, rollout["rollout_id"], sent.bodies)
    client = anthropic_client(rollout, http_client=(marked := Sent()).client(httpx2))
    messages: list[dict[str, Any]] = []
    for i in range(4):
        messages = [{**m, "content": [{k: v for k, v in b.items() if k != "cache_control"} for b in m["content"]]}
                    for m in messages]
        messages.append({"role": "user", "content": [{"type": "text", "text": f"step {i}",
                                                      "cache_control": {"type": "ephemeral"}}]})
        reply = client.messages.create(model=MODEL, max_tokens=6, system="Be terse.", messages=messages,
                                       extra_body={"seed": i}, extra_headers={"X-Trajstore-Session": "claude"})
        messages.append({"role": "assistant", "content": [b.model_dump() for b in reply.content] or
                         [{"type": "text", "text": "..."}]})
    after = stats(proxy)["bodies"]
    # whole: each session's first call, and the Anthropic session's second, whose one earlier message lost its
    # marker (nothing the last body sent is sent again); the later calls repeat all but the last message
    assert after["spliced"] - before["spliced"] == 3 + 2
    assert after["whole"] - before["whole"] == 1 + 2
    turns = [t for t in proxy.turns(rollout["rollout_id"]) if t["session_id"] == "claude"]
    full = dict(zip((t["event_id"] for t in proxy.turns(rollout["rollout_id"])),
                    proxy.requests(rollout["rollout_id"]), strict=True))
    assert [full[t["event_id"]] for t in turns] == marked.bodies
