"""`trajstore proxy --workers N`: the capture proxy on N processes, each rollout pinned to one of them.

A session's held tokens, its lock and its segment chain live in the process that serves it, so a
rollout belongs to one worker for its whole life. Dispatch:

- one listening address for clients (`--host`/`--port`): every worker accepts on that one
  socket (bound by the supervisor and inherited), so any worker may take any connection;
- `POST /rollouts` opens the rollout on the worker with the fewest open rollouts (a shared
  board each worker writes its own count to); its key names that worker and its start
  (`ts-w<index>g<generation>-<32 hex>`), and its base URLs point at that worker's own port, so
  the agent's calls go straight to the process holding its session: no hop;
- a call with a key of another worker, on the shared address (an agent that kept the shared
  base URL and sends only the key), is forwarded to the owner over loopback and its answer
  streamed back, so it is served exactly as on the owner's own port, at the cost of one hop;
- `GET /stats` merges every worker's counters (durable waits included); `GET /health` lists
  each worker (pid, port, start count, up or down); `POST /seal` seals every worker's log. `?local=1`
  answers for one worker alone.

One writer per process (`--writer NAME` becomes `NAME-w<index>`). A worker that dies is started
again on the same ports: what it acknowledged is durable (its turns were fsync'd before they
were answered, and its successor seals them), and its rollouts are gone, so their keys are
refused with a 401 that says to open the rollout again; the other workers' sessions go on.
A worker that dies before it ever served stops the whole proxy (a bad store or model fails once,
not in a loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import mmap
import os
import re
import signal
import socket
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from collectors.policy import PolicyClient
from collectors.proxy.chat import ChatError
from collectors.proxy.protocol import KEY_PREFIX, split_key
from collectors.proxy.waits import percentile_ms
from collectors.serving import check_control

log = logging.getLogger(__name__)
WORKER_KEY = re.compile(rf"^{re.escape(KEY_PREFIX)}w(\d+)g(\d+)-")
HOP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "upgrade",
                         "proxy-connection", "te", "trailer"})  # `Host` goes along: base URLs are built from it
PEER_TIMEOUT_S = 2.0  # a worker that cannot answer /health or /stats in this long is shown as down


def worker_key_prefix(index: int, generation: int) -> str:
    """The start of every key worker `index` issues in its `generation`-th start."""
    return f"{KEY_PREFIX}w{index}g{generation}-"


def key_owner(key: str) -> tuple[int, int] | None:
    """(worker index, generation) a key was issued by; None for a key of no worker (a one-process proxy's)."""
    match = WORKER_KEY.match(split_key(key)[0])
    return (int(match.group(1)), int(match.group(2))) if match else None


class LoadBoard:
    """Open rollouts per worker, in memory shared by the workers: each writes only its own slot."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._mem = mmap.mmap(-1, 8 * workers)  # anonymous and shared: inherited by the forked workers

    def set(self, index: int, open_rollouts: int) -> None:
        struct.pack_into("<q", self._mem, 8 * index, open_rollouts)

    def least_loaded(self, prefer: int) -> int:
        counts = struct.unpack_from(f"<{self.workers}q", self._mem)
        return min(range(self.workers), key=lambda i: (counts[i], i != prefer, i))


@dataclass(frozen=True)
class WorkerInfo:
    """What one worker knows of the set: who it is and where its peers listen."""

    index: int
    generation: int
    host: str
    ports: tuple[int, ...]  # each worker's own port, by index
    board: LoadBoard

    @property
    def port(self) -> int:
        return self.ports[self.index]

    def url(self, index: int) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.ports[index]}"


WORKER = web.AppKey("proxy_worker", WorkerInfo)
PEERS = web.AppKey("proxy_peers", aiohttp.ClientSession)


def _request_keys(request: web.Request) -> list[str]:
    keys = [request.match_info.get("key") or ""]
    auth = request.headers.get("Authorization", "")
    keys += [auth[7:].strip() if auth[:7].lower() == "bearer " else "", request.headers.get("x-api-key", "").strip()]
    return [k for k in keys if k]


def gone_error(index: int) -> ChatError:
    return ChatError(f"this rollout was held by worker {index} of this proxy, which stopped (killed or crashed) and "
                     "was started again without it: its sessions are gone. What it answered is stored; open the "
                     "rollout again with POST /rollouts and continue with the new key", status=401,
                     kind="authentication")


@web.middleware
async def route_to_owner(request: web.Request, handler: Any) -> web.StreamResponse:
    """Serve a call here when its key is this worker's, else forward it to the worker that holds it."""
    me = request.app[WORKER]
    path = request.path
    if request.query.get("local") != "1":
        if path == "/stats":
            return web.json_response(await merged_stats(request.app))
        if path == "/health":
            return web.json_response(await merged_health(request.app))
        if path == "/seal" and request.method == "POST":
            return await sealed_everywhere(request)
        if path == "/rollouts" and request.method == "POST":
            target = me.board.least_loaded(prefer=me.index)
            if target != me.index:
                return await forward(request, target)
    for key in _request_keys(request):
        owner = key_owner(key)
        if owner is None or owner[0] >= len(me.ports):
            continue  # not a worker's key: the registry refuses it as unknown
        if owner[0] != me.index:
            return await forward(request, owner[0])
        if owner[1] != me.generation:
            raise gone_error(me.index)
        break
    return await handler(request)


async def forward(request: web.Request, index: int) -> web.StreamResponse:
    """Send the request to worker `index` and stream its answer back unchanged (SSE included)."""
    me = request.app[WORKER]
    # the body as read is already decoded (aiohttp undoes a Content-Encoding): it goes on as plain bytes
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS | {"content-encoding"}}
    body = await request.read()
    url = me.url(index) + str(request.rel_url)
    for attempt in (1, 2):  # a pooled connection to a worker that died is stale: the retry opens a fresh one,
        try:                # which waits in the listen queue its restarted successor serves
            async with request.app[PEERS].request(request.method, url, headers=headers, data=body,
                                                  allow_redirects=False) as answer:
                response = web.StreamResponse(status=answer.status, headers={
                    k: v for k, v in answer.headers.items() if k.lower() not in HOP_HEADERS})
                await response.prepare(request)
                try:
                    async for chunk in answer.content.iter_any():
                        await response.write(chunk)
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    log.warning("worker %d stopped in the middle of an answer: %s", index, exc)
                    if request.transport is not None:  # cut the connection: the agent must not take it as whole
                        request.transport.close()
                    return response
                await response.write_eof()
                return response
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
            if attempt == 2:
                raise ChatError(f"worker {index} of this proxy, which holds this rollout, is not answering ({exc}); "
                                "if it stopped, its rollouts are gone: open the rollout again with POST /rollouts",
                                status=503, kind="overloaded") from exc
    raise AssertionError("unreachable")


async def sealed_everywhere(request: web.Request) -> web.Response:
    """`POST /seal` on the shared address: every worker seals its own log (each owns one writer)."""
    check_control(request)
    app, me = request.app, request.app[WORKER]

    async def one(index: int) -> tuple[int, Any]:
        try:
            async with app[PEERS].post(me.url(index) + "/seal?local=1", json={}) as r:
                return r.status, await r.json()
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            return 503, {"error": {"message": f"worker {index} is not answering ({exc})"}}

    answers = await asyncio.gather(*(one(i) for i in range(len(me.ports))))
    failed = [f"worker {i}: {body.get('error', {}).get('message', body)}" for i, (status, body) in enumerate(answers)
              if status != 200]
    if failed:
        raise ChatError("sealing failed on " + "; ".join(failed) + "; the other workers sealed, and every "
                        "acknowledged turn stays in its worker's write-ahead log", status=503, kind="overloaded")
    return web.json_response({"sealed": sum(body["sealed"] for _, body in answers)})


async def _peer_json(app: web.Application, index: int, path: str) -> dict[str, Any] | None:
    try:
        async with app[PEERS].get(app[WORKER].url(index) + path + "?local=1",
                                  timeout=aiohttp.ClientTimeout(total=PEER_TIMEOUT_S)) as r:
            return await r.json() if r.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None


async def _all(app: web.Application, path: str) -> list[dict[str, Any] | None]:
    me = app[WORKER]
    return list(await asyncio.gather(*(_peer_json(app, i, path) for i in range(len(me.ports)))))


async def merged_health(app: web.Application) -> dict[str, Any]:
    me = app[WORKER]
    answers = await _all(app, "/health")
    workers = [{**(a or {}).get("worker", {"index": i, "port": me.ports[i]}), "status": "ok" if a else "down"}
               for i, a in enumerate(answers)]
    return {"status": "ok" if all(answers) else "degraded", "workers": workers}


async def merged_stats(app: web.Application) -> dict[str, Any]:
    answers = await _all(app, "/stats")
    up = [a for a in answers if a]
    merged = merge_counters(up)
    merged["durable_wait"] = merge_waits([a["durable_wait"] for a in up if "durable_wait" in a])
    merged["workers"] = [{"index": i, "status": "ok" if a else "down", "turns": a["turns"] if a else None}
                         for i, a in enumerate(answers)]
    return merged


def merge_counters(parts: Iterable[Any]) -> Any:
    """Numbers summed key by key, through nested objects (the /stats of several workers as one)."""
    parts = list(parts)
    if not parts:
        return {}
    if all(isinstance(p, dict) for p in parts):
        keys = dict.fromkeys(k for p in parts for k in p)
        return {k: merge_counters([p[k] for p in parts if k in p]) for k in keys}
    if all(isinstance(p, (int, float)) and not isinstance(p, bool) for p in parts):
        return sum(parts)
    return parts[0]


def merge_waits(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Several workers' `durable_wait` histograms as one (same buckets: counts add)."""
    if not parts:
        return {}
    counts = [sum(c) for c in zip(*(p["counts"] for p in parts), strict=True)]
    n = sum(counts)
    total_ms = sum((p["mean_ms"] or 0) * p["count"] for p in parts)
    return {"count": n, "mean_ms": round(total_ms / n, 4) if n else None, "p50_ms": percentile_ms(counts, 0.5),
            "p99_ms": percentile_ms(counts, 0.99), "bucket_upper_ms": parts[0]["bucket_upper_ms"], "counts": counts}


# ---------------------------------------------------------------- the worker processes and their supervisor


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


def _serve_worker(client_factory: Callable[[], PolicyClient], store_location: str, config: Any,
                  info: WorkerInfo, shared: socket.socket, own: socket.socket, ready: int) -> None:
    """A worker's life, in the forked child: the proxy app on the shared and its own socket until SIGINT/SIGTERM."""
    from collectors.proxy.app import create_app
    from collectors.serving import serve_sockets
    from trajstore import open_store

    store = open_store(store_location)
    if config.writer is None:  # unique names: seal what dead workers (of this or an earlier proxy) left
        orphans = store.seal_orphans()
        if any(orphans.values()):
            log.warning("worker %d sealed what stopped writers had left unsealed: %s", info.index, orphans)
    named = dataclasses.replace(config, writer=f"{config.writer}-w{info.index}" if config.writer else None)
    app = create_app(client_factory, store, named, worker=info)

    async def peers(app: web.Application) -> Any:
        app[PEERS] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                                           auto_decompress=False,
                                           connector=aiohttp.TCPConnector(limit=0, force_close=False))
        yield
        await app[PEERS].close()

    app.cleanup_ctx.append(peers)

    def started() -> None:
        os.write(ready, b"1")
        os.close(ready)

    # innermost, after the host and origin guard: a call is checked here before it is forwarded
    serve_sockets(app, info.host, [shared, own], started, middlewares=[route_to_owner])


def run_workers(client_factory: Callable[[], PolicyClient], store_location: str, config: Any, *, host: str,
                port: int, workers: int) -> None:
    """Serve with `workers` processes until interrupted (`trajstore proxy --workers N`)."""
    config.check()
    shared = _listen(host, port)
    own = [_listen(host, 0) for _ in range(workers)]
    ports = tuple(s.getsockname()[1] for s in own)
    board = LoadBoard(workers)
    generation = [0] * workers
    pids: dict[int, int] = {}
    ready_fds: dict[int, int] = {}  # pid -> the read end of its "serving" pipe, until it serves

    def spawn(index: int) -> None:
        info = WorkerInfo(index, generation[index], host, ports, board)
        board.set(index, 0)
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the worker
            code = 0
            try:
                os.close(read_end)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                _serve_worker(client_factory, store_location, config, info, shared, own[index], write_end)
            except Exception as exc:  # noqa: BLE001 - a worker's failure is its exit status and one line of log
                log.error("worker %d stopped: %s: %s", index, type(exc).__name__, exc)
                log.debug("worker %d's failure", index, exc_info=True)
                code = 1
            finally:
                os._exit(code)
        os.close(write_end)
        pids[pid] = index
        ready_fds[pid] = read_end

    stopping = False

    def stop(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True
        for pid in list(pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for i in range(workers):
            spawn(i)
        _wait_ready(ready_fds, list(pids))
        url = f"http://{f'[{host}]' if ':' in host else host}:{shared.getsockname()[1]}"
        print(f"capture proxy on {url} with {workers} workers (pids {', '.join(map(str, pids))}; their own ports "
              f"{', '.join(map(str, ports))}), store {store_location}, run {config.run!r}", flush=True)
        failed = False
        while pids:
            try:
                pid, status = os.wait()
            except ChildProcessError:
                break
            except InterruptedError:
                continue
            index = pids.pop(pid, None)
            fd = ready_fds.pop(pid, None)
            if index is None:
                continue
            if fd is not None:
                os.close(fd)
            if stopping:
                continue
            if fd is not None:  # it never served: a bad store or model, not a crash to recover from
                log.error("worker %d exited before it served (%s); stopping the proxy", index, _how(status))
                failed = True
                stop(signal.SIGTERM, None)
                continue
            generation[index] += 1
            log.warning("worker %d (pid %d) stopped (%s); its rollouts are gone and their keys refused; starting it "
                        "again", index, pid, _how(status))
            spawn(index)
            _wait_ready(ready_fds, [p for p, i in pids.items() if i == index])
        if failed:
            raise SystemExit(1)
        print("stopping: the workers finished the requests in flight", flush=True)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for sock in (shared, *own):
            sock.close()


def _wait_ready(ready_fds: dict[int, int], pids: Iterable[int]) -> None:
    """Wait until each worker in `pids` says it serves (or exits: its read end then returns b""); the ones that
    serve leave `ready_fds`."""
    for pid in list(pids):
        fd = ready_fds.get(pid)
        if fd is None:
            continue
        while True:
            try:
                said = os.read(fd, 1)
                break
            except InterruptedError:
                continue
        if said:
            os.close(fd)
            del ready_fds[pid]


def _how(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit status {os.waitstatus_to_exitcode(status)}"
