"""Stored request bytes per session and the proxy's CPU per turn: requests whole vs. as deltas, side by side.

Sessions of `benchmarks/proxy_agents.py`'s workload (40 calls growing to 8k, 32k and 80k tokens by default, the same
prebuilt bodies) run through the capture proxy's own code in this process, as `benchmarks/proxy_profile.py`
does (its `Inline` executor: everything on one thread), once with `Capture(whole_requests=True)` (the proxy's
`--whole-requests`) and once with deltas, each into its own store, alternating `--repeats` times. The body is
handed over as the proxy's chat route does: decoded, parsed by the OpenAI Chat wire adapter, its bytes kept
(`ChatRequest.body_json`). Printed per size: the bodies' bytes, the stored `request` bytes of a session, CPU per
turn (time.process_time, mean of the repeats), the CPU per turn of sealing the session's segments into the table
(the writer's close; a serving proxy seals every minute or 64 MB, and that CPU is the proxy process's too), and the cost of the prefix check (`==` of the two longest calls'
message lists).

    python benchmarks/request_storage.py                          # 40 calls to 8k, 32k, 80k tokens; ~1 minute
    python benchmarks/request_storage.py --contexts 80000 --repeats 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from agent_upstream import start_upstream  # noqa: E402
from agent_workload import Workload, build_workload  # noqa: E402
import proxy_profile  # noqa: E402


async def one_session(model_dir: str, store_dir: str, upstream: str, load: Workload, turns: int,
                      whole: bool) -> tuple[int, float, float]:
    """(stored request bytes of the session, CPU seconds per turn, CPU seconds per turn of sealing the session's
    write-ahead segments into the table)."""
    from trajstore import open_store

    run = await proxy_profile.one_session(model_dir, store_dir, upstream, load, turns, None, whole_requests=whole)
    stored = open_store(store_dir).query("SELECT sum(strlen(request))::BIGINT AS n FROM turns "
                                         "WHERE session_id = 'main'")
    return stored.column("n")[0].as_py(), run.cpu / run.turns, run.seal_cpu / run.turns


def prefix_check_ms(load: Workload, turns: int) -> float:
    """One `==` of the previous call's message list with the new call's slice, as the proxy runs it (ms)."""
    before, now = json.loads(load.bodies[turns - 2])["messages"], json.loads(load.bodies[turns - 1])["messages"]
    n, reps = len(before), 50
    t0 = time.perf_counter()
    for _ in range(reps):
        assert now[:n] == before
    return 1000 * (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[8000, 32000, 80000],
                    help="tokens of the session's last call, one session per size")
    ap.add_argument("--turns", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=2, help="sessions of each kind per size, alternated")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from collectors.model.build import ModelSize, init_model

    rows = []
    with tempfile.TemporaryDirectory(prefix="request-storage-") as tmp:
        model_dir = str(Path(tmp) / "model")
        init_model(model_dir, ModelSize(), seed=0)
        tok = AutoTokenizer.from_pretrained(model_dir)
        up_proc, up_conn, upstream = start_upstream(model_dir)
        try:
            for context in args.contexts:
                load = build_workload(tok, context, args.turns, 256)
                got: dict[bool, list[tuple[int, float, float]]] = {True: [], False: []}
                for r in range(args.repeats):
                    for whole in (True, False):
                        got[whole].append(asyncio.run(one_session(
                            model_dir, str(Path(tmp) / f"s-{context}-{whole}-{r}"), upstream, load, args.turns, whole)))
                rows.append((load, {w: (got[w][0][0], 1000 * sum(c for _, c, _ in got[w]) / len(got[w]),
                                        1000 * sum(s for _, _, s in got[w]) / len(got[w])) for w in got},
                             prefix_check_ms(load, args.turns)))
        finally:
            up_conn.send("stop")
            up_proc.join(30)
    print(f"one session of {args.turns} calls per size, {args.repeats} sessions of each kind; load average "
          f"{os.getloadavg()[0]:.1f} (shared cores)")
    print(f"  {'last call':>10}{'bodies sent':>14}{'stored, whole':>16}{'stored, delta':>16}"
          f"{'CPU/turn whole':>16}{'CPU/turn delta':>16}{'seal/turn whole':>17}{'seal/turn delta':>17}"
          f"{'prefix check':>14}")
    for load, got, check in rows:
        sent = sum(len(b) for b in load.bodies[:args.turns])
        print(f"  {load.last_prompt_tokens:>10,}{sent:>14,}{got[True][0]:>16,}{got[False][0]:>16,}"
              f"{got[True][1]:>13.2f} ms{got[False][1]:>13.2f} ms{got[True][2]:>14.2f} ms{got[False][2]:>14.2f} ms"
              f"{check:>11.3f} ms")


if __name__ == "__main__":
    main()
