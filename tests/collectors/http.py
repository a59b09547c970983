"""A few lines of stdlib HTTP for the tests (no client library beyond the project's dependencies)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: Any

    def json(self) -> Any:
        return self.body


def call(method: str, url: str, payload: Any = None, data: bytes | None = None, timeout: float = 120) -> Reply:
    return call_with(method, url, payload, {}, data=data, timeout=timeout)


def call_with(method: str, url: str, payload: Any, headers: dict[str, str], *, data: bytes | None = None,
              timeout: float = 120) -> Reply:
    """`call` with extra headers (their text is sent as Latin-1 bytes, so "\xff" sends the byte 0xff)."""
    if payload is not None:
        data = json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json",
                                                                         **headers})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, headers, raw = r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as err:
        status, headers, raw = err.code, dict(err.headers), err.read()
    return Reply(status, headers, json.loads(raw) if raw else None)


def post(url: str, payload: Any = None, data: bytes | None = None, timeout: float = 120) -> Reply:
    return call("POST", url, payload, data, timeout)


def get(url: str, timeout: float = 60) -> Reply:
    return call("GET", url, timeout=timeout)
