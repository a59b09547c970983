"""One caller's huge conversation holds no other caller (issue 20, item 6).

A 4-7.5 MB body held every other rollout and /health for 9-20 s: its history was reconciled,
rendered with the chat template and tokenized on the event loop (count_tokens too). Here the
rendering of a multi-MB conversation is held until /health and another rollout's call have
been answered: on the event loop that cannot happen (the test sees the hold time out), on a
render thread both answer first. And a conversation far over the context is refused by its
size, before anything is rendered.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from collectors.embedded.app import RunningServer
from collectors.policy import EmbeddedClient
from collectors.proxy.render import ChatRenderer
from tests.collectors import http
from tests.collectors.proxy_harness import MODEL, Harness, Recording, call, running_proxy

BIG = 2 << 20  # characters of one message: a multi-MB body, under the proxy's 16 MiB limit
ROUTES = {"chat": ("/v1/chat/completions", {"max_tokens": 1}), "count_tokens": ("/v1/messages/count_tokens", {})}


@pytest.fixture(scope="module")
def roomy(server: RunningServer, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A proxy whose context admits a multi-MB conversation, so that rendering it is the slow part."""
    with running_proxy(Recording(EmbeddedClient(server.url)), tmp_path_factory.mktemp("store"), tiny_model,
                       max_model_len=1 << 40) as proxy:
        yield proxy


@pytest.mark.parametrize("route", ROUTES)
def test_a_huge_conversation_is_rendered_while_others_are_served(roomy: Harness, route: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    rendering, answered, held_out = threading.Event(), threading.Event(), threading.Event()
    render = ChatRenderer.prompt_text

    def held(self: ChatRenderer, req: Any, messages: Any = None) -> str:
        if len(str(req.messages[-1]["content"])) >= BIG // 2:
            rendering.set()
            if not answered.wait(20):  # on the event loop nothing else can be answered: give up, say so
                held_out.set()
        return render(self, req, messages)

    monkeypatch.setattr(ChatRenderer, "prompt_text", held)
    path, extra = ROUTES[route]
    big, small = roomy.open(), roomy.open()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "word " * (BIG // 5)}], **extra}
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(call, roomy.url + path, body, key=big["api_key"])
        assert rendering.wait(120), "the big call never reached its rendering"
        health = http.get(roomy.url + "/health", timeout=60)
        other = call(roomy.url + "/v1/chat/completions", {"model": MODEL, "max_tokens": 2,
                                                          "messages": [{"role": "user", "content": "hi"}]},
                     key=small["api_key"])
        big_done_first = pending.done()
        answered.set()
        reply = pending.result()
    assert not held_out.is_set(), "/health and the other rollout waited for the big call's rendering"
    assert not big_done_first
    assert health.status == 200 and other.status == 200, other.body
    assert reply.status in (200, 400, 502), reply.body  # the upstream's context is smaller than the proxy's


@pytest.mark.parametrize("route", ROUTES)
def test_a_conversation_far_over_the_context_is_refused_before_rendering(proxy: Harness, route: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    rendered: list[int] = []
    render = ChatRenderer.prompt_text

    def counted(self: ChatRenderer, req: Any, messages: Any = None) -> str:
        rendered.append(1)
        return render(self, req, messages)

    monkeypatch.setattr(ChatRenderer, "prompt_text", counted)
    path, extra = ROUTES[route]
    rollout = proxy.open()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "ab " * 400_000}], **extra}  # 1.2M characters
    r = call(proxy.url + path, body, key=rollout["api_key"])
    assert r.status == 400, r.body
    message = r.body["error"]["message"]
    assert "the prompt is at least" in message and "the model's context holds" in message, message
    assert rendered == []
    fits = call(proxy.url + path, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra},
                key=rollout["api_key"])
    assert fits.status == 200 and rendered == [1]


def test_a_huge_call_renders_on_the_low_priority_threads_and_is_recorded_off_the_event_loop(
        roomy: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    from collectors.proxy import capture

    threads: dict[str, list[str]] = {"render": [], "record": []}
    render, record = capture.Capture._render, capture.record_turn

    def rendering(self: capture.Capture, *args: Any) -> Any:
        threads["render"].append(threading.current_thread().name)
        return render(self, *args)

    def recording(*args: Any) -> None:
        threads["record"].append(threading.current_thread().name)
        record(*args)

    monkeypatch.setattr(capture.Capture, "_render", rendering)
    monkeypatch.setattr(capture, "record_turn", recording)
    monkeypatch.setattr(capture, "HEAVY_BODY_BYTES", 2000)  # as if these bodies were megabytes
    monkeypatch.setattr(capture, "LONG_TURN_IDS", 400)
    rollout = roomy.open()
    for words in (10, 1000, 10):  # small, huge, small
        r = call(roomy.url + "/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "messages": [
            {"role": "user", "content": "word " * words}]}, key=rollout["api_key"])
        assert r.status == 200, r.body
    assert [name.split("_")[0] for name in threads["render"]] == ["proxy-render", "proxy-heavy", "proxy-render"]
    loop = "trajstore-proxy"  # the proxy's event-loop thread (`serve_proxy_in_thread`)
    assert threads["record"][0] == loop and threads["record"][2] == loop
    assert threads["record"][1].startswith("proxy-render")
    turns = roomy.turns(rollout["rollout_id"])
    assert len(turns) == 3 and len(turns[1]["prompt_ids"]) > 400  # every call stored


def test_closing_a_rollout_lets_go_of_its_sessions_ids(roomy: Harness) -> None:
    """A closed rollout keeps its counts and nothing of its sessions' tokens, messages or bodies. A session's ids
    are one int32 array, freed at once with its last reference (no GIL hold of tens of milliseconds, as a list
    of millions of ints had to be emptied a slice at a time)."""
    from collectors.proxy.protocol import SESSION_HEADER

    rollout = roomy.open()
    for session, words in (("long", 200), ("short", 3)):
        r = call(roomy.url + "/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "messages": [
            {"role": "user", "content": "word " * words}]}, key=rollout["api_key"], headers={SESSION_HEADER: session})
        assert r.status == 200, r.body
    held = roomy.proxy.capture.registry.by_id[rollout["rollout_id"]]
    logs = [slot.state.held.ids for slot in held.sessions.values()]
    assert [len(log) > 200 for log in logs] == [True, False] and all(log.ids.itemsize == 4 for log in logs)
    assert roomy.close(rollout).status == 200
    assert all(slot.state.held is None and slot.state.answered is None for slot in held.sessions.values())
    assert not held.last_bodies and [slot.state.turns for slot in held.sessions.values()] == [1, 1]