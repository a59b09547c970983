"""The capture proxy's rollouts, their API keys and their sessions (in memory). No I/O.

Each rollout opened with `POST /rollouts` gets a fresh secret key `ts-<32 hex>`. A call names
its rollout by that key, in any of three places (the SDKs need nothing else):

    Authorization: Bearer ts-...            (the OpenAI SDK's api_key)
    x-api-key: ts-...                        (the Anthropic SDK's api_key)
    base URL http://proxy/r/ts-.../v1        (the key in the path: for agents that only take a base URL)

Sessions: a rollout's calls belong to session `main` unless they name another one, with a
header `X-Trajstore-Session: NAME` or a key suffix `ts-....NAME` (for agent CLIs that can set
an API key but no headers; the suffix works in the URL prefix too). NAME is 1-64 letters,
digits, `_` or `-`. Each session has its own segment chain; a rollout's calls in one session
are served one at a time, so its turns form a chain (give parallel sub-agents their own
sessions).

Isolation: a key resolves to exactly one rollout; a call whose URL prefix and header name two
different rollouts is refused; a closed rollout's key is refused. Keys live in this process
only: after a restart, open the rollouts again.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field
from typing import Any

from collectors.proxy.body_splice import Last
from collectors.proxy.chat import ChatError
from collectors.proxy.protocol import DEFAULT_SESSION, KEY_PREFIX, SESSION_HEADER, SESSION_NAME, split_key
from collectors.proxy.request_delta import LastRequest
from collectors.proxy.segmenter import SessionState

RENDERS_PER_ROLLOUT = 2  # of a rollout's calls, rendered at once (collectors.proxy.capture)
SHOWN_KEY_CHARS = 4  # of an unknown key, in its 401: it may be a real secret sent to the wrong server
_HOW = ("open a rollout with POST /rollouts and send its api_key (Authorization: Bearer KEY or x-api-key: KEY) "
        "or use its base URL /r/KEY/v1")


@dataclass
class SessionSlot:
    """A session's segmentation state and the lock that serves its calls one at a time."""

    state: SessionState
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_request: LastRequest | None = None  # the previous stored call's conversation, which the next may extend


@dataclass
class TurnTally:
    """What a rollout's stored turns add up to, kept as they are stored: its runner reads them in the
    rollout's summary instead of querying the store."""

    output_tokens: int = 0
    min_version: int | None = None
    max_version: int | None = None
    last_finish: dict[str, str | None] = field(default_factory=dict)  # session -> its last turn's, last used last

    def add(self, session: str, finish_reason: str | None, output_tokens: int, policy_version: int | None) -> None:
        self.output_tokens += output_tokens
        if policy_version is not None:
            self.min_version = policy_version if self.min_version is None else min(self.min_version, policy_version)
            self.max_version = policy_version if self.max_version is None else max(self.max_version, policy_version)
        self.last_finish.pop(session, None)
        self.last_finish[session] = finish_reason

    @property
    def finish_reason(self) -> str | None:
        """Of the rollout's last turn in session `main`, else of its last turn in any session."""
        if DEFAULT_SESSION in self.last_finish:
            return self.last_finish[DEFAULT_SESSION]
        return next(reversed(self.last_finish.values()), None)


@dataclass
class Rollout:
    run: str
    group_id: str
    rollout_id: str
    key: str
    group_size: int | None = None
    meta: dict[str, Any] | None = None
    sessions: dict[str, SessionSlot] = field(default_factory=dict)
    closed: bool = False
    status: str | None = None
    tally: TurnTally = field(default_factory=TurnTally)
    renders: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(RENDERS_PER_ROLLOUT))
    last_bodies: dict[str, Last] = field(default_factory=dict)  # by session: what it keeps of its last request
    # body, which the next is decoded onto (`collectors.proxy.body_splice`)

    def session(self, name: str) -> SessionSlot:
        slot = self.sessions.get(name)
        if slot is None:
            slot = self.sessions[name] = SessionSlot(SessionState(name))
        return slot

    def summary(self) -> dict[str, Any]:
        """The rollout as GET /rollouts/{id} and its close show it: sessions, segments, forks, and what its
        stored turns hold (last finish reason, output tokens, policy versions), exactly as the store has them."""
        states = [slot.state for slot in self.sessions.values()]
        tally = self.tally
        sessions = {s.name: {"segment_id": s.segment_id, "segments": s.segments, "turns": s.turns,
                             "forks": dict(s.forks), "finish_reason": tally.last_finish.get(s.name)} for s in states}
        return {"run": self.run, "group_id": self.group_id, "rollout_id": self.rollout_id, "closed": self.closed,
                "status": self.status, "turns": sum(s.turns for s in states),
                "segments": sum(s.segments for s in states), "forks": sum(sum(s.forks.values()) for s in states),
                "finish_reason": tally.finish_reason, "output_tokens": tally.output_tokens,
                "min_policy_version": tally.min_version, "max_policy_version": tally.max_version,
                "sessions": sessions}


def _unauthorized(message: str) -> ChatError:
    return ChatError(message, status=401, kind="authentication")


class Registry:
    """Open rollouts by key and by id."""

    def __init__(self, key_prefix: str = KEY_PREFIX) -> None:
        self.key_prefix = key_prefix  # a worker of `proxy --workers N` names itself in its keys
        self.by_key: dict[str, Rollout] = {}
        self.by_id: dict[str, Rollout] = {}

    @property
    def open_count(self) -> int:
        return sum(not r.closed for r in self.by_id.values())

    def open(self, *, run: str, group_id: str, rollout_id: str, group_size: int | None,
             meta: dict[str, Any] | None) -> Rollout:
        if rollout_id in self.by_id:
            state = "closed" if self.by_id[rollout_id].closed else "open"
            raise ChatError(f"rollout {rollout_id!r} already exists ({state}); rollout ids are never reused: "
                            "leave rollout_id out to get a fresh one", status=409, kind="conflict", param="rollout_id")
        rollout = Rollout(run=run, group_id=group_id, rollout_id=rollout_id,
                          key=self.key_prefix + secrets.token_hex(16), group_size=group_size, meta=meta)
        self.by_key[rollout.key] = self.by_id[rollout_id] = rollout
        return rollout

    def lookup(self, key: str) -> Rollout:
        rollout = self.by_key.get(key)
        if rollout is None:
            shown = key[:SHOWN_KEY_CHARS] + "..." if len(key) > SHOWN_KEY_CHARS else key  # enough to tell keys apart
            raise _unauthorized(f"unknown API key {shown!r}: this proxy never issued it (or it restarted since); "
                                f"{_HOW}")
        if rollout.closed:
            raise _unauthorized(f"rollout {rollout.rollout_id} is closed (status {rollout.status}); "
                                "its key accepts no more calls: open a new rollout")
        return rollout

    def resolve(self, path_key: str | None, header_keys: list[str], session_header: str | None) -> tuple[Rollout, str]:
        """The rollout and session a call addresses. Raises a 401 ChatError when it addresses none."""
        sources = [path_key] if path_key else []
        sources += [k for k in header_keys if k and (not path_key or k.startswith(KEY_PREFIX))]
        if not sources:
            raise _unauthorized(f"no API key: {_HOW}")
        resolved = [(self.lookup(key), name) for key, name in map(split_key, sources)]
        rollout = resolved[0][0]
        if any(r is not rollout for r, _ in resolved):
            raise _unauthorized("the URL prefix and the API key header name different rollouts; send one rollout's key")
        name = session_header or next((n for _, n in resolved if n), None) or DEFAULT_SESSION
        if not SESSION_NAME.match(name):
            raise ChatError(f"session name {name!r} is not allowed: use 1-64 letters, digits, '_' or '-'",
                            param=SESSION_HEADER)
        return rollout, name
