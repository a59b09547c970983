"""How long the garbage collector holds a server's GIL: a full collection in the capture proxy's process,
before and after `collectors.serving.settle_heap` (what `trajstore proxy` and the other servers run once up).

The proxy is started in this process as `trajstore proxy` starts it (`start_proxy`: the store, the tiny
model's tokenizer and chat template, every import; the model is built by another process), with its
upstream pointed at a closed port (no call is made). Then a full `gc.collect()` is timed `--repeats` times as the process stands, `settle_heap()` is
run, and the full collection is timed again, and once more after `--sessions` sessions' worth of chat
state is made (the messages a proxy holds for each session, 40 calls at 8k tokens each).

    python benchmarks/gc_pause.py            # ~30 s
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


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


def main() -> None:
    logging.disable(logging.WARNING)  # the proxy's note that its (absent) upstream lists no models
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sessions", type=int, default=192)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        model = str(Path(directory) / "model")
        subprocess.run([sys.executable, "-c", "from cli.main import main; main()", "init-model", model], cwd=ROOT,
                       check=True, capture_output=True, timeout=600)  # built elsewhere: the proxy's process does not
        asyncio.run(measure(args, directory, model))


if __name__ == "__main__":
    main()
