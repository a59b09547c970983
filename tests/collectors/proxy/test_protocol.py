"""The proxy's public constants: a session's API key splits back into the rollout key and the session."""

from __future__ import annotations

import collectors.proxy
from collectors.proxy.protocol import DEFAULT_SESSION, KEY_PREFIX, SESSION_NAME, session_key, split_key


def test_a_session_key_splits_back_into_key_and_session() -> None:
    key = KEY_PREFIX + "0" * 32
    assert split_key(session_key(key, "explorer")) == (key, "explorer")
    assert session_key(key, DEFAULT_SESSION) == key and split_key(key) == (key, None)
    assert SESSION_NAME.match("sub_agent-2") and not SESSION_NAME.match("no spaces")


def test_the_proxy_package_re_exports_what_agents_import() -> None:
    for name in ("SESSION_HEADER", "DEFAULT_SESSION", "KEY_PREFIX", "session_key", "split_key"):
        assert getattr(collectors.proxy, name) is getattr(collectors.proxy.protocol, name)
