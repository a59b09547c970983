"""The HTTP edge shared by the embedded policy server and the capture proxy: running an aiohttp
application (bound to a port from a running loop, on a background event-loop thread for tests
and notebooks, or in the foreground until Ctrl-C or SIGTERM for the CLI) and reading requests.

Reading a request (`read_json`): bodies over the app's limit are refused (413) before they are
read whole; a body above `DECODE_OFF_LOOP_BYTES` is decoded on a worker thread so the event
loop keeps answering others (`/health` included) while a large prompt is parsed (by orjson,
several times faster than `json`, which reads what orjson refuses: the same values and errors
either way, see `decode_json`); JSON nested too deeply to decode, or text holding a lone UTF-16
surrogate (`"\\ud800"`, valid JSON escapes that are no Unicode text and that no tokenizer or
UTF-8 encoder takes, or such a surrogate's own bytes), is a 400 naming the problem; a client
that disconnects while sending is `ClientGone`, logged in one line, not a traceback. Control routes (`check_control`) take only `application/json` and no cross-site
`Origin`: a browser page on another site can send a "simple" POST (`text/plain`, no preflight)
to a loopback server, but never with a JSON content type.

Every app served by `start_app` (the policy server, the capture proxy, the viewer) answers only
requests whose `Host` names this server (`check_host`): a loopback name or address, the host it
was started with (`--host`), or, bound to every interface (`0.0.0.0`, `::`), any IP address. A
web page whose own name an attacker re-points at 127.0.0.1 (DNS rebinding) reaches the socket
with its own name in `Host` and is refused (421) before any route runs; its `Origin` is refused
for the same reason (`check_origin` does not trust a `Host` it has not checked). Requests
without `Host` (HTTP/1.0 programs; no browser omits it) pass. Bound to a name, the server answers
that name; to be reached under more names than its `--host`, list them in the environment
variable `TRAJSTORE_ALLOWED_HOSTS` (comma-separated).
"""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import json
import os
import re
import signal
import socket
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import orjson
from aiohttp import ClientPayloadError, web

from collectors.errors import CollectorError
from trajstore import JSONText

ALLOWED_HOSTS_ENV = "TRAJSTORE_ALLOWED_HOSTS"
Start = Callable[[], Awaitable[tuple[web.AppRunner, str]]]
DECODE_OFF_LOOP_BYTES = 256 << 10  # smaller bodies decode faster than a hop to a worker thread
# a JSON escape of a UTF-16 surrogate, paired or not, or a surrogate's own UTF-8 bytes (which `json` decodes)
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_WILDCARDS = frozenset({"", "0.0.0.0", "::"})


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


# orjson reads an integer past 64 bits as a float, where `json` keeps it exact: a value holding a float this large
# (one `json` would read as such too, or such an integer) is decoded again by `json`
_BIG = 2.0 ** 63
# `json` refuses nesting deeper than about 1000 levels (its recursion limit, less the caller's stack), orjson only
# past 1024: a value nested this deep is decoded again by `json`, which refuses it or not as it always did
_DEEP = 900


def as_json_reads(value: Any) -> bool:
    """Whether orjson's `value` is what `json` reads from the same body: no float past +-2**63 and no nesting
    `_DEEP` levels deep (a walk of the containers only; their strings are not looked at)."""
    if type(value) is float:
        return -_BIG < value < _BIG
    if type(value) is not dict and type(value) is not list:
        return True
    level, depth = [value], 1  # the containers `depth` levels down, level by level
    while level:
        if depth >= _DEEP:
            return False
        below = []
        for container in level:
            for v in container.values() if type(container) is dict else container:
                kind = type(v)
                if kind is str:  # most values: nothing to look at
                    continue
                if kind is dict or kind is list:
                    below.append(v)
                elif kind is float and not -_BIG < v < _BIG:
                    return False
        level, depth = below, depth + 1
    return True


T = TypeVar("T")


def decode_json(raw: bytes) -> Any:
    """A request body as JSON, or BadRequest saying what is wrong with it.

    orjson decodes what it accepts several times faster than `json`; whatever it refuses (NaN, lone surrogates, a
    byte order mark, UTF-16, invalid JSON) or might read otherwise (integers past 64 bits, nesting `json`
    refuses; `as_json_reads`) is decoded by `json` as before, to its values, errors and messages. orjson accepts
    no lone surrogate, so only `json`'s result needs the walk for one."""
    return _decode(raw)[0]


class BodyText:
    """A request body that is strict JSON (RFC 8259, read by orjson), as its bytes: its text is made only when
    asked (`text()`, once). Making it copies the body twice (decoded, then as a `JSONText`), and a capture proxy
    stores most calls as a delta of the one before, never as their own text."""

    __slots__ = ("_text", "raw")

    def __init__(self, raw: bytes) -> None:
        self.raw, self._text = raw, None

    def __len__(self) -> int:
        """The body's size in bytes."""
        return len(self.raw)

    def text(self) -> JSONText:
        """The body's text, stored as a JSON column as it is, without writing its value again."""
        if self._text is None:
            self._text = JSONText.parsed(self.raw.decode())  # orjson checked the UTF-8 and the JSON
        return self._text


def decode_json_text(raw: bytes) -> tuple[Any, BodyText | None]:
    """`decode_json(raw)`, and the body as `BodyText` when it is strict JSON (None otherwise: NaN, say): a store
    keeps that text as the value's JSON as it is, without writing the value again."""
    value, strict = _decode(raw)
    return value, BodyText(raw) if strict else None


def _decode(raw: bytes) -> tuple[Any, bool]:
    """`decode_json`'s value, and whether orjson read it (the body is strict JSON)."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    else:
        if as_json_reads(value):
            return value, True
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from exc
    except RecursionError:
        raise BadRequest("the request body is JSON nested too deeply to read (hundreds of levels)") from None
    if _SURROGATE.search(raw):  # rare: only then walk the strings
        where = _lone_surrogate(value)
        if where is not None:
            raise BadRequest(f"{where} holds a lone UTF-16 surrogate (an escape such as \\ud800 without its pair), "
                             "which is not Unicode text; send valid UTF-8")
    return value, False


async def read_json(request: web.Request, max_bytes: int) -> Any:
    """The request's JSON body (see the module docstring); BadRequest or ClientGone otherwise."""
    return await _read_decoded(request, max_bytes, decode_json)


async def read_json_text(request: web.Request, max_bytes: int) -> tuple[Any, BodyText | None]:
    """`read_json`, with the body's own text when it is strict JSON (`decode_json_text`)."""
    return await _read_decoded(request, max_bytes, decode_json_text)


async def _read_decoded(request: web.Request, max_bytes: int, decode: Callable[[bytes], T]) -> T:
    raw = await read_body(request, max_bytes)
    if len(raw) > DECODE_OFF_LOOP_BYTES:
        return await asyncio.to_thread(decode, raw)
    return decode(raw)


BODY = web.RequestKey("body", bytes)  # a request's body once `read_body` has read it


async def read_body(request: web.Request, max_bytes: int) -> bytes:
    """The request's body, at most `max_bytes` (BadRequest 413 past it); ClientGone if the client left. Kept as
    `request[BODY]` (the stream is read once).

    The parser's pieces are joined once: aiohttp's `request.read()` joins what is buffered, copies it into a
    bytearray and that into bytes, three copies of a body an agent resends whole on every call (300 kB at 80k
    tokens), each costing more in the caches it evicts than in the copy itself."""
    if BODY in request:
        return request[BODY]
    if request.content_length is not None and request.content_length > max_bytes:
        raise BadRequest(f"the request body is {request.content_length:,} bytes; this server takes at most "
                         f"{max_bytes:,} ({max_bytes >> 20} MiB)", status=413)
    pieces, size = [], 0
    raise_limits = getattr(request.content, "set_read_chunk_size", None)  # aiohttp 3.13+, as its read() does it
    if raise_limits is not None:  # a body the size of the limit buffers without pausing the socket for each piece
        raise_limits(max_bytes)
    try:
        while True:
            piece, _ = await request.content.readchunk()  # (b"", True) at a chunk's end, (b"", False) at the end
            if not piece:
                if request.content.at_eof():
                    break
                continue
            size += len(piece)
            if size > max_bytes:
                raise BadRequest(f"the request body is over {max_bytes:,} bytes ({max_bytes >> 20} MiB), this "
                                 "server's limit", status=413)
            pieces.append(piece)
    except (ConnectionResetError, ClientPayloadError) as exc:
        raise ClientGone(f"the client of {request.method} {request.path} disconnected while sending ({exc})") from exc
    request[BODY] = raw = b"".join(pieces)
    return raw


def header_text(request: web.Request, name: str) -> str | None:
    """Header `name` as text; None when absent or not UTF-8 (aiohttp keeps undecodable bytes as
    surrogate escapes, which no comparison or encoder takes: such a header is no credential)."""
    value = request.headers.get(name)
    if value is None:
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return value


def bearer_token(request: web.Request) -> str | None:
    """The token of `Authorization: Bearer TOKEN` (the scheme in any case, as HTTP says); None when
    there is no such header, it names another scheme, or it is not UTF-8. Every server's
    credential check starts here, so a malformed header is the caller's 401, never a 500."""
    value = header_text(request, "Authorization")
    scheme, _, token = (value or "").strip().partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def check_control(request: web.Request) -> None:
    """A control route's caller must send JSON, and no other site's `Origin` (see the module docstring)."""
    check_origin(request)
    if request.content_type != "application/json":
        raise BadRequest(f"{request.method} {request.path} takes a JSON body with the header Content-Type: "
                         f"application/json (got {request.content_type!r})", status=415)


@dataclass(frozen=True)
class HostRule:
    """Which `Host` names a server answers (see the module docstring): loopback ones, its bound host, those
    listed in `TRAJSTORE_ALLOWED_HOSTS`, and any IP address when bound to every interface."""

    bound: str = "127.0.0.1"
    extra: frozenset[str] = frozenset()

    @classmethod
    def for_bound(cls, host: str) -> HostRule:
        listed = os.environ.get(ALLOWED_HOSTS_ENV, "")
        return cls(_bare(host), frozenset(_bare(n) for n in listed.split(",") if n.strip()))

    def allows(self, name: str) -> bool:
        """Whether `name` (a host without its port) is one of this server's names."""
        name = _bare(name)
        if name == "localhost" or name == self.bound or name in self.extra:
            return True
        try:
            address = ipaddress.ip_address(name)
        except ValueError:
            return False  # a DNS name: only the listed ones (any other may have been re-pointed here)
        return address.is_loopback or self.bound in _WILDCARDS

    def names(self) -> str:
        shown = ["localhost", "127.0.0.1", "[::1]", *sorted({self.bound, *self.extra} - _WILDCARDS - {"localhost"})]
        if self.bound in _WILDCARDS:
            shown.append("any IP address")
        return ", ".join(dict.fromkeys(shown))


def _bare(host: str) -> str:
    """A host name compared as DNS does: lower case, no trailing dot, no IPv6 brackets."""
    return host.strip().strip("[]").rstrip(".").lower()


def _host_of(netloc: str) -> str:
    """The host of a `Host` header or an origin's netloc, without its port."""
    if netloc.startswith("["):
        return netloc[1:netloc.find("]")] if "]" in netloc else netloc
    return netloc.rsplit(":", 1)[0] if netloc.count(":") == 1 else netloc


HOST_RULE = web.AppKey("host_rule", HostRule)


def _rule(request: web.Request) -> HostRule:
    return request.app.get(HOST_RULE) or HostRule()


def check_host(request: web.Request) -> None:
    """Refuse a request for a name that is not this server's (DNS rebinding; see the module docstring)."""
    host = request.headers.get("Host")
    if host is None:
        return  # no browser sends a request without Host
    rule = _rule(request)
    if not rule.allows(_host_of(host)):
        raise BadRequest(f"this server answers requests for {rule.names()} only, not for Host {host[:100]!r} (a web "
                         "page whose name was pointed at this machine is refused); call it by one of those names, "
                         "or start it with --host NAME to serve NAME (more names: "
                         f"{ALLOWED_HOSTS_ENV}=NAME,NAME)", status=421)


def check_origin(request: web.Request) -> None:
    """Refuse a browser request sent from a page of another origin (its `Origin` header names it)."""
    origin = request.headers.get("Origin")
    if origin is None:
        return  # not a browser's cross-site request: SDKs, curl and agents send no Origin
    netloc = urlsplit(origin).netloc.lower()
    if netloc != request.host.lower() or not _rule(request).allows(_host_of(netloc)):
        raise BadRequest(f"requests from web pages of other sites are refused (Origin {origin[:100]!r}); call this "
                         "server from a program, not a browser page", status=403)


@web.middleware
async def _guard(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                 ) -> web.StreamResponse:
    """Host and Origin, checked before any route; inside the app's own error middleware, which renders a
    refusal in the app's error shape."""
    check_host(request)
    check_origin(request)
    return await handler(request)


async def start_app(app: web.Application, host: str = "127.0.0.1", port: int = 0, *,
                    cancel_on_disconnect: bool = False) -> tuple[web.AppRunner, str]:
    """Serve `app` from the running event loop; port 0 takes a free one. Returns (runner, base URL).
    The app answers only requests for this server's names, and from no other site's page (`_guard`).

    `cancel_on_disconnect`: a handler whose caller went away is cancelled (for a stateless app, such
    as the policy server: it stops sampling a request nobody waits for)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    runner = await _start_on(app, host, [sock], cancel_on_disconnect=cancel_on_disconnect)
    return runner, f"http://{f'[{host}]' if ':' in host else host}:{sock.getsockname()[1]}"


async def _start_on(app: web.Application, host: str, socks: Sequence[socket.socket], *,
                    cancel_on_disconnect: bool = False, middlewares: Sequence[Any] = ()) -> web.AppRunner:
    """Serve `app` on sockets already bound to `host` (see `start_app`); `middlewares` run inside the guard."""
    app[HOST_RULE] = HostRule.for_bound(host)
    app.middlewares.append(_guard)  # last: innermost, so the app's own middleware renders a refusal
    app.middlewares.extend(middlewares)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=cancel_on_disconnect)
    await runner.setup()
    for sock in socks:
        await web.SockSite(runner, sock).start()
    return runner


# How long a thread may run Python before another that waits for the GIL gets it (Python's default: 5 ms). A
# server's event loop runs Python nearly all the time under load, while its helper threads (the proxy's commit
# thread woken for a turn or back from an fsync, a render thread back from the tokenizer) need the GIL only
# briefly: at 5 ms each of those can wait that long behind the loop, and the turn's durable commit with it.
# Each switch costs microseconds. `python benchmarks/commit_wait.py --switch-ms 5 0.5` runs the group commit
# beside a busy loop with both.
SWITCH_INTERVAL_S = 0.0005


def serving_process() -> None:
    """Set up this process to serve in the foreground (`run_until_interrupted`, `serve_sockets`): thread switches
    every `SWITCH_INTERVAL_S`."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)


# Container objects made (less those freed) that start a collection of the youngest generation: Python's default
# is 700. A call decodes a body of hundreds to thousands of dicts and lists that live until its answer, so at 700
# the capture proxy collected every two or three calls, walking the bodies in flight each time: 0.25-0.3 ms of
# CPU a call at 8k-80k contexts, over a few hundred collections of ~0.3 ms. At 10,000 a collection comes every
# few hundred calls, a few milliseconds each (`python benchmarks/gc_pause.py` prints both).
YOUNG_COLLECTION_THRESHOLD = 10_000


def settle_heap() -> None:
    """Once a foreground server is up: collect, then move every object alive to the collector's permanent
    generation (`gc.freeze`). A server holds a few hundred thousand objects from its imports (transformers
    brings torch) and its model or tokenizer, none of which become garbage; a full collection walked them all,
    holding the GIL for 0.1-0.3 s whenever it ran while serving (`python benchmarks/gc_pause.py`). Collections
    now walk only what was made since, and the youngest generation is collected after
    `YOUNG_COLLECTION_THRESHOLD` objects, not 700."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, *gc.get_threshold()[1:])


def serve_sockets(app: web.Application, host: str, socks: Sequence[socket.socket], started: Callable[[], None], *,
                  middlewares: Sequence[Any] = ()) -> None:
    """Serve `app` on listening sockets bound to `host` (shared with other processes: a proxy's workers) until
    SIGINT or SIGTERM, calling `started()` once it serves. Further signals during the cleanup are ignored:
    a supervisor's SIGTERM after the terminal's SIGINT must not cut the store's sealing short."""
    serving_process()

    async def main() -> None:
        runner = await _start_on(app, host, socks, middlewares=middlewares)
        settle_heap()
        stop, loop = asyncio.Event(), asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        started()
        await stop.wait()
        await runner.cleanup()

    asyncio.run(main())


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
    serving_process()

    async def main() -> None:
        runner, url = await start()
        settle_heap()
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
