"""The HTTP edge of both servers, attacked from outside (issue 12, items 2, 3, 4, 11, 12 and 14).

Real servers on loopback (the embedded server and a capture proxy in front of it, each on its
own event-loop thread), real sockets and real SDK-shaped requests: no request, however bad,
fails another request, changes state before it is refused, or gets a 500 or a 502 for what
is the caller's mistake.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import collectors.serving
from collectors.embedded.app import MAX_BODY as SERVER_MAX_BODY
from collectors.embedded.app import RunningServer
from collectors.policy import EmbeddedClient
from collectors.proxy.app import MAX_BODY as PROXY_MAX_BODY
from tests.collectors import http
from tests.collectors.proxy_harness import MODEL, Harness, Recording, call, running_proxy

USER = [{"role": "user", "content": "hi"}]


def complete(server: RunningServer, **body: Any) -> http.Reply:
    return http.post(server.url + "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 8, **body})


# ---------------------------------------------------------------- item 2: one request breaks everyone's

def test_an_out_of_range_field_fails_alone_never_its_batch(server: RunningServer) -> None:
    """top_k = 2^63 used to overflow the batch's tensor: 8 of 8 good requests sharing the batch got 503."""
    with ThreadPoolExecutor(12) as pool:
        good = [pool.submit(complete, server, max_tokens=24, ignore_eos=True, seed=i) for i in range(8)]
        bad = [pool.submit(complete, server, top_k=2**63), pool.submit(complete, server, seed=2**64),
               pool.submit(complete, server, temperature=float("inf")),
               pool.submit(complete, server, top_k=-2)]
        assert [f.result().status for f in good] == [200] * 8
        replies = [f.result() for f in bad]
    assert [r.status for r in replies] == [400] * 4
    assert [r.json()["error"]["param"] for r in replies] == ["top_k", "seed", "temperature", "top_k"]
    assert "an integer from 1 to 2147483647, or 0 / -1" in replies[0].json()["error"]["message"]


@pytest.mark.parametrize(("field", "value"), [("top_k", 2**63), ("seed", 2**70), ("seed", -(2**64)),
                                              ("temperature", 1e309)])
def test_the_proxy_refuses_out_of_range_sampling_itself(proxy: Harness, field: str, value: Any) -> None:
    """Sent upstream, these became the policy server's 400 (or its failed batch) and the proxy's 502."""
    rollout = proxy.open()
    before = len(proxy.upstream.calls)
    data = json.dumps({"model": MODEL, "messages": USER, "max_tokens": 2, field: value}).encode()
    for route in ("/v1/chat/completions", "/v1/messages"):
        r = call(proxy.url + route, data=data, key=rollout["api_key"])
        assert r.status == 400, r.body
        text = json.dumps(r.body)
        assert field in text and "upstream" not in text
    assert len(proxy.upstream.calls) == before  # nothing reached the policy server


# ---------------------------------------------------------------- item 3: a bad close wedges a rollout

@pytest.mark.parametrize("bad", [b'{"status": "completed", "reward": NaN}',
                                 b'{"status": "completed", "reward": Infinity}',
                                 b'{"status": "completed", "rewards": {"": 1.0}}',
                                 b'{"status": "completed", "rewards": {"ok": -Infinity}}',
                                 b'{"status": "finished", "reward": 1.0}', b'{"status": "completed", "error": 7}'])
def test_a_refused_close_changes_nothing_and_a_valid_close_follows(proxy: Harness, bad: bytes) -> None:
    rollout = proxy.open(group_id="wedge-" + str(abs(hash(bad))), group_size=1)
    r = call(f"{proxy.url}/rollouts/{rollout['rollout_id']}/close", data=bad, key=rollout["api_key"])
    assert r.status == 400, r.body
    state = call(f"{proxy.url}/rollouts/{rollout['rollout_id']}", key=rollout["api_key"]).body
    assert (state["closed"], state["status"]) == (False, None)
    assert proxy.close(rollout).status == 200
    row = proxy.store.query("SELECT status, reward, trainable FROM rollouts WHERE rollout_id = ?",
                            [rollout["rollout_id"]]).to_pylist()
    assert row == [{"status": "completed", "reward": 1.0, "trainable": True}]
    group = proxy.store.query("SELECT complete FROM groups WHERE group_id = ?", [rollout["group_id"]]).to_pylist()
    assert group == [{"complete": True}]


# ---------------------------------------------------------------- item 4: rollout ids across processes

def test_a_stored_rollout_cannot_be_opened_again_by_another_proxy(server: RunningServer, tiny_model: Path,
                                                                  tmp_path: Path) -> None:
    store = tmp_path / "store"
    with running_proxy(Recording(EmbeddedClient(server.url)), store, tiny_model, writer="proxy-a") as a:
        first = a.open(rollout_id="r-fixed", group_id="g", group_size=1)
        assert a.close(first, status="completed", reward=1.0).status == 200
        # a second proxy process on the same store (its own writer): the id is taken
        with running_proxy(Recording(EmbeddedClient(server.url)), store, tiny_model, writer="proxy-b") as b:
            again = http.post(b.url + "/rollouts", {"rollout_id": "r-fixed", "group_id": "g"})
            assert again.status == 409 and "already in the store" in again.body["error"]["message"]
            assert b.open(group_id="g2")["rollout_id"] != "r-fixed"  # ids it mints are fresh
    # the same proxy after a restart: sealed now, still taken
    with running_proxy(Recording(EmbeddedClient(server.url)), store, tiny_model, writer="proxy-a") as restarted:
        assert http.post(restarted.url + "/rollouts", {"rollout_id": "r-fixed"}).status == 409
        rows = restarted.store.query("SELECT reward, status FROM rollouts WHERE rollout_id = 'r-fixed'").to_pylist()
    assert rows == [{"reward": 1.0, "status": "completed"}]


# ---------------------------------------------------------------- item 11: large bodies

@pytest.mark.parametrize("target", ["server", "proxy"])
def test_a_body_over_the_limit_is_refused_before_it_is_read(server: RunningServer, proxy: Harness,
                                                            target: str) -> None:
    url, limit = ((server.url + "/v1/completions", SERVER_MAX_BODY) if target == "server" else
                  (proxy.url + "/rollouts", PROXY_MAX_BODY))
    assert limit <= 16 << 20
    r = http.post(url, data=b'{"prompt": "' + b"x" * limit + b'"}')
    assert r.status == 413 and "takes at most" in json.dumps(r.body)


def test_a_chunked_body_over_the_limit_is_refused_as_it_streams_in(server: RunningServer) -> None:
    """Without a Content-Length (chunked transfer encoding) the limit is found while reading: a 413 that says
    so, and the server goes on serving."""
    import http.client as client  # not bound as `http`: this module's `http` is the tests' helper
    import urllib.parse

    where = urllib.parse.urlsplit(server.url)
    conn = client.HTTPConnection(where.hostname, where.port, timeout=60)
    piece = b"x" * (1 << 20)
    body = iter([b'{"prompt": "', *[piece] * (SERVER_MAX_BODY >> 20), b'"}'])  # the limit and 14 bytes: all sent
    try:
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"},
                     encode_chunked=True)
        reply = conn.getresponse()
        assert reply.status == 413 and b"this server's limit" in reply.read()
    finally:
        conn.close()
    assert http.get(server.url + "/health").status == 200


def test_health_answers_while_a_large_body_is_decoded(server: RunningServer, proxy: Harness,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode of a large body is held until /health has answered: on the event loop's thread that
    would deadlock (/health could not be served), on a worker thread both finish."""
    answered = threading.Event()
    decode = collectors.serving.decode_json

    def held(raw: bytes) -> Any:
        if len(raw) > collectors.serving.DECODE_OFF_LOOP_BYTES:
            assert answered.wait(60), "/health was not served while the body was decoded"
        return decode(raw)

    monkeypatch.setattr(collectors.serving, "decode_json", held)
    big = json.dumps({"prompt": "word " * 200_000, "max_tokens": 1}).encode()  # ~1 MB of text
    for url, health in ((server.url + "/v1/completions", server.url + "/health"),
                        (proxy.url + "/rollouts", proxy.url + "/health")):
        answered.clear()
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(http.post, url, None, big)
            while not pending.done():
                if http.get(health, timeout=60).status == 200:
                    answered.set()
                    break
            reply = pending.result()
        assert answered.is_set()
        assert reply.status in (400, 201), reply.body  # the server: too long for the context; the proxy: opened


# ---------------------------------------------------------------- item 12: cross-site control calls

def test_control_routes_take_json_only_and_no_other_sites_origin(server: RunningServer, proxy: Harness,
                                                                 tiny_model: Path) -> None:
    rollout = proxy.open()
    controls = [(proxy.url + "/rollouts", b'{"group_id": "x"}'),
                (f"{proxy.url}/rollouts/{rollout['rollout_id']}/close", b'{"status": "completed", "reward": 1}'),
                (server.url + "/v1/load_weights", json.dumps({"path": str(tiny_model), "version": 99}).encode())]
    for url, data in controls:
        plain = call(url, data=data, key=rollout["api_key"], headers={"Content-Type": "text/plain"})
        assert plain.status == 415 and "application/json" in json.dumps(plain.body), (url, plain.body)
        foreign = call(url, data=data, key=rollout["api_key"], headers={"Origin": "http://evil.example"})
        assert foreign.status == 403 and "other sites" in json.dumps(foreign.body), (url, foreign.body)
    # a chat call from a foreign page is refused too; the same origin is not foreign
    chat = call(proxy.url + "/v1/chat/completions", {"model": MODEL, "messages": USER, "max_tokens": 1},
                key=rollout["api_key"], headers={"Origin": "http://evil.example"})
    assert chat.status == 403
    assert http.get(server.url + "/health").status == 200
    assert server.engine.policy_version == 0  # none of the load_weights calls got through
    same = call(proxy.url + "/rollouts", {"group_id": "y"}, headers={"Origin": proxy.url})
    assert same.status == 201


@pytest.mark.parametrize("version", [2**63, 2**70, -1])
def test_load_weights_refuses_versions_that_cannot_be_stored(server: RunningServer, tiny_model: Path,
                                                             version: int) -> None:
    r = http.post(server.url + "/v1/load_weights", {"path": str(tiny_model), "version": version})
    assert r.status == 400 and r.json()["error"]["param"] == "version"
    assert "from 0 to 9223372036854775807" in r.json()["error"]["message"]
    assert server.engine.policy_version == 0


# ---------------------------------------------------------------- item 14: status classes

SURROGATE = b'"\\ud800 hi"'


@pytest.mark.parametrize(("route", "data", "says"), [
    ("/v1/chat/completions", b'{"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": '
     + SURROGATE + b'}]}', "messages[0].content holds a lone UTF-16 surrogate"),
    ("/v1/messages", b'{"model": "tiny", "max_tokens": 1, "system": [{"type": "text", "text": 5}], '
     b'"messages": [{"role": "user", "content": "hi"}]}', "system[0].text must be a string"),
    ("/v1/messages", b'{"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": '
     b'[{"type": "text", "text": ["a"]}]}]}', "messages[0].content[0].text must be a string"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
     "nested too deeply"),
    ("/rollouts", b'{"group_size": 1000000000000}', "`group_size` must be an integer from 1 to 2147483647"),
    ("/rollouts", b'{"meta": {"note": ' + SURROGATE + b'}}', "meta.note holds a lone UTF-16 surrogate"),
])
def test_the_callers_mistakes_are_400s_not_500s(proxy: Harness, route: str, data: bytes, says: str) -> None:
    rollout = proxy.open()
    r = call(proxy.url + route, data=data, key=rollout["api_key"])
    assert r.status == 400 and says in json.dumps(r.body), r.body


def test_the_server_refuses_a_lone_surrogate_and_deep_json(server: RunningServer) -> None:
    surrogate = http.post(server.url + "/v1/completions", data=b'{"prompt": ' + SURROGATE + b"}")
    assert surrogate.status == 400 and "prompt holds a lone UTF-16 surrogate" in surrogate.json()["error"]["message"]
    deep = http.post(server.url + "/v1/completions", data=b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}")
    assert deep.status == 400 and "nested too deeply" in deep.json()["error"]["message"]
    pair = http.post(server.url + "/v1/completions", data=b'{"prompt": "\\ud83d\\ude00 ok", "max_tokens": 1}')
    assert pair.status == 200  # a surrogate pair is an ordinary character


def test_a_client_that_disconnects_leaves_one_line_in_the_log_not_a_traceback(
        server: RunningServer, proxy: Harness, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    for url, path in ((server.url, "/v1/completions"), (server.url, "/v1/load_weights"), (proxy.url, "/rollouts")):
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock:  # a body promised and never sent
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: 100000\r\n\r\n{{\"prompt\": \"".encode())
            time.sleep(0.2)
    # the proxy reads the body and says so in one line; the policy server cancels a handler whose caller went
    # away (`start_app(cancel_on_disconnect=True)`: nobody waits for its sample), so it has nothing to say
    deadline = time.monotonic() + 30
    while not any("disconnected while sending" in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
        time.sleep(0.1)
    time.sleep(1.0)  # time for any late traceback of the server's cancelled handlers to be logged
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]


@pytest.mark.parametrize("raw", [b'{"a": [1, -2.5e-3, null, true], "b": "na\xc3\xafve \\ud83d\\ude00"}', b'{"a":1,"a":2}',
                                 b'[NaN, -Infinity]', b'1e400', b'[18446744073709551616]', '{"x": 1}'.encode("utf-16"),
                                 b'  {"deep": ' + b"[" * 600 + b"]" * 600 + b"}  "])
def test_a_body_reads_as_the_standard_library_reads_it(raw: bytes) -> None:
    """decode_json reads with orjson and falls back to the standard library for what orjson refuses: either way
    the value is the standard library's."""
    assert collectors.serving.decode_json(raw) == json.loads(raw)


@pytest.mark.parametrize("raw", [b'{"a": "\\ud800"}', b"{", b"[" * 5000 + b"]" * 5000])
def test_a_body_the_standard_library_refuses_is_a_bad_request(raw: bytes) -> None:
    with pytest.raises(collectors.serving.BadRequest):
        collectors.serving.decode_json(raw)
