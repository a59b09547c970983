"""Over-collection: how many groups are never trained when 1, 2 or 3 collectors feed one learner.

One store, one embedded policy server (a tiny model made by `trajstore init-model`, in this
process, started afresh for each trial), a learner stand-in and C collectors (`collectors.collect.runner.collect`, each with
its own capture proxy, `--forever` over the same tasks, n = 4, `--max-staleness K`). The learner
trains like `trajstore learn`: each step takes the next G complete, fresh, unconsumed groups
(`Store.shard` with its staleness rule), "trains" for `--step-s` seconds and publishes the next
version (a checkpoint event naming the same weights and the groups it consumed), which the
collectors load. After `--seconds` everything stops and the store is read:

- groups: every group the collectors started;
- trained: groups a checkpoint consumed;
- never trained: the rest, split into those already too stale for the learner (more than K
  versions behind it: they can never be trained) and those still fresh (the learner could
  still take them, up to (K + 1) * G by the admission rule, plus the ones in flight).

    python benchmarks/overcollect.py                     # about 3 minutes on 2 shared CPU cores
    python benchmarks/overcollect.py --collectors 1,3 --seconds 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
N, G, K = 4, 2, 1


def reward(task: dict[str, Any], result: Any, rollout: Any) -> float:
    """Half the slots score 1: every group has a spread, as a learner wants."""
    return float(rollout.slot % 2)


async def learner(store: Any, run: str, model: Path, step_s: float, done: asyncio.Event) -> int:
    """`trajstore learn`'s consumption without the training: G groups per step, published as the next version."""
    from trajstore import Checkpoint

    version = 0
    with store.writer(f"learner-{run}") as writer:
        writer.append([Checkpoint(run=run, policy_version=0, step=0, event_id=f"checkpoint:{run}:0",
                                  meta={"path": str(model), "groups_per_version": G, "max_staleness": K})])
        while not done.is_set():
            shard = await asyncio.to_thread(store.shard, policy_version=version, max_staleness=K, run=run,
                                            max_groups=G, max_rollouts=1 << 20)
            if len(shard.group_ids) < G:
                await asyncio.sleep(0.2)
                continue
            await asyncio.sleep(step_s)  # the training step
            version += 1
            await asyncio.to_thread(writer.append, [Checkpoint(
                run=run, policy_version=version, step=version, consumed=list(shard.rollout_ids),
                event_id=f"checkpoint:{run}:{version}",
                meta={"path": str(model), "groups_per_version": G, "max_staleness": K})])
    return version


def count(store: Any, run: str, version: int) -> dict[str, int]:
    row = store.query("""
        WITH g AS (SELECT group_id, min(min_version) AS oldest,
                          bool_or(rollout_id IN (SELECT rollout_id FROM consumed WHERE run = $run)) AS trained
                   FROM rollouts WHERE run = $run GROUP BY group_id)
        SELECT count(*) AS groups, count(*) FILTER (WHERE trained) AS trained,
               count(*) FILTER (WHERE NOT trained AND oldest < $floor) AS stale,
               count(*) FILTER (WHERE NOT trained AND (oldest IS NULL OR oldest >= $floor)) AS fresh
        FROM g""", {"run": run, "floor": version - K}).to_pylist()[0]
    return {k: int(v or 0) for k, v in row.items()}


async def trial(root: Path, model: Path, url: str, collectors: int, seconds: float, step_s: float) -> dict[str, Any]:
    from collectors.collect.runner import collect
    from collectors.collect.settings import CollectSettings
    from trajstore import open_store

    run = f"c{collectors}"
    store = open_store(root / run)
    tasks = root / "tasks.jsonl"
    stop, done = asyncio.Event(), asyncio.Event()
    learning = asyncio.create_task(learner(store, run, model, step_s, done))
    runs = [asyncio.create_task(collect(CollectSettings(
        store=str(root / run), run=run, tasks=str(tasks), n=N, server=url, model=str(model), concurrency=4,
        max_tokens=8, forever=True, max_staleness=K, agent=None, reward="benchmarks.overcollect:reward",
        display="off", poll_interval_s=0.5, rollout_timeout=60, workdir=str(root / f"work-{run}-{i}")), stop=stop))
        for i in range(collectors)]
    await asyncio.sleep(seconds)
    stop.set()
    await asyncio.gather(*runs)
    done.set()
    version = await learning
    return {"collectors": collectors, "versions": version, **count(store, run, version)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--collectors", default="1,2,3", help="comma-separated collector counts")
    parser.add_argument("--seconds", type=float, default=45.0, help="seconds each trial collects")
    parser.add_argument("--step-s", type=float, default=1.0, help="seconds one learner step takes")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="trajstore-overcollect-"))
    model = root / "model"
    subprocess.run([sys.executable, "-m", "cli.main", "init-model", str(model), "--vocab-size", "2048",
                    "--heads", "4", "--kv-heads", "2", "--intermediate-size", "128", "--max-positions", "2048"],
                   cwd=REPO, check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    (root / "tasks.jsonl").write_text("".join(json.dumps({"id": f"t{i}", "prompt": f"task {i}"}) + "\n"
                                              for i in range(50)))
    from collectors.embedded.app import serve_in_thread

    print(f"G = {G} groups per version, K = {K}, n = {N}, {args.seconds:g} s per trial, learner step "
          f"{args.step_s:g} s (loaded machine)")
    print("collectors  versions  groups  trained  never trained (too stale + still fresh)  share never trained")
    for c in (int(x) for x in args.collectors.split(",")):
        with serve_in_thread(model, threads=1, max_batch=16, device="cpu") as server:  # each trial from version 0
            r = asyncio.run(trial(root, model, server.url, c, args.seconds, args.step_s))
            never = r["stale"] + r["fresh"]
            print(f"{c:10d}  {r['versions']:8d}  {r['groups']:6d}  {r['trained']:7d}  {never:6d} ({r['stale']} + "
                  f"{r['fresh']}){'':22s}{never / max(r['groups'], 1):.0%}", flush=True)


if __name__ == "__main__":
    main()
