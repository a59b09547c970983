"""A turn's full request, from a request stored whole or as a delta of an earlier turn's (`request_base`).

An agent resends its whole conversation on every call, so a writer may store a turn's `request` as a delta: the
body with its conversation list cut to the items the previous call did not send. Such a row names, in
`request_base`, the event_id of the same session's earlier turn whose full request it extends, and in
`request_shared` how many leading items of its conversation list are that full request's leading items. Its full
request is its own body with the list `base_full_list[:request_shared] + own_list`. An agent resends its tools
and system prompt on every call too (tens of kB for a coding agent, often more than what the call adds), so a
delta may also leave out top-level members that are the base's full request's, unchanged, and name them in
`request_kept`: the full request then takes those from the base's full request, and its members come in the
base's order (the writer leaves members out only of a body whose members are the base's, in the same order),
any others after them. A row whose columns are null (every turn stored before them, a session's first call, a
rewritten history, every writer but the capture proxy) holds its request whole.

The conversation list is the body's `messages` (OpenAI Chat Completions, Anthropic Messages), or, in a body
without `messages`, its `input` (the OpenAI Responses API): `conversation_key` names it, for writers and readers
alike.

`full_requests` resolves any set of rows, in any order, in one pass: each base's full list is built once
(memoized) and shared by reference, so a session of n turns costs O(n + its items), not O(n^2). `resolve` is the
store-level helper: given event ids, it reads what their chains need through a snapshot's SQL (the turns of
their sessions, which bound every chain) and returns their full requests. `FULL_REQUESTS_SQL` does the same in
DuckDB SQL alone, for one rollout.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import orjson
import pyarrow as pa

from trajstore.errors import TrajstoreError
from trajstore.json_text import json_text
from trajstore.tokens import INT32_MAX

CONVERSATION_KEYS = ("messages", "input")  # the first one a body holds as a list is its conversation list
BASE, SHARED, KEPT = "request_base", "request_shared", "request_kept"


class MissingBaseError(TrajstoreError):
    """A delta request's base turn is not among the rows given (e.g. a query filtered it out)."""


def conversation_key(body: Any) -> str | None:
    """The key of `body`'s conversation list (see the module docstring); None when it has none."""
    if not isinstance(body, dict):
        return None
    for key in CONVERSATION_KEYS:
        if key in body:
            return key if isinstance(body[key], list) else None
    return None


def delta_body(body: dict[str, Any], key: str, shared: int) -> dict[str, Any]:
    """`body` with its conversation list cut to the items after the first `shared` (a shallow copy: the body is
    not changed, and nothing but the new items' references is copied)."""
    return {**body, key: body[key][shared:]}


def delta_problems(rec: Mapping[str, Any]) -> list[str]:
    """request_base and request_shared come together, on a turn whose request holds what the base's extends;
    request_kept only with them, naming distinct members other than the conversation list."""
    base, shared, kept = rec.get(BASE), rec.get(SHARED), rec.get(KEPT)
    if base is None or shared is None:
        return [("request_base and request_shared go together: give both (a request stored as a delta of an "
                 "earlier turn's) or neither (a whole request)")
                + ("; request_kept belongs to such a delta" if kept is not None else "")]
    problems = []
    if kept is not None:
        names = list(kept) if not isinstance(kept, (str, bytes, Mapping)) else None
        if names is None or not all(isinstance(k, str) and k for k in names) or len(set(names)) != len(names):
            problems.append(f"request_kept must be a list of distinct member names, got {kept!r}")
        elif set(names) & set(CONVERSATION_KEYS):
            problems.append(f"request_kept names {sorted(set(names) & set(CONVERSATION_KEYS))}: the conversation list "
                            "is never kept whole (request_shared says how much of it is the base's)")
    if not (type(shared) is int and 0 <= shared <= INT32_MAX):
        problems.append(f"request_shared must be an integer between 0 and {INT32_MAX}, got {shared!r}")
    if rec.get("kind") != "turn" or rec.get("request") is None:
        problems.append("request_base and request_shared belong to a turn with a request (the delta they extend)")
    if base == rec.get("event_id"):
        problems.append("request_base names the turn itself; it must be an earlier turn of the session")
    return problems


def _loads(text: str | bytes | None, event_id: str) -> Any:
    if text is None:
        return None
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:  # NaN, or an integer past 64 bits: the standard library reads what it wrote
        try:
            return json.loads(text)
        except ValueError as exc:
            raise TrajstoreError(f"turn {event_id}: its request is not JSON ({exc})") from exc


def full_requests(rows: Iterable[Mapping[str, Any]], wanted: Iterable[str] | None = None) -> dict[str, str | None]:
    """The full request JSON of each row (or of the `wanted` event ids only), keyed by event_id.

    `rows` carry `event_id`, `request`, `request_base`, `request_shared` and (when any member was left out)
    `request_kept`, in any order; every base a wanted row's chain reaches must be among them, else
    `MissingBaseError` names the turns and the missing ids. A row stored whole comes back as stored (the same
    text)."""
    by_id = {row["event_id"]: row for row in rows}
    ids = list(by_id) if wanted is None else list(wanted)
    absent = [i for i in ids if i not in by_id]
    if absent:
        raise MissingBaseError(f"no turn with event_id {', '.join(absent[:5])} among the rows given")
    lists: dict[str, list[Any]] = {}  # event_id -> its full conversation list (memoized; items shared)
    parsed: dict[str, Any] = {}

    def body_of(event_id: str) -> Any:
        if event_id not in parsed:
            parsed[event_id] = _loads(by_id[event_id]["request"], event_id)
        return parsed[event_id]

    def full_list(event_id: str) -> list[Any]:
        """Iterative: walk the chain up to a resolved or whole turn, then build the lists down (a session of
        thousands of turns needs no deep recursion)."""
        chain: list[str] = []
        seen: set[str] = set()
        at: str | None = event_id
        while at is not None and at not in lists:
            row = by_id.get(at)
            if row is None:
                raise MissingBaseError(
                    f"turn {chain[-1]}'s request extends turn {at}'s (request_base), which is not among the rows "
                    f"read; read the whole session (trajstore.requests.resolve does) to get turn {event_id}'s "
                    "full request")
            if at in seen:
                raise TrajstoreError(f"the request_base links of turns {', '.join(chain)} form a cycle")
            chain.append(at)
            seen.add(at)
            at = row.get(BASE)
        for eid in reversed(chain):
            row, body = by_id[eid], body_of(eid)
            key = conversation_key(body)
            if key is None:
                if row.get(BASE) is not None:
                    raise TrajstoreError(f"turn {eid} is stored as a delta (request_base {row[BASE]}) but its "
                                         "request holds no conversation list (`messages` or `input`)")
                lists[eid] = []
                continue
            base = row.get(BASE)
            if base is None:
                lists[eid] = body[key]
                continue
            shared = row.get(SHARED) or 0
            head = lists[base]
            if shared > len(head):
                raise TrajstoreError(f"turn {eid} shares {shared} items of turn {base}'s conversation, which "
                                     f"holds {len(head)}")
            lists[eid] = head[:shared] + body[key]
        return lists[event_id]

    bodies: dict[str, Any] = {}  # event_id -> its full request as a value, for rows whose members a row keeps

    def full_body(event_id: str) -> Any:
        """A delta row's full request as a value: its list whole, its kept members its base's (iterative, as
        `full_list`: a chain of kept members is as long as its session)."""
        full_list(event_id)  # every base on the chain is there (or MissingBaseError names it)
        chain: list[str] = []
        at = event_id
        while at not in bodies:
            chain.append(at)
            if not by_id[at].get(KEPT):
                break
            at = by_id[at][BASE]
        for eid in reversed(chain):
            row, body = by_id[eid], body_of(eid)
            if row.get(BASE) is None:
                bodies[eid] = body
                continue
            own = {**body, conversation_key(body): full_list(eid)}
            kept = row.get(KEPT)
            if not kept:
                bodies[eid] = own
                continue
            base = bodies[row[BASE]]
            missing = [k for k in kept if not isinstance(base, dict) or k not in base]
            if missing:
                raise TrajstoreError(f"turn {eid} keeps {missing} of turn {row[BASE]}'s request, which has no such "
                                     "member")
            merged = {k: base[k] if k in kept else own[k] for k in base if k in kept or k in own}
            bodies[eid] = {**merged, **{k: v for k, v in own.items() if k not in merged}}
        return bodies[event_id]

    out: dict[str, str | None] = {}
    for event_id in ids:
        row = by_id[event_id]
        if row.get(BASE) is None:
            out[event_id] = row["request"]
            continue
        key = conversation_key(body_of(event_id))
        out[event_id] = json_text(full_body(event_id)) if key is not None else row["request"]
    return out


# The same in SQL, over the `turns` view: every turn of the rollout `$rollout` with its request whole (one
# recursion step per link of the longest chain). Filter by whole rollouts or sessions: a turn whose base is
# filtered out is left out. DuckDB's JSON functions rewrite the text (key order, spacing); the value is the same.
# Each step carries the full list (`items`) and the full request's other members (`rest`): a delta's own, and its
# `request_kept` members from its base's `rest` (picked member by member: a JSON merge patch would drop nulls).
_MEMBER = "'/' || replace(replace(x, '~', '~0'), '/', '~1')"  # member x's JSON pointer
FULL_REQUESTS_SQL = f"""
WITH RECURSIVE t AS (
    SELECT event_id, request, request_base, request_shared, request_kept,
           CASE WHEN json_type(request, '$.messages') = 'ARRAY' THEN 'messages' ELSE 'input' END AS k
    FROM turns WHERE rollout_id = $rollout
), chain(event_id, items, rest) AS (
    SELECT event_id, CAST(json_extract(request, '$.' || k) AS JSON[]), json_merge_patch(request, json_object(k, NULL))
    FROM t WHERE request_base IS NULL
    UNION ALL
    SELECT t.event_id, list_concat(c.items[1:t.request_shared], CAST(json_extract(t.request, '$.' || t.k) AS JSON[])),
           CASE WHEN t.request_kept IS NULL THEN json_merge_patch(t.request, json_object(t.k, NULL))
                ELSE to_json(map_from_entries(list_transform(
                    list_concat(list_filter(json_keys(c.rest), lambda x: list_contains(t.request_kept, x)),
                                list_filter(json_keys(t.request), lambda x: x != t.k)),
                    lambda x: struct_pack(key := x, value := CASE WHEN list_contains(t.request_kept, x)
                        THEN json_extract(c.rest, {_MEMBER}) ELSE json_extract(t.request, {_MEMBER}) END)))) END
    FROM t JOIN chain c ON t.request_base = c.event_id
)
SELECT t.event_id, CASE WHEN t.request_base IS NULL THEN t.request
                        ELSE json_merge_patch(c.rest, json_object(t.k, to_json(c.items))) END AS request
FROM t JOIN chain c USING (event_id)
"""


class Queryable(Protocol):
    """What `resolve` reads through: a `Snapshot` or a `Store` (`query(sql, params)` -> an Arrow table)."""

    def query(self, sql: str, params: Any = None) -> pa.Table:
        ...


_SESSION_ROWS = """
    SELECT t.event_id, t.request, t.request_base, t.request_shared, t.request_kept
    FROM turns t
    JOIN (SELECT DISTINCT rollout_id, session_id FROM turns WHERE list_contains($ids, event_id)) s
      ON t.rollout_id = s.rollout_id AND t.session_id IS NOT DISTINCT FROM s.session_id
"""


def resolve(source: Queryable, event_ids: Sequence[str]) -> dict[str, str | None]:
    """The full request JSON of each of `event_ids` (turns of the `turns` view), read through `source`: one query
    for the turns of their sessions (every base lies in its turn's session), resolved in one pass."""
    if not event_ids:
        return {}
    rows = source.query(_SESSION_ROWS, {"ids": list(event_ids)}).to_pylist()
    return full_requests(rows, event_ids)
