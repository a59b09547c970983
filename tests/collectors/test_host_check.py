"""DNS rebinding (issue 20, item 1): every server answers only requests for its own names.

A page at http://evil.example:PORT whose name the attacker re-points at 127.0.0.1 reaches a
loopback server with `Host: evil.example:PORT` and, being same-origin with itself, may read the
answers. Real servers on loopback (the policy server, a capture proxy, the viewer), raw HTTP
requests with the Host a rebound page would send.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

import trajstore
from collectors.embedded.app import RunningServer
from collectors.serving import ALLOWED_HOSTS_ENV, HostRule
from collectors.viewer import ViewerSettings, viewer_in_thread
from tests.collectors.proxy_harness import Harness


def send(url: str, method: str, path: str, host: str | None, body: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, str]:
    """One request with exactly the Host given (None: the URL's own)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        conn.putrequest(method, path, skip_host=host is not None)
        if host is not None:
            conn.putheader("Host", host)
        for name, value in {"Content-Type": "application/json", **(headers or {})}.items():
            conn.putheader(name, value)
        conn.putheader("Content-Length", str(len(body or b"")))
        conn.endheaders(body)
        reply = conn.getresponse()
        return reply.status, reply.read().decode()
    finally:
        conn.close()


@pytest.fixture(scope="module")
def viewer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    store = tmp_path_factory.mktemp("viewed") / "store"
    trajstore.open_store(store)
    with viewer_in_thread(ViewerSettings(store=str(store), port=0)) as url:
        yield url


def test_a_rebound_host_is_refused_by_every_server(server: RunningServer, proxy: Harness, viewer: str,
                                                   tiny_model: Path) -> None:
    weights = json.dumps({"path": str(tiny_model), "version": 5}).encode()
    calls = [(server.url, "GET", "/health", None), (server.url, "POST", "/v1/load_weights", weights),
             (proxy.url, "GET", "/health", None), (proxy.url, "POST", "/rollouts", b'{"group_id": "rebound"}'),
             (viewer, "GET", "/", None), (viewer, "GET", "/api/runs", None)]
    for url, method, path, body in calls:
        port = urlsplit(url).port
        for host in (f"evil.example:{port}", "evil.example", f"localhost.evil.example:{port}",
                     f"127.0.0.1.nip.io:{port}"):
            status, text = send(url, method, path, host, body, headers={"Origin": f"http://{host}"})
            assert status == 421, (url, path, host, status, text)
            assert "evil.example" in text or "nip.io" in text, text
            assert "--host" in text, text
    assert server.engine.policy_version == 0  # the rebound load_weights never ran
    opened = proxy.store.query("SELECT count(*) AS n FROM events WHERE group_id = 'rebound'").to_pylist()
    assert opened == [{"n": 0}]


def test_loopback_names_are_served(server: RunningServer, proxy: Harness, viewer: str) -> None:
    for url, path in ((server.url, "/health"), (proxy.url, "/health"), (viewer, "/api/runs")):
        port = urlsplit(url).port
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST.:{port}", "127.0.0.2", None):
            status, text = send(url, "GET", path, host)
            assert status == 200, (url, host, text)
    same = send(proxy.url, "POST", "/rollouts", f"localhost:{urlsplit(proxy.url).port}", b"{}",
                headers={"Origin": f"http://localhost:{urlsplit(proxy.url).port}"})
    assert same[0] == 201, same


def test_the_host_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    loopback = HostRule.for_bound("127.0.0.1")
    assert all(map(loopback.allows, ["localhost", "127.0.0.1", "127.3.4.5", "::1", "LocalHost."]))
    assert not any(map(loopback.allows, ["evil.example", "10.0.0.5", "localhost.evil", "0.0.0.0"]))
    named = HostRule.for_bound("gpu-box.internal")
    assert named.allows("gpu-box.internal") and named.allows("GPU-BOX.internal.") and not named.allows("10.0.0.5")
    anywhere = HostRule.for_bound("0.0.0.0")  # every interface: its addresses, never a name
    assert anywhere.allows("10.0.0.5") and anywhere.allows("fe80::1") and not anywhere.allows("gpu-box")
    assert "any IP address" in anywhere.names()
    monkeypatch.setenv(ALLOWED_HOSTS_ENV, "gpu-box, Spare.Example")
    listed = HostRule.for_bound("0.0.0.0")
    assert listed.allows("gpu-box") and listed.allows("spare.example") and not listed.allows("evil.example")
