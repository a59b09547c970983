"""`Http` over kept-alive connections (`collectors.policy.connections`) against real loopback servers.

Each answer must be read whole whatever its framing (length, chunks, close), belong to its own
request (a cancelled or failed request never leaves its answer for the next one on the same
connection), and a connection the server closes is replaced.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from aiohttp import web

from collectors.policy.http import Http, PolicyServerTimeout


@asynccontextmanager
async def server(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def client_of(app: web.Application) -> AsyncIterator[Http]:
    """An `Http` client of `app` served on loopback, closed afterwards."""
    async with server(app) as url:
        client = http(url)
        try:
            yield client
        finally:
            await client.close()


def http(url: str) -> Http:
    return Http(url, hint="(test)", timeout_s=5, connect_retries=0, retry_backoff_s=0.01, max_connections=0)


def echo_app(peers: list[object]) -> web.Application:
    async def echo(request: web.Request) -> web.StreamResponse:
        peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        delay = float(request.query.get("delay", 0))
        await asyncio.sleep(delay)
        body = await request.read()
        said = {"path": request.path, "query": dict(request.query), "body": body.decode(),
                "session": request.headers.get("X-Session-ID")}
        if request.query.get("chunked"):
            resp = web.StreamResponse()
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            for part in (b'{"path": "', request.path.encode(), b'", "chunked": true}'):
                await resp.write(part)
            await resp.write_eof()
            return resp
        headers = {"Connection": "close"} if request.query.get("close") else None
        return web.json_response(said, headers=headers)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", echo)
    return app


def test_answers_of_every_framing_are_read_whole_and_connections_are_kept() -> None:
    async def scenario() -> None:
        peers: list[object] = []
        async with client_of(echo_app(peers)) as client:
            for i in range(3):
                reply = await client.call("POST", "/v1/x", body={"i": i}, headers={"X-Session-ID": f"s{i}"})
                assert client.json(reply, "/v1/x") == {"path": "/v1/x", "query": {}, "body": f'{{"i":{i}}}',
                                                      "session": f"s{i}"}
            assert len(set(peers)) == 1  # one kept connection served all three
            chunked = await client.call("GET", "/c", params={"chunked": "1"})
            assert client.json(chunked, "/c") == {"path": "/c", "chunked": True}
            closed = await client.call("GET", "/d", params={"close": "1", "a": "b c"})
            assert client.json(closed, "/d")["query"] == {"close": "1", "a": "b c"}
            again = await client.call("GET", "/e")  # the server closed the last one: a new connection
            assert client.json(again, "/e")["path"] == "/e" and len(set(peers)) == 2
    asyncio.run(scenario())


def test_a_cancelled_or_timed_out_request_never_leaves_its_answer_to_the_next() -> None:
    async def scenario() -> None:
        async with client_of(echo_app([])) as client:
            slow = asyncio.ensure_future(client.call("POST", "/slow", params={"delay": "0.3"}, body={"n": 1}))
            await asyncio.sleep(0.1)
            slow.cancel()
            with pytest.raises(asyncio.CancelledError):
                await slow
            with pytest.raises(PolicyServerTimeout, match="did not answer POST /late"):
                await client.call("POST", "/late", params={"delay": "0.5"}, body={"n": 2}, timeout_s=0.1)
            await asyncio.sleep(0.6)  # both late answers have been written by now, to closed connections
            reply = await client.call("POST", "/next", body={"n": 3})
            assert client.json(reply, "/next")["path"] == "/next"
    asyncio.run(scenario())


def test_a_header_with_a_line_break_is_refused_before_anything_is_sent() -> None:
    async def scenario() -> None:
        peers: list[object] = []
        async with client_of(echo_app(peers)) as client:
            with pytest.raises(ValueError, match="line break"):
                await client.call("POST", "/x", body={}, headers={"X-Session-ID": "a\r\nX-Evil: 1"})
            assert peers == []
    asyncio.run(scenario())


def test_one_client_serves_calls_from_one_event_loop_after_another() -> None:
    client_box: list[Http] = []

    async def scenario(url: str) -> None:
        client = client_box[0]
        reply = await client.call("GET", "/ok")
        assert client.json(reply, "/ok")["path"] == "/ok"

    async def both() -> None:
        async with server(echo_app([])) as url:
            client_box.append(http(url))
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, lambda: asyncio.run(scenario(url)))  # another loop, another thread
            await scenario(url)  # this loop: its own connections
            await client_box[0].close()
    asyncio.run(both())
