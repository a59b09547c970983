"""What an agent says to the capture proxy beyond the chat APIs: its rollout key and its session. Pure.

The proxy's public constants, in one small module agents may import:

    Authorization: Bearer ts-KEY   or   x-api-key: ts-KEY   or   base URL .../r/ts-KEY/v1
    X-Trajstore-Session: NAME      or   the key suffix ts-KEY.NAME

A call without a session name belongs to session `main`. NAME is 1-64 letters, digits, `_` or `-`.
"""

from __future__ import annotations

import re

KEY_PREFIX = "ts-"
SESSION_HEADER = "X-Trajstore-Session"
DEFAULT_SESSION = "main"
SESSION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_SESSION_SEPARATOR = "."


def session_key(key: str, session: str) -> str:
    """The API key that names `session` of the rollout `key` (for agents that can set a key but no header)."""
    return key if session == DEFAULT_SESSION else f"{key}{_SESSION_SEPARATOR}{session}"


def split_key(value: str) -> tuple[str, str | None]:
    """`ts-KEY.NAME` -> (`ts-KEY`, NAME); a key without a suffix -> (key, None)."""
    key, _, name = value.partition(_SESSION_SEPARATOR)
    return key, (name or None)
