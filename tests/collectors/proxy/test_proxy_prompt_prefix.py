"""A session through the capture proxy with the embedded server's held prefixes: every call after a segment's
first sends only the new ids after a `prompt_prefix` (the server's own counters say so), and the store holds
exactly the turns the same calls store with the feature off."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai

from collectors.embedded.app import RunningServer
from collectors.policy import EmbeddedClient
from collectors.policy.token_ids import TokenLog
from collectors.proxy.segmenter import SessionState, plan_turn, record_turn
from tests.collectors import http
from tests.collectors.proxy_harness import (
    MODEL,
    Harness,
    Recording,
    assert_exact,
    call,
    openai_client,
    running_proxy,
)

KEEP = ("segment_id", "turn_index", "prompt_ids", "output_ids", "output_logprobs", "finish_reason")


def conversation(c: openai.OpenAI) -> None:
    """Calls of one agent: plain, streamed, cut by max_tokens, ended by a stop string; then a compaction fork."""
    history: list[dict[str, Any]] = [{"role": "system", "content": "Agent."}, {"role": "user", "content": "Go"}]
    for i, how in enumerate(({}, {"stream": True}, {"max_tokens": 3}, {"stop": ["e", "a"]}, {"stream": True})):
        options = {"max_tokens": 8, "seed": i, **how}
        if options.get("stream"):
            reply = "".join(e.choices[0].delta.content or "" for e in c.chat.completions.create(
                model=MODEL, messages=history, **options) if e.choices)
        else:
            reply = c.chat.completions.create(model=MODEL, messages=history, **options).choices[0].message.content
        history += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"Step {i}"}]
    c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Summary. Go on."}], max_tokens=4,
                              seed=9)


def run(server: RunningServer, tiny_model: Path, store: Path, make: Callable[[], EmbeddedClient]
        ) -> tuple[list[dict[str, Any]], Harness, dict[str, Any]]:
    with running_proxy(Recording(make()), store, tiny_model) as h:
        rollout = h.open()
        conversation(openai_client(rollout))
        turns = assert_exact(h, rollout["rollout_id"])
        stats = call(h.url + "/stats").body
    segments = {t["segment_id"]: f"s{i}" for i, t in enumerate(turns)}  # random ids: compared by their order
    return [{k: segments[t[k]] if k == "segment_id" else t[k] for k in KEEP} for t in turns], h, stats


def test_a_session_through_the_proxy_sends_prefixes_and_stores_the_same_turns(
        server: RunningServer, tiny_model: Path, tmp_path: Path) -> None:
    before = http.get(server.url + "/stats").json()["prefix_cache"]
    off, _, _ = run(server, tiny_model, tmp_path / "off", lambda: EmbeddedClient(server.url, prompt_prefix=False))
    middle = http.get(server.url + "/stats").json()["prefix_cache"]
    assert (middle["hits"], middle["stored"]) == (before["hits"], before["stored"])  # nothing sent with a key
    on, _, stats = run(server, tiny_model, tmp_path / "on", lambda: EmbeddedClient(server.url, prefix_min_ids=1))
    after = http.get(server.url + "/stats").json()["prefix_cache"]
    assert on == off and [t["turn_index"] for t in on] == [0, 1, 2, 3, 4, 0]
    # every call after a segment's first named the held ids: 4 of 6, none resent whole
    assert after["hits"] - middle["hits"] == 4 and after["misses"] == middle["misses"]
    assert after["stored"] - middle["stored"] == 6
    assert stats["prompt_prefix"] == {"prefix_calls": 4, "resent_whole": 0}


def test_a_segments_first_call_is_a_view_of_the_log_the_session_keeps() -> None:
    """The log the server learned from a segment's first call (its key) is the log of the segment's next calls."""
    state = SessionState(name="s")
    def encode(text: str) -> list[int]:
        return [ord(ch) for ch in text]

    plan = plan_turn(state, "hello", encode, lambda: "seg")
    assert state.held is None and state.segment_id is None  # planning changes nothing (the call may fail)
    first_log = plan.full_ids.log  # type: ignore[attr-defined]
    assert list(plan.full_ids) == plan.prompt_ids == encode("hello")
    record_turn(state, plan, "hello", [1, 2], "\x01\x02")
    assert state.held is not None and state.held.ids is first_log and first_log.ids.tolist() == encode("hello") + [1, 2]
    nxt = plan_turn(state, "hello\x01\x02 more", encode, lambda: "other")
    assert nxt.full_ids.log is first_log and nxt.full_ids.logged == 7  # type: ignore[attr-defined]
    # a first call's view whose log was grown elsewhere is copied, not adopted
    grown = plan_turn(SessionState(name="t"), "abc", encode, lambda: "seg2")
    grown.full_ids.log.extend([9])  # type: ignore[attr-defined]
    other = SessionState(name="t")
    record_turn(other, grown, "abc", [3], "\x03")
    assert other.held is not None and other.held.ids is not grown.full_ids.log  # type: ignore[attr-defined]
    assert other.held.ids.ids.tolist() == encode("abc") + [3] and isinstance(other.held.ids, TokenLog)
