"""The proxy's group commit alone: how long a turn waits to be durable while the event loop is busy.

S sessions on one event loop, as in the proxy: each waits for its "upstream" (`--upstream-ms`), spends
`--loop-ms` of CPU on the loop (what rendering, parsing and answering cost there), then appends one
turn event (a few hundred prompt and output ids with logprobs, a `--request-kb` request) through
`collectors.proxy.appender.BatchAppender`, given the writer's `stage` as the proxy gives it, to a
real store writer (fsync'd) in a temporary directory, and records the wait twice: from `append`
asked, and from the turn handed to the commit thread (what `append` returns, and what the proxy's
/stats `durable_wait` counts: a turn that finds the commit thread idle is staged first, by its
caller; an earlier appender is given the writer's `prepare`, which it took). `--appender FILE` loads
another implementation of `BatchAppender` (e.g. an earlier version:
`git show REV:collectors/proxy/appender.py > /tmp/old.py`) to compare in one run, with this tree's writer;
the implementations take turns, `--repeats` rounds each, and so do the thread switch intervals of `--switch-ms`
(the servers run with `collectors.serving.SWITCH_INTERVAL_S`). To compare writers as well, run the script
from two checkouts in turn, each with its own `PYTHONPATH`.

    python benchmarks/commit_wait.py                               # 32 sessions, ~1 minute
    python benchmarks/commit_wait.py --appender /tmp/old.py --repeats 2
    python benchmarks/commit_wait.py --sessions 96 --loop-ms 3 --switch-ms 5 0.5 --repeats 3   # thread switch interval
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import inspect
import itertools
import os
import sys
import tempfile
import time
from typing import Any

from collectors.proxy import appender as current
from collectors.serving import SWITCH_INTERVAL_S
from trajstore import Turn, open_store


def turn(session: int, index: int, request_kb: float) -> Turn:
    messages = [{"role": "user", "content": "x" * 2000} for _ in range(max(1, round(request_kb / 2)))]
    return Turn(run="bench", group_id="g", rollout_id=f"r{session}", session_id="main", segment_id=f"s{session}",
                turn_index=index, policy_version=0, prompt_ids=list(range(300)), output_ids=list(range(256)),
                output_logprobs=[-0.1] * 256, finish_reason="stop", sampling={}, request={"messages": messages},
                response={"id": f"r{session}-{index}"}, meta={})


def spin(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


async def one_round(module: Any, args: argparse.Namespace, directory: str) -> tuple[list[float], list[float]]:
    """Each turn's wait from `append` asked to durable, and the wait `append` reports (handed to the commit ->
    durable: without the conversion its caller may do first), sorted."""
    waits: list[float] = []
    commits: list[float] = []
    with open_store(directory).writer("bench") as writer:
        appender = module.BatchAppender(writer.append, *helpers(module.BatchAppender, writer))

        async def session(s: int) -> None:
            await asyncio.sleep(s * args.upstream_ms / 1e3 / args.sessions)  # starts spread over one upstream time
            for i in range(args.turns):
                await asyncio.sleep(args.upstream_ms / 1e3)
                spin(args.loop_ms)
                event = turn(s, i, args.request_kb)
                t0 = time.perf_counter()
                reported = await appender.append([event])
                waits.append(time.perf_counter() - t0)
                commits.append(reported if isinstance(reported, float) else waits[-1])

        await asyncio.gather(*(session(s) for s in range(args.sessions)))
        if hasattr(appender, "close"):
            appender.close()
    return sorted(waits), sorted(commits)


def helpers(appender: type, writer: Any) -> list[Any]:
    """What the proxy gives an appender beside `append`: the writer's `stage`, or, to an earlier appender, its
    `prepare` (or nothing, to one older still)."""
    params = list(inspect.signature(appender).parameters)[1:]
    if not params:
        return []
    return [writer.stage if params[0] == "stage" else writer.prepare]


def load(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("other_appender", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--turns", type=int, default=12, help="turns per session (default 12)")
    ap.add_argument("--upstream-ms", type=float, default=300.0, help="each turn's wait for its upstream (300)")
    ap.add_argument("--loop-ms", type=float, default=3.0, help="CPU each turn spends on the event loop (3)")
    ap.add_argument("--request-kb", type=float, default=2.0,
                    help="each turn's request JSON in kB (default 2; an agent's 32k-token context is ~120)")
    ap.add_argument("--appender", help="a file defining another BatchAppender, measured beside this one")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--switch-ms", type=float, nargs="+", default=[SWITCH_INTERVAL_S * 1e3],
                    help="the interpreter's thread switch interval(s) to run with, in turn (default: the servers' "
                         f"{SWITCH_INTERVAL_S * 1e3:g} ms; Python's own is 5)")
    args = ap.parse_args()
    modules = [("this appender", current)] + ([(f"--appender {args.appender}", load(args.appender))]
                                              if args.appender else [])
    print(f"{args.sessions} sessions x {args.turns} turns, upstream {args.upstream_ms:g} ms, {args.loop_ms:g} ms of "
          f"loop CPU per turn; {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start")
    width = max(len(name) for name, _ in modules)
    print(f"  {'appender':<{width}} {'switch':>7} {'turns':>6} {'asked -> durable p50 / p90 / p99 ms':>36} "
          f"{'handed to the commit -> durable p50 / p90 / p99 ms':>52}")
    for _ in range(args.repeats):
        for (name, module), switch_ms in itertools.product(modules, args.switch_ms):
            sys.setswitchinterval(switch_ms / 1e3)
            with tempfile.TemporaryDirectory(prefix="commit-wait-") as d:
                waits, commits = asyncio.run(one_round(module, args, d))
            at = [[1e3 * w[min(len(w) - 1, int(q * len(w)))] for q in (0.5, 0.9, 0.99)] for w in (waits, commits)]
            print(f"  {name:<{width}} {switch_ms:>5g}ms {len(waits):>6} {' / '.join(f'{x:.2f}' for x in at[0]):>36} "
                  f"{' / '.join(f'{x:.2f}' for x in at[1]):>52}", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
