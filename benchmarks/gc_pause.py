"""How long the garbage collector holds a server's GIL: a full collection in the capture proxy's process,
before and after `collectors.serving.settle_heap` (what `trajstore proxy` and the other servers run once up);
and how much CPU its collections of the youngest generation take per call.

The proxy is started in this process as `trajstore proxy` starts it (`start_proxy`: the store, the tiny
model's tokenizer and chat template, every import; the model is built by another process), with its
upstream pointed at a closed port (no call is made). Then a full `gc.collect()` is timed `--repeats` times as the process stands, `settle_heap()` is
run, and the full collection is timed again, and once more after `--sessions` sessions' worth of chat
state is made (the messages a proxy holds for each session, 40 calls at 8k tokens each).

Then the young collections: one session of `benchmarks/proxy_agents.py`'s workload per `--contexts` size
goes through the proxy's own code (`proxy_profile.one_session`: decode, parse, render, the fake policy server
in its own process, the durable append), at Python's default threshold for the youngest generation (700)
and at `settle_heap`'s (`YOUNG_COLLECTION_THRESHOLD`), alternating; printed: the collections and their CPU
(thread time, from `gc.callbacks`) per call, and the longest. One session has one body in flight at a time:
a proxy serving dozens at once walks more of them per collection.

    python benchmarks/gc_pause.py            # ~1 minute
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def full_collections(repeats: int) -> list[float]:
    """Wall milliseconds of `repeats` full collections."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - start) * 1e3)
    return times


async def measure(args: argparse.Namespace, directory: str, model: str) -> None:
    from collectors.policy import EmbeddedClient
    from collectors.proxy import ProxyConfig
    from collectors.proxy.app import start_proxy
    from collectors.serving import settle_heap
    from trajstore import open_store

    config = ProxyConfig(model_dir=model, run="bench", model_names=("bench",))
    runner, _ = await start_proxy(lambda: EmbeddedClient("http://127.0.0.1:9"), open_store(str(Path(directory) / "s")),
                                    config, "127.0.0.1", 0)
    try:
        rows = [("as started", len(gc.get_objects()), full_collections(args.repeats))]
        settle_heap()
        rows.append(("after settle_heap", len(gc.get_objects()), full_collections(args.repeats)))
        message = {"role": "tool", "tool_call_id": "call_1", "content": "x" * 800}
        held = [json.loads(json.dumps([message] * 40)) for _ in range(args.sessions)]  # parsed, as bodies are
        rows.append((f"+ {args.sessions} sessions' messages", len(gc.get_objects()), full_collections(args.repeats)))
        del held
    finally:
        await runner.cleanup()
    print(f"the capture proxy's process ({len(sys.modules)} modules imported); {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"  {'heap':<28} {'objects the collector tracks':>29} {'full collection p50 / max ms':>30}")
    for name, objects, times in rows:
        times.sort()
        print(f"  {name:<28} {objects:>29,} {times[len(times) // 2]:>18.1f} / {times[-1]:6.1f}")


def young_collections(args: argparse.Namespace, directory: str, model: str) -> None:
    from transformers import AutoTokenizer

    from collectors.serving import YOUNG_COLLECTION_THRESHOLD
    from agent_upstream import start_upstream
    from agent_workload import build_workload
    from proxy_profile import one_session

    tok = AutoTokenizer.from_pretrained(model)
    up_proc, up_conn, upstream = start_upstream(model)
    starts: list[float] = []
    spent: list[float] = []

    def timed(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            starts.append(time.thread_time())
        elif starts:
            spent.append(time.thread_time() - starts.pop())

    rows = []
    before = gc.get_threshold()
    gc.callbacks.append(timed)
    try:
        for context in args.contexts:
            load = build_workload(tok, context, args.turns, 256)
            for k in range(args.repeats):
                for threshold in (700, YOUNG_COLLECTION_THRESHOLD):
                    gc.set_threshold(threshold, *before[1:])
                    spent.clear()
                    turns = asyncio.run(one_session(model, str(Path(directory) / f"young-{context}-{threshold}-{k}"),
                                                    upstream, load, args.turns, None)).turns
                    rows.append((context, threshold, len(spent) / turns, 1000 * sum(spent) / turns,
                                 1000 * max(spent, default=0.0)))
    finally:
        gc.callbacks.remove(timed)
        gc.set_threshold(*before)
        up_conn.send("stop")
        up_proc.join(30)
    print(f"\nyoung collections during one proxy session of {args.turns} calls per context ({args.repeats} "
          f"rounds each, alternating); load average {os.getloadavg()[0]:.1f}")
    print(f"  {'context':>8} {'threshold':>9} {'collections/call':>17} {'GC CPU ms/call':>15} {'longest ms':>11}")
    for context, threshold, per_call, cpu, longest in rows:
        print(f"  {context:>8,} {threshold:>9,} {per_call:>17.2f} {cpu:>15.3f} {longest:>11.2f}")


def main() -> None:
    logging.disable(logging.WARNING)  # the proxy's note that its (absent) upstream lists no models
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sessions", type=int, default=192)
    ap.add_argument("--contexts", type=int, nargs="+", default=[8000, 80000], help="young collections: context sizes")
    ap.add_argument("--turns", type=int, default=40, help="young collections: calls of each session")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        model = str(Path(directory) / "model")
        subprocess.run([sys.executable, "-c", "from cli.main import main; main()", "init-model", model], cwd=ROOT,
                       check=True, capture_output=True, timeout=600)  # built elsewhere: the proxy's process does not
        asyncio.run(measure(args, directory, model))
        young_collections(args, directory, model)


if __name__ == "__main__":
    main()
