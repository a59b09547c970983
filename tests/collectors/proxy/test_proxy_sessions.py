"""Rollouts, sessions and segments end to end: compaction forks, sub-agents, key isolation, close and rewards."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import openai
import pytest

from tests.collectors.proxy_harness import MODEL, Harness, assert_exact, call, openai_client


def say(c: openai.OpenAI, messages: list[dict[str, Any]], seed: int) -> str:
    return c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, seed=seed).choices[0].message.content


def rollout_row(h: Harness, rollout_id: str) -> dict[str, Any]:
    return h.store.query("SELECT * FROM rollouts WHERE rollout_id = ?", [rollout_id]).to_pylist()[0]


def test_compaction_forks_into_two_segments_of_one_rollout(proxy: Harness) -> None:
    rollout = proxy.open(group_id="compaction", group_size=1)
    c = openai_client(rollout)
    history: list[dict[str, Any]] = [{"role": "system", "content": "Agent."}, {"role": "user", "content": "Step one"}]
    for i in range(2):
        history += [{"role": "assistant", "content": say(c, history, i)}, {"role": "user", "content": f"Step {i + 2}"}]
    compacted = [{"role": "system", "content": "Agent."},
                 {"role": "user", "content": "Summary: two steps done. Go on."}]
    compacted.append({"role": "assistant", "content": say(c, compacted, 7)})
    say(c, [*compacted, {"role": "user", "content": "Finish"}], 8)
    turns = assert_exact(proxy, rollout["rollout_id"])
    segments = [t["segment_id"] for t in turns]
    assert segments[0] == segments[1] != segments[2] == segments[3]
    assert [t["turn_index"] for t in turns] == [0, 1, 0, 1]
    fork = json.loads(turns[2]["meta"])
    assert fork["fork"] == "history_rewrite" and fork["previous_segment"] == segments[0]
    assert proxy.close(rollout, status="completed", rewards={"tests": 1.0, "style": 0.5}).status == 200
    row = rollout_row(proxy, rollout["rollout_id"])
    assert row["segments"] == 2 and row["turns"] == 4 and row["reward"] == 1.5 and row["status"] == "completed"
    assert row["trainable"] and row["group_size"] == 1
    samples = proxy.store.query("SELECT segment_id, turns FROM samples WHERE rollout_id = ? ORDER BY first_time",
                                [rollout["rollout_id"]]).to_pylist()
    assert [(s["segment_id"], s["turns"]) for s in samples] == [(segments[0], 2), (segments[2], 2)]


def test_the_same_call_sent_again_forks_as_a_retry(proxy: Harness) -> None:
    """An agent that retries its call (its answer was lost) or draws again for the same context starts a new
    sample from the same prompt, named `retry` in the turn and in /stats."""
    rollout = proxy.open()
    c = openai_client(rollout)
    messages = [{"role": "user", "content": "Roll a die"}]
    before = call(proxy.url + "/stats").body["forks"].get("retry", 0)
    say(c, messages, 1)
    say(c, messages, 2)
    turns = assert_exact(proxy, rollout["rollout_id"])
    metas = [json.loads(t["meta"]) for t in turns]
    assert [m["fork"] for m in metas] == [None, "retry"]
    assert turns[1]["segment_id"] != turns[0]["segment_id"] and metas[1]["previous_segment"] == turns[0]["segment_id"]
    assert call(proxy.url + "/stats").body["forks"]["retry"] == before + 1


def test_sub_agents_get_their_own_sessions_and_segments(proxy: Harness) -> None:
    rollout = proxy.open()
    main = openai_client(rollout)
    history: list[dict[str, Any]] = [{"role": "user", "content": "Plan the work"}]
    history.append({"role": "assistant", "content": say(main, history, 1)})
    # a sub-agent by header (OpenAI SDK) and one by key suffix (Anthropic SDK, no headers needed)
    explorer = openai_client(rollout, default_headers={"X-Trajstore-Session": "explorer"})
    say(explorer, [{"role": "user", "content": "Look"}], 2)
    critic = anthropic.Anthropic(base_url=proxy.url, api_key=rollout["api_key"] + ".critic", max_retries=0)
    critic.messages.create(model=MODEL, max_tokens=6, messages=[{"role": "user", "content": "Judge"}])
    say(main, [*history, {"role": "user", "content": "Continue"}], 3)
    turns = assert_exact(proxy, rollout["rollout_id"])
    by_session = {}
    for t in turns:
        fork = json.loads(t["meta"])["fork"]
        by_session.setdefault(t["session_id"], []).append((t["segment_id"], t["turn_index"], fork))
    assert set(by_session) == {"main", "explorer", "critic"}
    assert [i for _, i, _ in by_session["main"]] == [0, 1] and len({s for s, _, _ in by_session["main"]}) == 1
    assert by_session["explorer"][0][1:] == (0, None) and by_session["critic"][0][1:] == (0, None)
    assert len({s for v in by_session.values() for s, _, _ in v}) == 3
    proxy.close(rollout)
    row = rollout_row(proxy, rollout["rollout_id"])
    assert row["sessions"] == 3 and row["segments"] == 3


def test_a_key_reaches_only_its_own_rollout(proxy: Harness) -> None:
    a, b = proxy.open(), proxy.open()
    before = proxy.count()
    messages = [{"role": "user", "content": "hi"}]
    # A's URL prefix with B's key in the header: refused, not silently routed
    mixed = openai.OpenAI(base_url=a["base_urls"]["openai"], api_key=b["api_key"], max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="different rollouts"):
        mixed.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    unknown = openai.OpenAI(base_url=proxy.url + "/v1", api_key="ts-" + "0" * 32, max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="unknown API key") as err:
        unknown.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    assert err.value.body["code"] == "invalid_api_key" and err.value.status_code == 401
    other = anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-something-else", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as aerr:
        other.messages.create(model=MODEL, max_tokens=4, messages=messages)
    shown = aerr.value.body["error"]["message"]  # a real key sent to the wrong server: at most 4 characters of it
    assert "'sk-a...'" in shown and "sk-an" not in shown, shown
    assert aerr.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                          "message": aerr.value.body["error"]["message"]}}
    nokey = call(proxy.url + "/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": messages})
    assert nokey.status == 401 and "no API key" in nokey.body["error"]["message"]
    # B cannot close A, and A's key works with a plain base URL (the header)
    close_a = f"{proxy.url}/rollouts/{a['rollout_id']}/close"
    assert call(close_a, {"status": "completed"}, key=b["api_key"]).status == 401
    plain = openai.OpenAI(base_url=proxy.url + "/v1", api_key=a["api_key"], max_retries=0)
    r = plain.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    assert r.model_extra["trajstore"]["rollout_id"] == a["rollout_id"]
    assert proxy.close(a).status == 200
    assert proxy.close(a).status == 409
    with pytest.raises(openai.AuthenticationError, match="closed"):
        plain.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    assert proxy.count() == before + 1
    assert [t["rollout_id"] for t in proxy.turns(a["rollout_id"])] == [a["rollout_id"]]
    assert proxy.turns(b["rollout_id"]) == []


def test_rollout_routes(proxy: Harness) -> None:
    before = call(proxy.url + "/stats").body
    assert call(proxy.url + "/rollouts", {"group_size": 0}).status == 400
    r = proxy.open(rollout_id="fixed-id", run="exp-2", meta={"task": "t9"})
    assert r["rollout_id"] == "fixed-id" and r["run"] == "exp-2" and r["group_id"] == "fixed-id"
    assert call(proxy.url + "/rollouts", {"rollout_id": "fixed-id"}).status == 409
    status = proxy.store.query("SELECT status, meta FROM events WHERE kind = 'status' AND rollout_id = 'fixed-id'")
    assert status.to_pylist() == [{"status": "started", "meta": '{"task":"t9"}'}]
    bad = call(f"{proxy.url}/rollouts/fixed-id/close", {"status": "done"}, key=r["api_key"])
    assert bad.status == 400 and "completed" in bad.body["error"]["message"]
    summary = call(f"{proxy.url}/rollouts/fixed-id", key=r["api_key"]).body
    assert summary["turns"] == 0 and not summary["closed"]
    assert proxy.close(r, status="failed", error="agent crashed").body["status"] == "failed"
    assert rollout_row(proxy, "fixed-id")["error"] == "agent crashed"
    stats = call(proxy.url + "/stats").body
    assert stats["rollouts"]["opened"] == before["rollouts"]["opened"] + 1  # the 409 opened nothing
    assert stats["rollouts"]["closed"] == before["rollouts"]["closed"] + 1  # the 400 closed nothing
    assert stats["turns"] == before["turns"] and stats["forks"] == before["forks"]
    assert stats["errors"]["400"] == before["errors"].get("400", 0) + 2


def test_post_seal_puts_the_turns_answered_so_far_in_the_table(proxy: Harness) -> None:
    """`POST /seal` seals the proxy's write-ahead log now: what it answered is in the Delta table, which other
    machines read, without waiting for the seal interval. It is a control route: JSON only."""
    rollout = proxy.open(group_id="sealed")
    say(openai_client(rollout), [{"role": "user", "content": "Seal me"}], 3)
    sql = "SELECT count(*) AS n FROM turns WHERE rollout_id = ?"

    def in_table() -> int:
        return proxy.store.snapshot(live=False).query(sql, [rollout["rollout_id"]]).to_pylist()[0]["n"]

    assert in_table() == 0  # appended and durable, in the write-ahead log only
    refused = call(proxy.url + "/seal", data=b"{}", headers={"Content-Type": "text/plain"})
    assert refused.status == 415 and "application/json" in refused.body["error"]["message"]
    assert in_table() == 0
    sealed = call(proxy.url + "/seal", {})
    assert sealed.status == 200 and sealed.body["sealed"] >= 2, sealed.body  # its start and its turn at least
    assert in_table() == 1
    assert call(proxy.url + "/seal", {}).body == {"sealed": 0}  # nothing new


# what `trajstore collect` used to ask the store for each finished rollout; the summary must say the same
FACTS_SQL = """
    SELECT last(finish_reason ORDER BY coalesce(session_id, 'main') = 'main', time, writer_seq) AS finish_reason,
           count(*) AS turns, sum(output_tokens)::BIGINT AS output_tokens, min(policy_version) AS min_policy_version,
           max(policy_version) AS max_policy_version
    FROM turns WHERE rollout_id = ?
"""


def test_the_summary_counts_the_turns_as_the_store_holds_them(proxy: Harness) -> None:
    """Finish reason of the last turn (session main first), turns, output tokens and policy versions: a
    runner reads them from the close instead of querying the store."""
    keys = ("finish_reason", "turns", "output_tokens", "min_policy_version", "max_policy_version")
    with_main, sub_only = proxy.open(), proxy.open()
    main = openai_client(with_main)
    main.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Go"}], max_tokens=1, seed=1)
    explorer = openai_client(with_main, default_headers={"X-Trajstore-Session": "explorer"})
    for seed in (2, 3):  # the sub-agent's turns come later, but the main session's last one decides
        explorer.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Look"}], max_tokens=6,
                                         seed=seed)
    critic = anthropic.Anthropic(base_url=proxy.url, api_key=sub_only["api_key"] + ".critic", max_retries=0)
    critic.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "Judge"}])
    critic.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "Again"}])

    before = call(f"{proxy.url}/rollouts/{with_main['rollout_id']}", key=with_main["api_key"]).body
    for rollout, turns in ((with_main, 3), (sub_only, 2)):
        summary = proxy.close(rollout).body
        stored = proxy.store.query(FACTS_SQL, [rollout["rollout_id"]]).to_pylist()[0]
        assert {k: summary[k] for k in keys} == stored and stored["turns"] == turns
        assert stored["output_tokens"] > 0 and stored["min_policy_version"] is not None
    assert {k: before[k] for k in keys} == proxy.store.query(FACTS_SQL, [with_main["rollout_id"]]).to_pylist()[0]
    assert before["sessions"]["main"]["finish_reason"] == before["finish_reason"]
    closed = proxy.close(proxy.open()).body
    assert {k: closed[k] for k in keys} == {"finish_reason": None, "turns": 0, "output_tokens": 0,
                                            "min_policy_version": None, "max_policy_version": None}
