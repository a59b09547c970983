"""Requests stored as deltas (`request_base`, `request_shared`): resolved whole in one pass, in any order; a
missing base is named; the columns are checked at append; a store sealed before them reads, queries and replays."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import trajstore
from trajstore import InvalidEventError
from trajstore.errors import TrajstoreError
from trajstore.events import to_columns
from trajstore.requests import FULL_REQUESTS_SQL, MissingBaseError, full_requests, resolve

OLD_STORE = Path(__file__).parent / "data" / "store_v1_before_teacher"  # sealed before the request delta columns


def turn(event_id: str, request: Any, *, base: str | None = None, shared: int | None = None, session: str = "main",
         turn_index: int = 0, kept: list[str] | None = None) -> trajstore.Turn:
    return trajstore.Turn(event_id=event_id, run="q", group_id="g", rollout_id="r", session_id=session,
                          segment_id="s", turn_index=turn_index, policy_version=0, prompt_ids=[1], output_ids=[2],
                          output_logprobs=[-0.5], request=request, request_base=base, request_shared=shared,
                          request_kept=kept)


# A session: each call's list starts with some prefix of the previous call's full list (rewrites cut it), then
# new items; the delta row keeps the items after the shared prefix, and may leave out members (`tools`, `sys`)
# whose value is the base's full request's, naming them in request_kept.
items = st.one_of(st.integers(-5, 5), st.text(max_size=3), st.dictionaries(st.sampled_from("ab"), st.integers(0, 3)))
members = st.one_of(st.lists(items, max_size=2), st.dictionaries(st.sampled_from("xy"), st.one_of(st.none(), items)))


@st.composite
def chains(draw: st.DrawFn) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    rows, full = [], {}
    sessions: dict[int, tuple[str, dict[str, Any]] | None] = {}
    for n in range(draw(st.integers(1, 25))):
        session = draw(st.integers(0, 2))
        key = "messages" if session != 2 else "input"
        last = sessions.get(session)
        new = draw(st.lists(items, max_size=4))
        body_rest = {"model": "m", "n": n, **{k: last[1][k] if last is not None and draw(st.booleans())
                                               else draw(members) for k in ("tools", "sys")}}
        eid = f"e{n}"
        if last is None or draw(st.booleans()):  # whole: a first call or a rewrite
            body = {**body_rest, key: new}
            rows.append({"event_id": eid, "request": json.dumps(body), "request_base": None, "request_shared": None})
        else:
            base, base_body = last
            shared = draw(st.integers(0, len(base_body[key])))
            body = {**body_rest, key: base_body[key][:shared] + new}
            kept = [k for k in ("tools", "sys") if body[k] == base_body[k] and draw(st.booleans())]
            rows.append({"event_id": eid, "request": json.dumps({**{k: v for k, v in body_rest.items() if k not in kept},
                                                                key: new}),
                         "request_base": base, "request_shared": shared, "request_kept": kept or None})
        full[eid] = body
        sessions[session] = (eid, body)
    return rows, full


@settings(max_examples=150, deadline=None)
@given(chains(), st.randoms(use_true_random=False))
def test_chains_resolve_whole_in_any_order(chain: tuple[list[dict[str, Any]], dict[str, Any]],
                                           rng: random.Random) -> None:
    rows, full = chain
    rng.shuffle(rows)
    got = full_requests(rows)
    assert {k: json.loads(v) for k, v in got.items()} == full
    wanted = [r["event_id"] for r in rows[: len(rows) // 2 + 1]]
    assert {k: json.loads(v) for k, v in full_requests(rows, wanted).items()} == {k: full[k] for k in wanted}


def test_a_whole_request_comes_back_as_stored_text() -> None:
    text = '{"messages": [ {"role": "user"} ],  "model": "m"}'
    assert full_requests([{"event_id": "a", "request": text, "request_base": None, "request_shared": None}]) == {
        "a": text}


def test_a_missing_base_is_named() -> None:
    rows = [{"event_id": "b", "request": '{"messages": [3]}', "request_base": "a", "request_shared": 2}]
    with pytest.raises(MissingBaseError, match="turn b's request extends turn a's"):
        full_requests(rows)


def test_a_cycle_of_links_is_named() -> None:
    rows = [{"event_id": "a", "request": '{"messages": [1]}', "request_base": "b", "request_shared": 0},
            {"event_id": "b", "request": '{"messages": [2]}', "request_base": "a", "request_shared": 0}]
    with pytest.raises(TrajstoreError, match="form a cycle"):
        full_requests(rows)


def test_a_kept_member_the_base_lacks_is_named() -> None:
    rows = [{"event_id": "a", "request": '{"messages": [1]}', "request_base": None, "request_shared": None},
            {"event_id": "b", "request": '{"messages": [2]}', "request_base": "a", "request_shared": 1,
             "request_kept": ["tools"]}]
    with pytest.raises(TrajstoreError, match=r"turn b keeps \['tools'\] of turn a's request, which has no such"):
        full_requests(rows)


def test_a_long_chain_of_kept_members_resolves_without_deep_recursion() -> None:
    rows = [{"event_id": "t0", "request": '{"tools": [{"name": "read"}], "messages": [0]}', "request_base": None,
             "request_shared": None}]
    rows += [{"event_id": f"t{i}", "request": json.dumps({"messages": [i]}), "request_base": f"t{i - 1}",
              "request_shared": i, "request_kept": ["tools"]} for i in range(1, 5000)]
    assert json.loads(full_requests(rows[::-1], ["t4999"])["t4999"]) == {"tools": [{"name": "read"}],
                                                                       "messages": list(range(5000))}


def test_a_long_chain_resolves_without_deep_recursion() -> None:
    rows = [{"event_id": "t0", "request": '{"messages": [0]}', "request_base": None, "request_shared": None}]
    rows += [{"event_id": f"t{i}", "request": json.dumps({"messages": [i]}), "request_base": f"t{i - 1}",
              "request_shared": i} for i in range(1, 5000)]
    assert json.loads(full_requests(rows[::-1], ["t4999"])["t4999"])["messages"] == list(range(5000))


@pytest.mark.parametrize(("fields", "message"), [
    ({"base": "e0"}, "go together"),
    ({"shared": 2}, "go together"),
    ({"base": "e0", "shared": -1}, "request_shared must be an integer"),
    ({"base": "e1", "shared": 1}, "names the turn itself"),
    ({"kept": ["tools"]}, "request_kept belongs to such a delta"),
    ({"base": "e0", "shared": 1, "kept": ["tools", "tools"]}, "distinct member names"),
    ({"base": "e0", "shared": 1, "kept": "tools"}, "distinct member names"),
    ({"base": "e0", "shared": 1, "kept": ["messages"]}, "the conversation list is never kept whole"),
])
def test_bad_delta_columns_are_refused_with_what_is_wrong(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidEventError, match=message):
        to_columns([turn("e1", {"messages": [1]}, **fields)])


def test_resolve_reads_the_sessions_from_the_store(store: trajstore.Store) -> None:
    with store.writer("w") as writer:
        tools = [{"name": "read", "parameters": {"default": None, "a/b~c": [None]}}]  # nulls a merge patch would drop
        writer.append([turn("e0", {"messages": [1, {"role": "user", "content": [{"n": 2**63 + 5}]}], "model": "m",
                                   "tools": tools, "meta": {"k": None}, "x/y~z": {"q": None}}),
                       turn("e1", {"messages": [3], "model": "m", "meta": {"k": None}}, base="e0", shared=2,
                            turn_index=1, kept=["tools", "x/y~z"]),
                       turn("x0", {"messages": ["other"]}, session="side"),
                       turn("e2", {"messages": [4], "model": "n", "choice": None}, base="e1", shared=3, turn_index=2,
                            kept=["tools", "meta", "x/y~z"])])
        for sealed in (False, True):
            full = store.full_requests(["e2", "x0"])
            assert json.loads(full["e2"]) == {"messages": [1, {"role": "user", "content": [{"n": 2**63 + 5}]}, 3, 4],
                                              "model": "n", "tools": tools, "meta": {"k": None}, "choice": None,
                                              "x/y~z": {"q": None}}
            assert json.loads(full["x0"]) == {"messages": ["other"]}
            in_sql = store.query(FULL_REQUESTS_SQL, {"rollout": "r"}).to_pylist()  # the SQL recipe says the same
            assert {r["event_id"]: json.loads(r["request"]) for r in in_sql} == {
                k: json.loads(v) for k, v in resolve(store, ["e0", "e1", "e2", "x0"]).items()}
            if not sealed:
                writer.seal()


def test_a_store_sealed_before_the_columns_reads_queries_and_resolves(tmp_path: Path) -> None:
    shutil.copytree(OLD_STORE, tmp_path / "store")
    store = trajstore.open_store(tmp_path / "store", create=False)
    rows = store.query("SELECT event_id, request, request_base, request_shared FROM turns").to_pylist()
    assert rows and all(r["request_base"] is None and r["request_shared"] is None for r in rows)
    assert resolve(store, [r["event_id"] for r in rows]) == {r["event_id"]: r["request"] for r in rows}
    from collectors.replay import load_episode  # what `trajstore replay` reads

    rollout = store.query("SELECT rollout_id FROM turns LIMIT 1").column("rollout_id")[0].as_py()
    assert load_episode(store, rollout).segments
    store = trajstore.open_store(tmp_path / "store")  # the old store takes delta turns beside its old ones
    with store.writer("new-w") as writer:
        writer.append([turn("n0", {"messages": [1]}), turn("n1", {"messages": [2]}, base="n0", shared=1)])
    store.compact()
    assert store.verify().problems == []
    assert json.loads(resolve(store, ["n1"])["n1"]) == {"messages": [1, 2]}
    assert store.shard(policy_version=0, max_staleness=5, run="old").group_ids == ("g1",)
