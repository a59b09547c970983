"""Where the capture proxy's CPU goes per turn, at each context size: a cProfile table.

One session of `benchmarks/proxy_agents.py`'s workload (the same prebuilt bodies: a growing
tool-using history up to each `--contexts` size) runs through the proxy's own code in this
process, everything on one thread so that cProfile sees all of it: the body decoded, parsed by
the OpenAI Chat wire adapter, reconciled, rendered and tokenized (`Capture.turn`, its render
pool run inline), sampled from the fake policy server of `proxy_agents.py` (its own process: its
CPU is not counted) through the real `EmbeddedClient`, answered, and appended durably (fsync)
to a store in a temporary directory. Only the aiohttp server in front of it is left out (about
1 ms a request here, whatever its size: `benchmarks/proxy.py`'s bare hop).

Printed per context: CPU per turn (time.process_time), and the share of the stages that matter.

    python benchmarks/proxy_profile.py                        # 8k, 32k, 80k; ~1 minute
    python benchmarks/proxy_profile.py --contexts 80000 --top 30
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import dataclasses
import json
import os
import pstats
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from agent_upstream import start_upstream  # noqa: E402
from agent_workload import Workload, build_workload  # noqa: E402

# the stages shown, by the function whose cumulative time they are (file suffix, function name)
STAGES = [
    ("decode the body", ("serving.py", "decode_json_text")),
    ("parse the request (wire adapter, tool schemas)", ("openai_chat.py", "parse_request")),
    ("check_fits", ("render.py", "check_fits")),
    ("reconcile the history", ("reconcile.py", "reconcile")),
    ("render: only what is new, else whole", ("extend.py", "prompt_text")),
    ("render: whole (chat template)", ("render.py", "prompt_text")),
    ("segment: prefix check + tokenize the delta", ("segmenter.py", "plan_turn")),
    ("upstream hop, client side (request JSON, reply parse)", ("embedded_client.py", "complete")),
    ("parse the reply", ("capture.py", "_reply")),
    ("stage the turn (validate, convert, number, encode)", ("writer.py", "stage")),
    ("append the turn (durable; on the commit thread, unseen)", ("writer.py", "append")),
    ("record the turn (session state)", ("segmenter.py", "record_turn")),
    ("answer (json.dumps of the response)", ("__init__.py", "dumps")),
]


class Inline(ThreadPoolExecutor):
    """Runs what is submitted at once, on the caller's thread (so cProfile sees it); never starts a thread."""

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting caller
            future.set_exception(exc)
        return future


class Session(NamedTuple):
    """One session through the proxy's code: its calls, their CPU seconds, and the CPU seconds of sealing what it
    wrote into the table (the writer's close)."""

    turns: int
    cpu: float
    seal_cpu: float


async def one_session(model_dir: str, store_dir: str, upstream: str, load: Workload, turns: int,
                      profile: cProfile.Profile | None, *, whole_requests: bool = False) -> Session:
    """`turns` calls of `load` in one session, each handed over as the proxy's chat route does, into a store at
    `store_dir`; `whole_requests`: the proxy's `--whole-requests`."""
    from transformers import AutoTokenizer

    from collectors.policy import EmbeddedClient
    from collectors.proxy.capture import Capture
    from collectors.proxy.render import ChatRenderer
    from collectors.proxy.wire import OpenAIChat
    from collectors.serving import decode_json_text
    from trajstore import open_store

    asyncio.get_running_loop().set_default_executor(Inline())
    writer = open_store(store_dir).writer("profile")
    capture = Capture(EmbeddedClient(upstream), ChatRenderer(AutoTokenizer.from_pretrained(model_dir)), writer,
                      run="profile", max_model_len=1 << 22, default_max_tokens=256, whole_requests=whole_requests)
    capture._render_pool = Inline()  # noqa: SLF001 - one thread, so that the profile sees the renders
    wire = OpenAIChat()
    rollout = await capture.open_rollout(run=None, group_id=None, rollout_id=None, group_size=None, meta=None)
    await capture.turn(rollout, "warm", wire.parse_request(json.loads(load.body(0, 0))), None, wire)  # caches, imports
    cpu = 0.0
    for t in range(turns):
        raw = load.body(t, 1)  # another session's text than the warm call's
        c0 = time.process_time()
        if profile is not None:
            profile.enable()
        body, kept = decode_json_text(raw)  # as the proxy's chat route reads, parses and keeps a call
        req = dataclasses.replace(wire.parse_request(body), body_bytes=len(raw), body_json=kept)
        _, answer = await capture.turn(rollout, "main", req, body, wire)
        json.dumps(answer)
        if profile is not None:
            profile.disable()
        cpu += time.process_time() - c0
    await capture.client.aclose()
    capture.close()
    c0 = time.process_time()
    writer.close()  # seals what it wrote: the proxy's writer does the same every minute or 64 MB while it serves
    return Session(turns, cpu, time.process_time() - c0)


def stage_times(stats: pstats.Stats) -> dict[str, float]:
    got: dict[str, float] = {}
    for (path, _, name), (_, _, _, cum, _) in stats.stats.items():  # type: ignore[attr-defined]
        for label, (suffix, fn) in STAGES:
            if name == fn and path.endswith(suffix) and (fn not in ("loads", "dumps") or "/json/" in path):
                got[label] = got.get(label, 0.0) + cum
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[8000, 32000, 80000])
    ap.add_argument("--turns", type=int, default=40, help="calls of the session (default 40: to the full context)")
    ap.add_argument("--top", type=int, default=0, help="also print the profile's top N functions by own time")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from collectors.model.build import ModelSize, init_model

    with tempfile.TemporaryDirectory(prefix="proxy-profile-") as tmp:
        model_dir = str(Path(tmp) / "model")
        init_model(model_dir, ModelSize(), seed=0)
        tok = AutoTokenizer.from_pretrained(model_dir)
        up_proc, up_conn, upstream = start_upstream(model_dir)
        print(f"one session of {args.turns} calls per context; load average {os.getloadavg()[0]:.1f} (2 shared cores)")
        rows = []
        try:
            for context in args.contexts:
                load = build_workload(tok, context, args.turns, 256)
                plain = asyncio.run(one_session(model_dir, str(Path(tmp) / f"plain-{context}"), upstream, load,
                                                args.turns, None)).cpu
                profile = cProfile.Profile(time.process_time)  # CPU time: the waits for the upstream are not work
                turns, cpu, _ = asyncio.run(one_session(model_dir, str(Path(tmp) / f"store-{context}"), upstream,
                                                        load, args.turns, profile))
                stats = pstats.Stats(profile)
                rows.append((context, load.last_prompt_tokens, 1000 * plain / turns, 1000 * cpu / turns, stats, stage_times(stats), turns))
        finally:
            up_conn.send("stop")
            up_proc.join(30)
    print(f"\n  {'stage (ms per turn, cumulative, under cProfile)':<56}" + "".join(
        f"{f'{c // 1000}k ctx':>10}" for c, *_ in rows))
    print(f"  {'CPU per turn, process_time, no profiler':<56}" + "".join(f"{ms:>10.2f}" for _, _, ms, *_ in rows))
    print(f"  {'CPU per turn, process_time, under cProfile':<56}" + "".join(f"{ms:>10.2f}"
                                                                          for _, _, _, ms, *_ in rows))
    print(f"  {'profiled total':<56}" + "".join(f"{1000 * s.total_tt / n:>10.2f}"  # type: ignore[attr-defined]
                                                 for *_, s, _, n in rows))
    for label, _ in STAGES:
        print(f"  {label:<56}" + "".join(f"{1000 * got.get(label, 0.0) / n:>10.2f}" for *_, got, n in rows))
    print(f"  {'last prompt, tokens':<56}" + "".join(f"{p:>10,}" for _, p, *_ in rows))
    if args.top:
        for context, _, _, _, stats, _, _ in rows:
            print(f"\n--- {context} tokens: top {args.top} by own time ---")
            stats.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
