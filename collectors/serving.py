"""The HTTP edge shared by the embedded policy server and the capture proxy: running an aiohttp
application (bound to a port from a running loop, on a background event-loop thread for tests
and notebooks, or in the foreground until Ctrl-C or SIGTERM for the CLI) and reading requests.

Reading a request (`read_json`): bodies over the app's limit are refused (413) before they are
read whole; a body above `DECODE_OFF_LOOP_BYTES` is decoded on a worker thread so the event
loop keeps answering others (`/health` included) while a large prompt is parsed; JSON nested
too deeply to decode, or text holding a lone UTF-16 surrogate (`"\\ud800"`, valid JSON escapes
that are no Unicode text and that no tokenizer or UTF-8 encoder takes), is a 400 naming the
problem; a client that disconnects while sending is `ClientGone`, logged in one line, not a
traceback. Control routes (`check_control`) take only `application/json` and no cross-site
`Origin`: a browser page on another site can send a "simple" POST (`text/plain`, no preflight)
to a loopback server, but never with a JSON content type.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

from aiohttp import ClientPayloadError, web

from collectors.errors import CollectorError

Start = Callable[[], Awaitable[tuple[web.AppRunner, str]]]
DECODE_OFF_LOOP_BYTES = 256 << 10  # smaller bodies decode faster than a hop to a worker thread
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # a JSON escape of a UTF-16 surrogate, paired or not


class BadRequest(CollectorError):
    """A request body or header the server refuses; each app renders it in its own error shape."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.status = message, status


class ClientGone(CollectorError):
    """The client disconnected before its request was read; there is nobody to answer."""


def _lone_surrogate(value: Any) -> str | None:
    """The path of the first string holding a lone surrogate, or None (iterative: any depth)."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return where or "the body"
        elif isinstance(v, dict):
            stack.extend((f"{where}.{k}" if where else str(k), x) for k, x in v.items())
            stack.extend((f"{where} (a key)", k) for k in v)
        elif isinstance(v, list):
            stack.extend((f"{where}[{i}]", x) for i, x in enumerate(v))
    return None


def decode_json(raw: bytes) -> Any:
    """A request body as JSON, or BadRequest saying what is wrong with it."""
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from exc
    except RecursionError:
        raise BadRequest("the request body is JSON nested too deeply to read (hundreds of levels)") from None
    if _SURROGATE_ESCAPE.search(raw):  # rare: only then walk the strings
        where = _lone_surrogate(value)
        if where is not None:
            raise BadRequest(f"{where} holds a lone UTF-16 surrogate (an escape such as \\ud800 without its pair), "
                             "which is not Unicode text; send valid UTF-8")
    return value


async def read_json(request: web.Request, max_bytes: int) -> Any:
    """The request's JSON body (see the module docstring); BadRequest or ClientGone otherwise."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise BadRequest(f"the request body is {request.content_length:,} bytes; this server takes at most "
                         f"{max_bytes:,} ({max_bytes >> 20} MiB)", status=413)
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise BadRequest(f"the request body is over {max_bytes:,} bytes ({max_bytes >> 20} MiB), this server's "
                         "limit", status=413) from None
    except (ConnectionResetError, ClientPayloadError) as exc:
        raise ClientGone(f"the client of {request.method} {request.path} disconnected while sending ({exc})") from exc
    if len(raw) > DECODE_OFF_LOOP_BYTES:
        return await asyncio.to_thread(decode_json, raw)
    return decode_json(raw)


def check_control(request: web.Request) -> None:
    """A control route's caller must send JSON, and no other site's `Origin` (see the module docstring)."""
    check_origin(request)
    if request.content_type != "application/json":
        raise BadRequest(f"{request.method} {request.path} takes a JSON body with the header Content-Type: "
                         f"application/json (got {request.content_type!r})", status=415)


def check_origin(request: web.Request) -> None:
    """Refuse a browser request sent from a page of another origin (its `Origin` header names it)."""
    origin = request.headers.get("Origin")
    if origin is None:
        return  # not a browser's cross-site request: SDKs, curl and agents send no Origin
    if urlsplit(origin).netloc.lower() != request.host.lower():
        raise BadRequest(f"requests from web pages of other sites are refused (Origin {origin!r}); call this server "
                         "from a program, not a browser page", status=403)


async def start_app(app: web.Application, host: str = "127.0.0.1", port: int = 0, *,
                    cancel_on_disconnect: bool = False) -> tuple[web.AppRunner, str]:
    """Serve `app` from the running event loop; port 0 takes a free one. Returns (runner, base URL).

    `cancel_on_disconnect`: a handler whose caller went away is cancelled (for a stateless app, such
    as the policy server: it stops sampling a request nobody waits for)."""
    runner = web.AppRunner(app, access_log=None, handler_cancellation=cancel_on_disconnect)
    await runner.setup()
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    await web.SockSite(runner, sock).start()
    return runner, f"http://{f'[{host}]' if ':' in host else host}:{sock.getsockname()[1]}"


@contextmanager
def app_in_thread(start: Start, *, name: str, timeout: float = 60) -> Iterator[tuple[web.AppRunner, str]]:
    """Run `start()` on a new event-loop thread; yields (runner, base URL) and cleans up after."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name=name, daemon=True)
    thread.start()
    try:
        runner, url = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout)
        try:
            yield runner, url
        finally:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=timeout)
        loop.close()


def run_until_interrupted(start: Start, banner: Callable[[web.AppRunner, str], str]) -> None:
    """Serve in the foreground, print `banner(runner, url)`, stop cleanly on Ctrl-C or SIGTERM (`kill PID`):
    the app's cleanup runs either way (the proxy's store writer seals what it appended)."""

    async def main() -> None:
        runner, url = await start()
        stop, loop = asyncio.Event(), asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        print(banner(runner, url), flush=True)
        try:
            await stop.wait()
            print("stopping: finishing the requests in flight", flush=True)
        finally:
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(signum)
            await runner.cleanup()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
