"""Running an aiohttp application: bound to a port from a running loop, on a background
event-loop thread (tests, notebooks), or in the foreground until interrupted (the CLI).

Shared by the embedded policy server and the capture proxy.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager

from aiohttp import web

Start = Callable[[], Awaitable[tuple[web.AppRunner, str]]]


async def start_app(app: web.Application, host: str = "127.0.0.1", port: int = 0) -> tuple[web.AppRunner, str]:
    """Serve `app` from the running event loop; port 0 takes a free one. Returns (runner, base URL)."""
    runner = web.AppRunner(app, access_log=None)
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
