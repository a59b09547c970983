"""A turn's `request` as stored: the agent's body whole, or a delta of its session's previous call's.

An agent resends its whole conversation on every call, so storing each body whole makes a session's requests
grow with the square of its length (a 40-call session reaching 80k tokens: ~12 MB of JSON). When a call's
conversation list (its wire protocol's `conversation` field: `messages`, or the Responses API's `input`) starts
with items of the list the session's previous stored call sent, equal as parsed JSON, the turn stores the body
with the list cut after them, `request_base` (the previous turn's event_id) and `request_shared` (how many
items it shares); `trajstore.requests` puts the full request back together. It shares every item but the new
ones, usually; an agent that changes its latest items shares all but those, which the delta holds again
(Claude Code moves its prompt-cache breakpoint, `cache_control`, to its newest message on every call).

An agent also resends its tools and system prompt on every call (a coding agent's are tens of kB, more than most
calls add), so the delta leaves out every member the previous call sent with the same value, when that value is
an array, an object or a text of at least `KEPT_TEXT_CHARS` characters, and names those members in
`request_kept` (only for a body whose members are the previous body's, in the same order, so the full request is
put back in the order it was sent). The numbers and short texts (`model`, `max_tokens`, `temperature`) stay in
each row, where SQL over `request` reads them.

Stored whole: the session's first call, a list that shares less than half of the previous one (a history the
agent rewrote or compacted near its start: a delta would hold most of it again), another protocol, a body that
is not a JSON object or not strict JSON, and every call when the proxy runs with `--whole-requests`. So is a call
whose body grew by more than `WHOLE_ABOVE_BYTES` since the previous one (an agent pasting megabytes into a new
message): its text is stored as it came, where writing the new part as JSON again would hold the event loop (and
the GIL) for milliseconds per megabyte; the next call is a delta of it.

The session keeps the previous call's decoded body by reference (never a copy) and its event_id. The prefix check
is one `==` of list slices in C, and a repeated member is usually the very object the previous body held (the body
is decoded onto the last one: `collectors.proxy.body_splice`), so its check is an identity; the delta is a shallow
copy of the body written by orjson, so what a turn costs to store grows with what it added, not with the
conversation or the tools.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from collectors.proxy.chat import ChatRequest
from trajstore.json_text import JSONText
from trajstore.requests import conversation_key, delta_body

WHOLE_ABOVE_BYTES = 1 << 20  # a body this much larger than the previous call's is stored as its own text
KEPT_TEXT_CHARS = 1024  # a repeated text member this long is left out of a delta (and named in request_kept)


@dataclass(frozen=True)
class LastRequest:
    """What a session's previous stored call sent: its protocol, its conversation list (the decoded body's own
    list object), its turn's event_id, its body's size in bytes and the decoded body itself."""

    protocol: str
    items: list[Any]
    event_id: str
    size: int = 0
    body: dict[str, Any] | None = None


@dataclass(frozen=True)
class StoredRequest:
    """A turn's `request`, `request_base` and `request_shared` columns, and what the session keeps for its next
    call (None: nothing to extend)."""

    request: Any
    base: str | None
    shared: int | None
    last: LastRequest | None
    kept: list[str] | None = None

    def columns(self) -> dict[str, Any]:
        return {"request": self.request, "request_base": self.base, "request_shared": self.shared,
                "request_kept": self.kept}


def stored_request(body: Any, req: ChatRequest, protocol: str, field: str, event_id: str,
                   last: LastRequest | None, *, whole: bool = False) -> StoredRequest:
    """The turn `event_id`'s request columns for a call of `protocol` (whose conversation list is `field`) sent
    as `body` (decoded; `req.body_json` its bytes), given what the session's previous stored call sent. The
    body's own text is made only when it is stored whole."""
    if req.body_json is None:  # not strict JSON (NaN, say): stored as its value, and nothing to extend
        return StoredRequest(body, None, None, None)
    items = body.get(field) if isinstance(body, dict) and conversation_key(body) == field else None
    if not isinstance(items, list):  # the reader could not tell which list was cut: whole, and nothing to extend
        return StoredRequest(req.body_json.text(), None, None, None)
    mine = LastRequest(protocol, items, event_id, len(req.body_json), body)
    if whole or last is None or last.protocol != protocol or len(req.body_json) - last.size > WHOLE_ABOVE_BYTES:
        return StoredRequest(req.body_json.text(), None, None, mine)
    shared = _shared(items, last.items)
    if not shared or 2 * shared < len(last.items):  # rewritten near its start: a delta would hold most of it again
        return StoredRequest(req.body_json.text(), None, None, mine)
    kept = _kept(body, last.body, field)
    delta = delta_body(body, field, shared)
    # orjson read the body (strict JSON), so it writes any part of it back as the same value
    text = JSONText.parsed(orjson.dumps({k: v for k, v in delta.items() if k not in kept} if kept else delta).decode())
    return StoredRequest(text, last.event_id, shared, mine, kept or None)


def _shared(items: list[Any], before: list[Any]) -> int:
    """How many leading items `items` has in common with `before`, the previous call's list. Usually all of them
    (one comparison in C, element by element, mostly of the very same objects); Claude Code moves its prompt-cache
    breakpoint (`cache_control`) to its newest message on every call, which changes the previous call's last one."""
    n = len(before)
    if len(items) >= n and items[:n] == before:
        return n
    if len(items) >= n - 1 > 0 and items[:n - 1] == before[:n - 1]:
        return n - 1
    return next((i for i, (a, b) in enumerate(zip(items, before)) if a is not b and a != b), min(len(items), n))


def _kept(body: dict[str, Any], before: dict[str, Any] | None, field: str) -> list[str]:
    """The members of `body` a delta leaves out: sent by the previous call `before` with the same value, an array,
    an object or a long text (none unless `body` has `before`'s members in `before`'s order)."""
    if before is None or len(body) != len(before) or list(body) != list(before):
        return []
    return [k for k, v in body.items() if k != field and (
        isinstance(v, (list, dict)) or (isinstance(v, str) and len(v) >= KEPT_TEXT_CHARS))
        and (v is before[k] or v == before[k])]
