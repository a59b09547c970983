"""How long one huge call holds the GIL at a stretch in the capture proxy, stage by stage.

A call whose body is megabytes (a rollout pasting a huge log: `proxy_agents.py`'s `hog_body`)
must not hold up the other sessions: every stretch in which one thread holds the GIL stops the
event loop and every other thread for its length. This runs the real proxy (its aiohttp app on
its own event-loop thread, `serve_proxy_in_thread`, with the thread switch interval and frozen heap
of `trajstore proxy`: `collectors.serving.serving_process` and `settle_heap`) in this process, in front of
`proxy_agents.py`'s fake policy server (its own process), sends it the huge body `--calls`
times (streamed, one session, each call a new segment of ~2M tokens at 7 MB), and measures:

- a probe thread that sleeps 1 ms in a loop: how late it wakes is how long it waited for the
  GIL (or, on a loaded machine, for a core): each lateness over `--threshold-ms` is a *stall*;
- the stages of the call (wrapped functions, each with its thread and start/end time): a stall
  is put down to the shortest stage that covers it (several when threads overlap it).

Printed: each stage's longest stall and count, then the stalls themselves. A stall that no
stage covers is shown as `(outside the wrapped stages)`.

    python benchmarks/gil_holds.py                  # 7 MB, 3 calls; ~1 minute on 2 idle cores
    python benchmarks/gil_holds.py --mb 2 --calls 5 --threshold-ms 2
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib
import inspect
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from agent_upstream import MODEL, start_upstream  # noqa: E402
from agent_workload import hog_body  # noqa: E402

# (module, class or None, function, label): the stages of a call, outer ones and the parts inside them
STAGES = [
    ("collectors.serving", None, "_decode", "decode the body (orjson.loads)"),
    ("collectors.serving", None, "decode_json_text", "decode the body"),
    ("collectors.proxy.wire.openai_chat", "OpenAIChat", "parse_request", "parse_request"),
    ("collectors.proxy.render", "ChatRenderer", "check_fits", "check_fits"),
    ("collectors.proxy.capture", None, "reconcile", "reconcile"),
    ("collectors.proxy.extend", "Extender", "prompt_text", "render (chat template)"),
    ("collectors.proxy.render", "ChatRenderer", "encode", "tokenize (encode)"),
    ("collectors.proxy.capture", None, "plan_turn", "plan_turn"),
    ("collectors.policy.token_ids", "TokenIds", "json", "TokenIds.json (prompt ids to JSON)"),
    ("collectors.policy.embedded_client", "EmbeddedClient", "stream", "upstream stream (client)"),
    ("collectors.proxy.capture", "Capture", "_reply", "_reply"),
    ("collectors.proxy.capture", "Capture", "_store", "_store (loop side, incl. the durable wait)"),
    ("collectors.proxy.capture", None, "record_turn", "record_turn"),
    ("collectors.policy.token_ids", "TokenLog", "extend", "TokenLog.extend"),
    ("trajstore.writer", "Writer", "prepare", "Writer.prepare"),
    ("trajstore.writer", "Writer", "append", "Writer.append (commit thread)"),
    ("trajstore.events", None, "to_columns", "to_columns"),
    ("trajstore.events", None, "list_column", "list_column"),
    ("trajstore.events", None, "json_text", "json_text"),
    ("trajstore.wal", None, "encode_batch", "wal.encode_batch"),
    ("trajstore.writer", "Writer", "_flush", "Writer._flush (write + fsync)"),
]


@dataclass
class Spans:
    """Each wrapped stage's runs: (label, thread name, start, end), perf_counter seconds."""

    done: list[tuple[str, str, float, float]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def wrap(self, module: str, owner: str | None, name: str, label: str) -> None:
        mod = importlib.import_module(module)
        obj = getattr(mod, owner) if owner else mod
        fn = getattr(obj, name)
        static = owner is not None and isinstance(inspect.getattr_static(obj, name), staticmethod)

        def record(t0: float) -> None:
            with self.lock:
                self.done.append((label, threading.current_thread().name, t0, time.perf_counter()))

        if inspect.isasyncgenfunction(fn):
            @functools.wraps(fn)
            async def agen(*a: Any, **k: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    async for x in fn(*a, **k):
                        yield x
                finally:
                    record(t0)
            wrapped: Callable[..., Any] = agen
        elif inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def coro(*a: Any, **k: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return await fn(*a, **k)
                finally:
                    record(t0)
            wrapped = coro
        else:
            @functools.wraps(fn)
            def plain(*a: Any, **k: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    record(t0)
            wrapped = plain
        setattr(obj, name, staticmethod(wrapped) if static else wrapped)
        for user in ("collectors.proxy.capture", "collectors.proxy.app", "collectors.proxy.segmenter"):
            m = sys.modules.get(user)  # names imported with `from x import f` are rebound where they are used
            if owner is None and m is not None and getattr(m, name, None) is fn:
                setattr(m, name, wrapped)


class Probe(threading.Thread):
    """Sleeps 1 ms in a loop; records each wake later than `threshold` s as a stall (start, end)."""

    def __init__(self, threshold: float) -> None:
        super().__init__(name="gil-probe", daemon=True)
        self.threshold, self.stalls, self.running = threshold, [], True
        self.stalls: list[tuple[float, float]]

    def run(self) -> None:
        while self.running:
            due = time.perf_counter() + 0.001
            time.sleep(0.001)
            now = time.perf_counter()
            if now - due > self.threshold:
                self.stalls.append((due, now))


def attribute(stall: tuple[float, float], spans: list[tuple[str, str, float, float]]) -> str:
    """The shortest stage covering the stall, per thread (the GIL holder is inside one of them)."""
    start, end = stall
    by_thread: dict[str, tuple[float, str]] = {}
    for label, thread, t0, t1 in spans:
        covers = t0 <= start and t1 >= end - 0.0005  # the probe wakes a little after the hold ends
        if covers and (thread not in by_thread or t1 - t0 < by_thread[thread][0]):
            by_thread[thread] = (t1 - t0, label)
    if not by_thread:
        return "(outside the wrapped stages)"
    return " | ".join(f"{label} [{thread}]" for thread, (_, label) in sorted(by_thread.items()))


async def send(url: str, key: str, body: bytes, calls: int) -> list[float]:
    import aiohttp

    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        for _ in range(calls):
            t0 = time.perf_counter()
            async with http.post(url + "/v1/chat/completions", data=body, headers={
                    "Authorization": f"Bearer {key}", "Content-Type": "application/json"}) as resp:
                reply = await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"the proxy answered {resp.status}: {reply[:300]!r}")
            out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=7.0, help="the body's size in MB (default 7)")
    ap.add_argument("--calls", type=int, default=3, help="calls sent, one after another (default 3)")
    ap.add_argument("--threshold-ms", type=float, default=5.0, help="a stall is a wake this much late (default 5)")
    ap.add_argument("--list", type=int, default=25, help="the longest stalls listed one by one (default 25)")
    args = ap.parse_args()

    import httpx

    from collectors.model.build import ModelSize, init_model
    from collectors.policy import EmbeddedClient
    from collectors.proxy.app import ProxyConfig, serve_proxy_in_thread
    from collectors.serving import serving_process, settle_heap

    spans = Spans()
    for stage in STAGES:
        spans.wrap(*stage)
    body = hog_body(args.mb, 8)
    with tempfile.TemporaryDirectory(prefix="gil-holds-") as tmp:
        model_dir = str(Path(tmp) / "model")
        init_model(model_dir, ModelSize(), seed=0)
        up_proc, up_conn, upstream = start_upstream(model_dir)
        config = ProxyConfig(model_dir=model_dir, run="gil", model_names=(MODEL,), max_model_len=1 << 22)
        try:
            with serve_proxy_in_thread(lambda: EmbeddedClient(upstream), str(Path(tmp) / "store"), config) as proxy:
                key = httpx.post(proxy.url + "/rollouts", json={}, timeout=30).json()["api_key"]
                asyncio.run(send(proxy.url, key, hog_body(0.01, 8), 1))  # warm: imports, caches
                serving_process()  # as `trajstore proxy` runs: its thread switch interval, its heap frozen once up
                settle_heap()
                spans.done.clear()
                probe = Probe(args.threshold_ms / 1e3)
                probe.start()
                seconds = asyncio.run(send(proxy.url, key, body, args.calls))
                probe.running = False
                probe.join()
        finally:
            up_conn.send("stop")
            up_proc.join(30)
    print(f"{args.calls} calls of a {len(body) / 1e6:.1f} MB body (one user message), streamed, each a new segment; "
          f"call time {min(seconds):.2f}-{max(seconds):.2f} s; load average {os.getloadavg()[0]:.1f}")
    print(f"stalls (a 1 ms sleep waking more than {args.threshold_ms:g} ms late): {len(probe.stalls)}, "
          f"longest {max((e - s for s, e in probe.stalls), default=0) * 1e3:.1f} ms")
    worst: dict[str, list[float]] = {}
    for stall in probe.stalls:
        worst.setdefault(attribute(stall, spans.done), []).append((stall[1] - stall[0]) * 1e3)
    print(f"\n{'stage holding the GIL (the shortest wrapped stage covering the stall) [thread]':<96}"
          f"{'longest ms':>11}{'count':>7}")
    for where, ms in sorted(worst.items(), key=lambda kv: -max(kv[1])):
        print(f"{where[:95]:<96}{max(ms):>11.1f}{len(ms):>7}")
    t_base = min((s for s, _ in probe.stalls), default=0.0)
    print(f"\nthe {args.list} longest stalls (ms after the first, length ms, stage):")
    for s, e in sorted(probe.stalls, key=lambda st: st[0] - st[1])[:args.list]:
        print(f"  {(s - t_base) * 1e3:9.1f} {(e - s) * 1e3:7.1f}  {attribute((s, e), spans.done)}")


if __name__ == "__main__":
    main()
