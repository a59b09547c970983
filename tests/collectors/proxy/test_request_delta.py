"""A call that extends its session's previous one stores its request as a delta; every reader gets it whole.

Real SDK clients on loopback in front of the tiny model: the body each call sent is read off the wire (an httpx
request hook) and compared, as parsed JSON, with what the store, replay, the viewer and exports give back.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest

from collectors.policy import EmbeddedClient
from collectors.proxy.request_delta import stored_request
from collectors.proxy.wire import OpenAIChat, OpenAIResponses
from collectors.replay import load_episode
from collectors.serving import BodyText
from collectors.viewer import ViewerSettings, viewer_in_thread
from tests.collectors.proxy_harness import MODEL, Harness, Recording, anthropic_client, openai_client, running_proxy
from tests.collectors.viewer.test_app import get
from trajstore.json_text import JSONText
from trajstore.requests import FULL_REQUESTS_SQL, full_requests, resolve


class Sent:
    """The JSON bodies a client sent, in order (an httpx request hook)."""

    def __init__(self) -> None:
        self.bodies: list[Any] = []

    def client(self, http: Any = httpx) -> Any:
        """An `http.Client` that records (httpx for the OpenAI SDK, httpx2 for the Anthropic SDK)."""
        return http.Client(event_hooks={"request": [self._seen]})

    def _seen(self, request: Any) -> None:
        request.read()
        self.bodies.append(json.loads(request.content))


TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} a file of the repository.",
                                           "parameters": {"type": "object", "required": ["path"], "properties": {
                                               "path": {"type": "string"}, "limit": {"type": ["integer", "null"]}}}}}
         for name in ("read", "write")]


def openai_session(h: Harness, rollout: dict[str, Any], sent: Sent, *, calls: int = 4,
                   session: str = "main") -> None:
    client = openai_client(rollout, http_client=sent.client())
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    for i in range(calls):
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, seed=i, tools=TOOLS,
                                               extra_headers={"X-Trajstore-Session": session})
        messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                     {"role": "user", "content": f"go on {i} ({session})"}]


def check_deltas(h: Harness, rollout_id: str, sent: list[Any], session: str = "main") -> list[dict[str, Any]]:
    """The session's turns: the first whole, each later one a delta of the one before; each resolves to the body
    sent, exactly."""
    turns = [t for t in h.turns(rollout_id) if t["session_id"] == session]
    assert len(turns) == len(sent)
    assert turns[0]["request_base"] is None and turns[0]["request_shared"] is None
    assert json.loads(turns[0]["request"]) == sent[0]
    for before, turn, body, was in zip(turns, turns[1:], sent[1:], sent, strict=False):
        assert turn["request_base"] == before["event_id"]
        assert turn["request_shared"] == len(was["messages"])
        stored = json.loads(turn["request"])
        assert stored["messages"] == body["messages"][len(was["messages"]):]  # the new items only
        # the arrays and objects sent again as the call before sent them are left out, and named
        repeated = [k for k, v in body.items() if k != "messages" and isinstance(v, (list, dict))
                    and list(body) == list(was) and v == was[k]]
        assert (turn["request_kept"] or []) == repeated
        assert {k: v for k, v in stored.items() if k != "messages"} == {
            k: v for k, v in body.items() if k != "messages" and k not in repeated}
    full = resolve(h.store, [t["event_id"] for t in turns])
    assert [json.loads(full[t["event_id"]]) for t in turns] == sent
    in_sql = {r["event_id"]: json.loads(r["request"])
              for r in h.store.query(FULL_REQUESTS_SQL, {"rollout": rollout_id}).to_pylist()}
    assert [in_sql[t["event_id"]] for t in turns] == sent  # the SQL recipe agrees
    return turns


def test_openai_calls_store_deltas_that_resolve_to_each_body_sent(proxy: Harness) -> None:
    rollout = proxy.open()
    main, other = Sent(), Sent()
    openai_session(proxy, rollout, main)
    openai_session(proxy, rollout, other, calls=2, session="helper")  # another session chains on its own turns
    openai_session(proxy, rollout, main, calls=0)
    turns = check_deltas(proxy, rollout["rollout_id"], main.bodies)
    check_deltas(proxy, rollout["rollout_id"], other.bodies, "helper")
    assert [t["request_kept"] for t in turns] == [None, ["tools"], ["tools"], ["tools"]]  # the tools stored once
    total = sum(len(t["request"]) for t in proxy.turns(rollout["rollout_id"]))
    assert total < sum(len(json.dumps(b)) for b in main.bodies + other.bodies)
    # replay has each call's full request; the viewer's episode leaves the requests out (megabytes of history)
    episode = load_episode(proxy.store, rollout["rollout_id"])
    shown = {t.event_id: t.request for s in episode.segments for t in s.turns}
    turns = proxy.turns(rollout["rollout_id"])
    assert [shown[t["event_id"]] for t in turns if t["session_id"] == "main"] == main.bodies
    assert [shown[t["event_id"]] for t in turns if t["session_id"] == "helper"] == other.bodies
    with viewer_in_thread(ViewerSettings(store=proxy.store.location.uri, port=0)) as url:
        status, _, body = get(f"{url}/api/rollouts/{rollout['rollout_id']}")
    assert status == 200
    viewed = [t for s in body["episode"]["segments"] for t in s["turns"]]
    assert sorted(t["event_id"] for t in viewed) == sorted(t["event_id"] for t in turns)
    assert not any("request" in t for t in viewed)


def test_anthropic_calls_store_deltas_streamed_or_not(proxy: Harness) -> None:
    rollout = proxy.open()
    sent = Sent()
    client = anthropic_client(rollout, http_client=sent.client(httpx2))
    messages: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]
    for i in range(4):
        ask: dict[str, Any] = {"model": MODEL, "max_tokens": 6, "system": [{"type": "text", "text": "You are terse."}],
                               "messages": messages, "extra_body": {"seed": i}}
        if i % 2:
            with client.messages.stream(**ask) as stream:
                reply = stream.get_final_message()
        else:
            reply = client.messages.create(**ask)
        messages += [{"role": "assistant", "content": [b.model_dump() for b in reply.content] or "..."},
                     {"role": "user", "content": f"Next {i}"}]
    turns = check_deltas(proxy, rollout["rollout_id"], sent.bodies)
    assert json.loads(turns[0]["meta"])["protocol"] == "anthropic"
    # a streamed call sends `stream`, the others do not: other members than the call before's, so none is left out
    assert [t["request_kept"] for t in turns] == [None] * 4


def test_a_rewritten_history_is_stored_whole_and_the_next_call_extends_it(proxy: Harness) -> None:
    rollout = proxy.open()
    sent = Sent()
    client = openai_client(rollout, http_client=sent.client())
    long = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
            {"role": "user", "content": "three"}]
    compacted = [{"role": "user", "content": "summary: one, two"}, {"role": "user", "content": "three"}]
    for messages in (long, long + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "four"}],
                     compacted, compacted + [{"role": "assistant", "content": "y"}, {"role": "user", "content": "5"}]):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    turns = proxy.turns(rollout["rollout_id"])
    assert [t["request_base"] is not None for t in turns] == [False, True, False, True]
    assert json.loads(turns[2]["request"]) == sent.bodies[2]
    assert turns[3]["request_base"] == turns[2]["event_id"] and turns[3]["request_shared"] == 2
    assert proxy.requests(rollout["rollout_id"]) == sent.bodies


@pytest.fixture
def whole_proxy(server: Any, tiny_model: Path, tmp_path: Path) -> Iterator[Harness]:
    with running_proxy(Recording(EmbeddedClient(server.url)), tmp_path / "store", tiny_model,
                       whole_requests=True) as h:
        yield h


def test_whole_requests_setting_stores_every_body_whole(whole_proxy: Harness) -> None:
    rollout = whole_proxy.open()
    sent = Sent()
    openai_session(whole_proxy, rollout, sent, calls=3)
    turns = whole_proxy.turns(rollout["rollout_id"])
    assert [t["request_base"] for t in turns] == [None] * 3
    assert [json.loads(t["request"]) for t in turns] == sent.bodies


class CountedBody(BodyText):
    """A body that counts how often its text is made."""

    __slots__ = ("made",)

    def __init__(self, raw: bytes) -> None:
        super().__init__(raw)
        self.made = 0

    def text(self) -> JSONText:
        self.made += 1
        return super().text()


def _call(body: dict[str, Any], wire: Any, *, strict: bool = True) -> tuple[dict[str, Any], Any]:
    req = wire.parse_request(body)
    raw = CountedBody(json.dumps(body).encode()) if strict else None
    return body, dataclasses.replace(req, body_json=raw)


@pytest.mark.parametrize("case", ["first", "rewritten", "other protocol", "not strict", "input is text", "whole",
                                  "megabytes new"])
def test_what_is_stored_whole(case: str) -> None:
    """Each case where a call cannot be stored as a delta of the previous one (pure: no proxy)."""
    chat, responses = OpenAIChat(), OpenAIResponses()
    one = {"model": MODEL, "messages": [{"role": "user", "content": "a"}]}
    two = {"model": MODEL, "messages": [*one["messages"], {"role": "assistant", "content": "b"},
                                        {"role": "user", "content": "c"}]}
    body, req = _call(one, chat)
    last = stored_request(body, req, chat.name, chat.conversation, "e0", None).last
    assert last is not None and last.items is body["messages"]  # kept by reference, not copied
    body, req = _call(two, chat)
    delta = stored_request(body, req, chat.name, chat.conversation, "e1", last)
    assert (delta.base, delta.shared, json.loads(delta.request)["messages"]) == ("e0", 1, two["messages"][1:])
    assert req.body_json.made == 0  # a delta never makes the body's own text (the costly part of keeping it)
    wire, field = chat, chat.conversation
    if case == "first":
        last = None
    elif case == "rewritten":
        body, req = _call({**two, "messages": [{"role": "user", "content": "summary"}, *two["messages"][1:]]}, chat)
    elif case == "other protocol":
        body, req = _call({"model": MODEL, "input": [{"role": "user", "content": "a"}, {"role": "user",
                                                                                      "content": "z"}]}, responses)
        wire, field = responses, responses.conversation
    elif case == "not strict":
        body, req = _call(two, chat, strict=False)
    elif case == "input is text":
        body, req = _call({"model": MODEL, "input": "just text"}, responses)
        wire, field = responses, responses.conversation
    elif case == "megabytes new":  # stored as its own text, not written again; the next call is a delta of it
        body, req = _call({**two, "messages": [*two["messages"], {"role": "user", "content": "x" * (1 << 20)}]},
                          chat)
        assert stored_request(body, req, chat.name, field, "e1", last).request is req.body_json.text()
    stored = stored_request(body, req, wire.name, field, "e1", last, whole=case == "whole")
    assert stored.base is None and stored.shared is None
    assert (json.loads(stored.request) if isinstance(stored.request, str) else stored.request) == body
    assert (stored.last is None) == (case in ("not strict", "input is text"))


def test_a_responses_input_list_is_stored_as_a_delta_and_resolves() -> None:
    wire = OpenAIResponses()
    one = {"model": MODEL, "instructions": "terse", "input": [{"role": "user", "content": "a"}]}
    two = {**one, "input": [*one["input"], {"type": "message", "role": "assistant",
                                            "content": [{"type": "output_text", "text": "b"}]},
                            {"role": "user", "content": "c"}]}
    first = stored_request(*_call(one, wire), wire.name, wire.conversation, "e0", None)
    second = stored_request(*_call(two, wire), wire.name, wire.conversation, "e1", first.last)
    assert (second.base, second.shared) == ("e0", 1)
    rows = [{"event_id": e, **s.columns()} for e, s in (("e0", first), ("e1", second))]
    assert json.loads(full_requests(rows)["e1"]) == two


def test_a_delta_leaves_out_the_arrays_objects_and_long_texts_the_call_before_sent() -> None:
    """Pure: which members a delta names in request_kept, and every delta resolves to the body sent."""
    chat = OpenAIChat()
    system = "You are a coding agent. " * 60  # 1,440 characters: kept; `model` and `user` are short texts: stored
    calls = [{"model": MODEL, "system_hint": system, "user": "u1", "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "read"}},
              "messages": [{"role": "user", "content": "a"}]}]
    more = [{"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    calls.append({**calls[0], "messages": calls[0]["messages"] + more})  # all of it again, then what is new
    calls.append({**calls[1], "tools": TOOLS[:1], "messages": calls[1]["messages"] + more})  # a tool dropped
    moved = {k: v for k, v in calls[2].items() if k != "model"}
    calls.append({**moved, "model": MODEL, "messages": calls[2]["messages"] + more})  # the members in another order
    calls.append({**calls[3], "messages": calls[3]["messages"] + more})
    rows, last, stored = [], None, []
    for i, call in enumerate(calls):
        body, req = _call(json.loads(json.dumps(call)), chat)  # decoded anew: equal values, not the same objects
        got = stored_request(body, req, chat.name, chat.conversation, f"e{i}", last)
        last = got.last
        stored.append(got)
        rows.append({"event_id": f"e{i}", **got.columns()})
    assert [s.kept for s in stored] == [None, ["system_hint", "tools", "tool_choice"], ["system_hint", "tool_choice"],
                                        None, ["system_hint", "tools", "tool_choice"]]
    assert all(s.base == f"e{i}" for i, s in enumerate(stored[1:]))
    for s in stored[1:]:
        kept = s.kept or []
        assert not kept or set(kept).isdisjoint(json.loads(s.request))  # left out of the stored text
    full = full_requests(rows)
    assert [json.loads(full[f"e{i}"]) for i in range(len(calls))] == calls
    assert [list(json.loads(full[f"e{i}"])) for i in range(len(calls))] == [list(c) for c in calls]  # in order


def test_a_call_that_changed_its_latest_items_shares_the_ones_before() -> None:
    """Pure: Claude Code's prompt-cache breakpoint moves to the newest message on every call, so the previous call's
    last item comes back changed; the delta shares the items before it and holds it again. A list that shares less
    than half of the previous one is stored whole."""
    chat = OpenAIChat()

    def user(text: str, mark: bool = False) -> dict[str, Any]:
        block: dict[str, Any] = {"type": "text", "text": text, **({"cache_control": {"type": "ephemeral"}} if mark else {})}
        return {"role": "user", "content": [block]}

    reply = {"role": "assistant", "content": "ok"}
    history = [user(f"u{i}") if i % 2 == 0 else reply for i in range(6)]
    calls = [history[:5] + [user("u6", True)], history[:5] + [user("u6"), reply, user("u8", True)],
             [user("u0", True), reply, user("u2")]]  # the history cut back near its start
    rows, last = [], None
    for i, messages in enumerate(calls):
        body, req = _call({"model": MODEL, "messages": messages}, chat)
        got = stored_request(body, req, chat.name, chat.conversation, f"e{i}", last)
        last = got.last
        rows.append({"event_id": f"e{i}", **got.columns()})
    assert [(r["request_base"], r["request_shared"]) for r in rows] == [(None, None), ("e0", 5), (None, None)]
    assert json.loads(rows[1]["request"])["messages"] == calls[1][5:]  # the changed item again, then the new ones
    assert [json.loads(v) for v in full_requests(rows).values()] == [{"model": MODEL, "messages": m} for m in calls]
