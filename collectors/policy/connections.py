"""Plain HTTP/1.1 requests to one policy server over kept-alive connections: the completions hop, made cheap.

aiohttp's client spends about 0.3 ms of CPU per request on its own machinery (request and
response objects, header multidicts, URL handling, cookie jar, timers), as much as everything
else the proxy does to forward a call; a request written straight onto an asyncio stream and
its answer read back costs a third of that. `Connections` does only that: one request at a time
per connection, the head written and the body handed to the transport as it is (never
copied), the answer read by its Content-Length (or its chunks, or until the server closes), the
connection kept for the next request unless either side said `Connection: close`.

Failures are plain exceptions the caller names (`collectors.policy.http.Http`): `ConnectFailed`
(nothing was sent), `Disconnected` (the server closed the connection before answering in
full; on a kept connection that is usually one the server closed while idle), `Malformed`
(not HTTP/1 as this reads it), TimeoutError.
A request that fails or is cancelled midway closes its connection: it is never reused.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from multidict import CIMultiDict

from collectors.errors import CollectorError

HEAD_LIMIT = 1 << 20  # the most bytes of status line and headers an answer may have


class ConnectFailed(CollectorError):
    """No connection could be opened (nothing was sent); `os_error` says why."""

    def __init__(self, os_error: OSError) -> None:
        super().__init__(str(os_error))
        self.os_error = os_error


class Disconnected(CollectorError):
    """The server closed the connection before its answer was complete."""


class Malformed(CollectorError):
    """The answer is not HTTP/1.1 this client reads (a bad status line, length or chunk size)."""


class _Conn:
    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def close(self) -> None:
        self.writer.close()


class Connections:
    """Kept-alive HTTP/1.1 connections to `host:port` (named `host_header` in requests); `limit` > 0 caps how
    many are open at once. Bound to the event loop it is first used in."""

    def __init__(self, host: str, port: int, host_header: str, limit: int = 0) -> None:
        self.host, self.port = host, port
        self._host_header = b"Host: %s\r\n" % host_header.encode("ascii" if host_header.isascii() else "idna")
        self._idle: list[_Conn] = []
        self._slots = asyncio.Semaphore(limit) if limit > 0 else None

    async def request(self, method: str, target: str, headers: Mapping[str, str] | None, body: bytes | None
                      ) -> tuple[int, CIMultiDict[str], bytes]:
        """Send one request; returns the answer's (status, headers, body)."""
        if self._slots is None:
            return await self._request(method, target, headers, body)
        async with self._slots:
            return await self._request(method, target, headers, body)

    async def _request(self, method: str, target: str, headers: Mapping[str, str] | None, body: bytes | None
                       ) -> tuple[int, CIMultiDict[str], bytes]:
        head = self._head(method, target, headers, body)
        conn = self._kept() or await self._open()
        try:
            conn.writer.write(head)
            if body:
                conn.writer.write(body)
            status, head, data, keep = await self._answer(conn.reader)
        except BaseException as exc:
            conn.close()  # midway: what is left on it is unknown
            if isinstance(exc, (ConnectionError, asyncio.IncompleteReadError)):
                raise Disconnected(str(exc) or type(exc).__name__) from exc
            if isinstance(exc, (ValueError, asyncio.LimitOverrunError)):
                raise Malformed(str(exc)) from exc
            raise
        if keep:
            self._idle.append(conn)
        else:
            conn.close()
        return status, head, data

    def _kept(self) -> _Conn | None:
        while self._idle:
            conn = self._idle.pop()
            if not conn.reader.at_eof() and not conn.writer.is_closing():
                return conn
            conn.close()  # the server closed it while idle
        return None

    async def _open(self) -> _Conn:
        try:
            reader, writer = await asyncio.open_connection(self.host, self.port, limit=HEAD_LIMIT)
        except OSError as exc:
            raise ConnectFailed(exc) from exc
        return _Conn(reader, writer)

    def _head(self, method: str, target: str, headers: Mapping[str, str] | None, body: bytes | None) -> bytes:
        lines = [f"{method} {target} HTTP/1.1\r\n".encode(), self._host_header]
        if body is not None:
            lines.append(b"Content-Length: %d\r\n" % len(body))
        for name, value in (headers or {}).items():
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
                raise ValueError(f"header {name!r} holds a line break or its name a colon; it cannot be sent")
            lines.append(f"{name}: {value}\r\n".encode())
        lines.append(b"\r\n")
        return b"".join(lines)

    @staticmethod
    async def _answer(reader: asyncio.StreamReader) -> tuple[int, CIMultiDict[str], bytes, bool]:
        while True:
            raw = await reader.readuntil(b"\r\n\r\n")
            lines = raw[:-4].decode("latin-1").split("\r\n")
            version, _, rest = lines[0].partition(" ")
            if not (version.startswith("HTTP/1.") and rest[:3].isdigit()):
                raise ValueError(f"the answer does not start with an HTTP/1 status line: {lines[0][:100]!r}")
            status = int(rest[:3])
            if status >= 200 or status == 101:
                break  # 1xx (100 Continue): informational, the answer follows
        head: CIMultiDict[str] = CIMultiDict()
        for line in lines[1:]:
            name, _, value = line.partition(":")
            head.add(name.strip(), value.strip())
        connection = head.get("Connection", "").lower()
        keep = "close" not in connection and (version != "HTTP/1.0" or "keep-alive" in connection)
        if status in (204, 304) or 100 <= status < 200:
            return status, head, b"", keep
        if "chunked" in head.get("Transfer-Encoding", "").lower():
            parts = []
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0].strip(), 16)
                if size == 0:
                    while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, if any
                        pass
                    return status, head, b"".join(parts), keep
                parts.append(await reader.readexactly(size))
                await reader.readexactly(2)
        length = head.get("Content-Length")
        if length is not None:
            return status, head, await reader.readexactly(int(length)), keep
        return status, head, await reader.read(), False  # delimited by the server closing the connection

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()
