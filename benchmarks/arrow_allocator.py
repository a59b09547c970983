"""Arrow's allocators side by side on the capture proxy's work: jemalloc (the store's choice), pyarrow's
default mimalloc, and the system allocator.

Each allocator runs in its own process (`ARROW_DEFAULT_MEMORY_POOL` set before pyarrow loads):
`--sessions` sessions of `proxy_agents.py`'s workload (a growing tool-using history up to `--context`
tokens, `--turns` calls each) go one after the other through the proxy's own code
(`proxy_profile.one_session`: decode, render, tokenize, the fake policy server in its own process, the
group commit to a real store, fsync'd). Printed per allocator: the proxy's CPU per turn, the thread CPU of
each turn's `Writer.prepare` (validation and conversion to Arrow, on the event loop for a turn that
finds the commit idle) p50 / p99 / max and how many took over 2 ms, then the wall time of reading every
turn back (`store.query` of the token lists and requests), `--reads` times.

    python benchmarks/arrow_allocator.py                  # 80k contexts, 2 sessions of 40 turns; ~2 minutes
    python benchmarks/arrow_allocator.py --context 32000 --sessions 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ALLOCATORS = ("jemalloc", "mimalloc", "system")
SLOW_MS = 2.0  # a prepare over this is a stall: the 80k-context turn's own conversion takes about 1 ms


def percentiles(values: list[float]) -> tuple[float, float, float]:
    ordered = sorted(values)
    return ordered[len(ordered) // 2], ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], ordered[-1]


def child(args: argparse.Namespace) -> None:
    """One allocator's run (this process was started with it); prints one JSON line."""
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import pyarrow as pa
    from agent_upstream import start_upstream
    from agent_workload import build_workload
    from proxy_profile import one_session
    from transformers import AutoTokenizer

    from collectors.model.build import ModelSize, init_model
    from trajstore import writer as writer_module

    prepares: list[float] = []
    prepare = writer_module.Writer.prepare

    def timed(events: Any) -> Any:
        start = time.thread_time()
        try:
            return prepare(events)
        finally:
            prepares.append((time.thread_time() - start) * 1e3)

    writer_module.Writer.prepare = staticmethod(timed)  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory() as directory:
        model = str(Path(directory) / "model")
        init_model(model, ModelSize(), seed=0)
        load = build_workload(AutoTokenizer.from_pretrained(model), args.context, args.turns, 256)
        process, conn, upstream = start_upstream(model)
        try:
            turns = cpu = 0.0
            for session in range(args.sessions):
                n, spent, _ = asyncio.run(one_session(model, str(Path(directory) / "store"), upstream, load,
                                                      args.turns, None))
                turns, cpu = turns + n, cpu + spent
        finally:
            conn.send("stop")
            process.join(30)
        reads: list[float] = []
        from trajstore import open_store

        store = open_store(str(Path(directory) / "store"))
        for _ in range(args.reads):
            start = time.perf_counter()
            table = store.query("SELECT prompt_ids, output_ids, output_logprobs, request FROM events WHERE kind = 'turn'")
            reads.append((time.perf_counter() - start) * 1e3)
    print(json.dumps({"backend": pa.default_memory_pool().backend_name, "cpu": cpu / turns * 1e3,
                      "prepare": percentiles(prepares), "slow": sum(p > SLOW_MS for p in prepares),
                      "prepares": len(prepares), "read": percentiles(reads), "rows": table.num_rows}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=80_000, help="tokens of history a session grows to")
    ap.add_argument("--turns", type=int, default=40, help="calls per session")
    ap.add_argument("--sessions", type=int, default=2)
    ap.add_argument("--reads", type=int, default=5)
    ap.add_argument("--allocators", nargs="+", default=list(ALLOCATORS), choices=ALLOCATORS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    print(f"{args.sessions} sessions of {args.turns} calls up to {args.context:,} tokens through the proxy's code; "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start")
    print(f"  {'allocator':<10} {'CPU/turn ms':>12} {'prepare CPU p50 / p99 / max ms':>32} "
          f"{f'over {SLOW_MS:g} ms':>10} {'read p50 / max ms':>19}")
    rows = {}
    for name in args.allocators:
        argv = [sys.executable, __file__, "--child", "--context", str(args.context), "--turns", str(args.turns),
                "--sessions", str(args.sessions), "--reads", str(args.reads)]
        out = subprocess.run(argv, env={**os.environ, "ARROW_DEFAULT_MEMORY_POOL": name}, capture_output=True,
                             text=True, check=True, timeout=1800).stdout
        row = rows[name] = json.loads(out.strip().splitlines()[-1])
        p, r = row["prepare"], row["read"]
        print(f"  {row['backend']:<10} {row['cpu']:12.2f} {p[0]:10.3f} / {p[1]:6.3f} / {p[2]:6.3f} "
              f"{row['slow']:>5d} of {row['prepares']:<3d} {r[0]:9.1f} / {r[2]:7.1f}")
    if "jemalloc" in rows:
        base = rows["jemalloc"]
        for name, row in rows.items():
            if name != "jemalloc":
                print(f"  {name} / jemalloc: CPU per turn {row['cpu'] / base['cpu']:.2f}x, prepare p99 "
                      f"{row['prepare'][1] / base['prepare'][1]:.1f}x, read p50 {row['read'][0] / base['read'][0]:.2f}x")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
