"""The scope a plain SQL query implies, so that `store.query(sql)` reads only the files that can hold its answer.

A caller that knows its scope passes a `Scope` (runs, a time window, the newest N events). A plain
query names it in SQL instead: `SELECT ... FROM turns WHERE run = 'exp'`. This module reads the
query's syntax tree (DuckDB's own parser, `json_serialize_sql`) and returns the scope only where
narrowing the events changes no answer:

- The query is one SELECT over one relation (one of the views or `events`), with no join, no
  CTE, no set operation and no subquery anywhere: anything else could reach other events.
- `run = 'x'`, `'x' = run`, `run = $param` or `run IN ('x', 'y')` as a top-level AND term of the
  WHERE clause narrows to those runs, on every view: every view's rows of a run are computed
  from that run's events only (groups, advantages and the ledger are per run).
- On `events` alone (where a row is an event, so a window cuts nothing a view would assemble):
  `time >= / > / <= / < / BETWEEN` a timestamp constant narrows the window, and with a WHERE of
  nothing but such terms and a select list of plain columns (no aggregate or window function),
  `ORDER BY time DESC [, event_id] LIMIT n` reads only the newest n events.

Anything it does not recognise leaves the query unscoped (every file read), never wrong. Hand
parsing SQL would be the wrong tool; DuckDB's serializer gives the exact tree the engine binds.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Mapping
from datetime import datetime, timezone
from typing import Any

import duckdb

from trajstore.read import Scope
from trajstore.views import VIEW_NAMES

_local = threading.local()
_RELATIONS = frozenset({"events", *VIEW_NAMES})
_LOWER = {"COMPARE_GREATERTHAN", "COMPARE_GREATERTHANOREQUALTO"}  # column > or >= constant: a lower bound
_UPPER = {"COMPARE_LESSTHAN", "COMPARE_LESSTHANOREQUALTO"}
_FLIP = {"COMPARE_GREATERTHAN": "COMPARE_LESSTHAN", "COMPARE_GREATERTHANOREQUALTO": "COMPARE_LESSTHANOREQUALTO",
         "COMPARE_LESSTHAN": "COMPARE_GREATERTHAN", "COMPARE_LESSTHANOREQUALTO": "COMPARE_GREATERTHANOREQUALTO",
         "COMPARE_EQUAL": "COMPARE_EQUAL"}


def implied_scope(sql: str, params: Any = None) -> Scope | None:
    """The scope `sql` (with its `params`) can be narrowed to without changing its answer; None when none."""
    if not hasattr(_local, "con"):  # a connection of its own per thread: parsing touches no data
        _local.con = duckdb.connect()
    try:
        tree = json.loads(_local.con.execute("SELECT json_serialize_sql($sql)", {"sql": sql}).fetchone()[0])
    except (duckdb.Error, TypeError, ValueError):
        return None
    if tree.get("error") or len(tree.get("statements", ())) != 1:
        return None
    node = tree["statements"][0]["node"]
    if node.get("type") != "SELECT_NODE" or node.get("cte_map", {}).get("map") or _has_subquery(node):
        return None
    source = node.get("from_table") or {}
    relation = str(source.get("table_name", "")).lower()
    if source.get("type") != "BASE_TABLE" or source.get("schema_name") or relation not in _RELATIONS:
        return None
    names = {relation, str(source.get("alias", "")).lower()} - {""}
    values = params if isinstance(params, Mapping) else {}
    runs: set[str] = set()
    since = until = None
    other_terms = False
    for term in _and_terms(node.get("where_clause")):
        found = _runs(term, names, values)
        if found is not None:
            runs = found if not runs else runs & found
            if not runs:  # run = 'a' AND run = 'b': nothing; scope to a run no file holds
                return Scope(runs=("",))
            continue
        bounds = _time_bounds(term, names, values) if relation == "events" else None
        if bounds is not None:
            lo, hi = bounds
            since = lo if since is None or (lo is not None and lo > since) else since
            until = hi if until is None or (hi is not None and hi < until) else until
            continue
        other_terms = True
    newest = None
    if (relation == "events" and not other_terms and not node.get("group_expressions") and not node.get("having")
            and not node.get("qualify") and all(_plain(e) for e in node.get("select_list", ()))):
        newest = _newest(node.get("modifiers", ()), names, values)
    if not runs and since is None and until is None and newest is None:
        return None
    return Scope(runs=tuple(sorted(runs)), since=since, until=until, newest=newest)


def _plain(expr: Any) -> bool:
    """A select-list entry computed from its own row only (no aggregate or window over other rows)."""
    if isinstance(expr, dict):
        if expr.get("class") in ("FUNCTION", "WINDOW", "AGGREGATE"):
            return False
        return all(_plain(v) for v in expr.values())
    if isinstance(expr, list):
        return all(_plain(v) for v in expr)
    return True


def _has_subquery(tree: Any) -> bool:
    if isinstance(tree, dict):
        if tree.get("class") == "SUBQUERY" or tree.get("type") in ("SUBQUERY", "JOIN", "TABLE_FUNCTION"):
            return True
        return any(_has_subquery(v) for v in tree.values())
    if isinstance(tree, list):
        return any(_has_subquery(v) for v in tree)
    return False


def _and_terms(expr: Any) -> Iterator[dict[str, Any]]:
    if not expr:
        return
    if expr.get("type") == "CONJUNCTION_AND":
        for child in expr.get("children", ()):
            yield from _and_terms(child)
    else:
        yield expr


def _is_column(expr: Any, column: str, names: set[str]) -> bool:
    if not isinstance(expr, dict) or expr.get("class") != "COLUMN_REF":
        return False
    parts = [str(p).lower() for p in expr.get("column_names", ())]
    return parts[-1:] == [column] and (len(parts) == 1 or (len(parts) == 2 and parts[0] in names))


def _constant(expr: Any, params: Mapping[str, Any]) -> tuple[bool, Any]:
    """(known, value) of a constant, a named parameter, or a cast of either to a timestamp."""
    if not isinstance(expr, dict):
        return False, None
    if expr.get("class") == "CONSTANT":
        literal = expr.get("value") or expr.get("literal") or {}
        if literal.get("is_null"):
            return False, None
        text = literal.get("text", literal.get("value"))
        kind = str(literal.get("kind", "")).upper()
        return (True, text) if kind in ("STRING", "VARCHAR") else (False, None)
    if expr.get("class") == "PARAMETER":
        name = str(expr.get("identifier", ""))
        return (name in params, params.get(name))
    if expr.get("class") == "CAST" and not expr.get("try_cast"):
        target = str((expr.get("type_expr") or {}).get("type_name") or (expr.get("cast_type") or {}).get("id", ""))
        if target.upper() in ("TIMESTAMP", "TIMESTAMPTZ", "TIMESTAMP WITH TIME ZONE", "TIMESTAMP_US"):
            return _constant(expr.get("child"), params)
    return False, None


def _runs(term: dict[str, Any], names: set[str], params: Mapping[str, Any]) -> set[str] | None:
    if term.get("type") == "COMPARE_EQUAL":
        left, right = term.get("left"), term.get("right")
        if _is_column(right, "run", names):
            left, right = right, left
        known, value = _constant(right, params)
        if _is_column(left, "run", names) and known and isinstance(value, str):
            return {value}
    if term.get("type") == "COMPARE_IN":
        children = term.get("children", ())
        if children and _is_column(children[0], "run", names):
            found = [_constant(c, params) for c in children[1:]]
            if found and all(k and isinstance(v, str) for k, v in found):
                return {v for _, v in found}
    return None


def _time(value: Any) -> datetime | None:
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=timezone.utc)
    if isinstance(value, str):
        try:
            parsed = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
        except ValueError:
            return None
        return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)
    return None


def _time_bounds(term: dict[str, Any], names: set[str],
                 params: Mapping[str, Any]) -> tuple[datetime | None, datetime | None] | None:
    kind = term.get("type")
    if kind == "COMPARE_BETWEEN" and _is_column(term.get("input"), "time", names):
        lo, hi = (_time(_constant(term.get(side), params)[1]) for side in ("lower", "upper"))
        return (lo, hi) if lo is not None and hi is not None else None
    if kind not in _FLIP or kind == "COMPARE_EQUAL":
        return None
    left, right = term.get("left"), term.get("right")
    if _is_column(right, "time", names):
        left, right, kind = right, left, _FLIP[kind]
    if not _is_column(left, "time", names):
        return None
    at = _time(_constant(right, params)[1])
    if at is None:
        return None
    return (at, None) if kind in _LOWER else (None, at)


def _newest(modifiers: Any, names: set[str], params: Mapping[str, Any]) -> int | None:
    """n of `ORDER BY time DESC LIMIT n` (no offset, nothing else ordered before time)."""
    order = limit = None
    for m in modifiers or ():
        if m.get("type") == "ORDER_MODIFIER":
            order = m.get("orders") or []
        elif m.get("type") == "LIMIT_MODIFIER":
            limit = m
        else:
            return None
    if not order or limit is None or limit.get("offset"):
        return None
    # time DESC alone, or then event_id ASC: the scope keeps the newest n with ties broken by event_id
    first, rest = order[0], order[1:]
    if first.get("type") != "DESCENDING" or not _is_column(first.get("expression"), "time", names):
        return None
    if rest and (len(rest) > 1 or rest[0].get("type") not in ("ASCENDING", "ORDER_DEFAULT")
                 or not _is_column(rest[0].get("expression"), "event_id", names)):
        return None
    value = limit.get("limit") or {}
    literal = value.get("value") or value.get("literal") or {}
    if value.get("class") == "PARAMETER":
        n = params.get(str(value.get("identifier", "")))
    else:
        n = literal.get("text", literal.get("value"))
    try:
        count = int(n)
    except (TypeError, ValueError):
        return None
    return count if count > 0 else None
