"""A long run on object storage, simulated: writers appending and sealing against moto while a
compactor keeps the file count bounded and a reader on another host polls.

- W writer processes (default 16), each appending one rollout (a turn, a reward, a status) every
  `--append-every` seconds and sealing every `--seal-every` seconds (its writer's seal interval);
- one `trajstore compact --follow`-style compactor (`compact_follow`, min 16 small files, every 10 s);
- one reader on another host (its own spool: sealed rows only) polling with a `Follower` every
  second: S3 requests and wall time of each poll (counted by tests/moto_s3.py per store), the
  sealed file count, and for each event it sees first, append-to-visible latency (poll time minus
  the event's time).

Writers report Delta commit conflicts (commits retried because another writer won the version).
Everything runs on one machine against moto on loopback: on a shared, loaded machine the
absolute latencies include CPU contention between the writers, moto and the reader.

    python benchmarks/store_longrun.py                              # 16 writers, 10 minutes
    python benchmarks/store_longrun.py --writers 8 --minutes 3      # what fits a loaded 2-core box
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import trajstore  # noqa: E402
from store_reads import start_moto  # noqa: E402
from tests.conftest import store_requests  # noqa: E402


def writer_main(uri: str, name: str, seconds: float, append_every: float, seal_every: float, out: str) -> None:
    store = trajstore.open_store(uri)
    appended = 0
    deadline = time.monotonic() + seconds
    with store.writer(name, seal_interval=seal_every) as writer:
        while time.monotonic() < deadline:
            rid = f"{name}-r{appended}"
            common = {"run": "longrun", "group_id": rid, "rollout_id": rid}
            writer.append([
                {**common, "kind": "turn", "segment_id": f"{rid}-s0", "turn_index": 0, "policy_version": 0,
                 "prompt_ids": list(range(64)), "output_ids": list(range(48)), "output_logprobs": [-0.5] * 48},
                {**common, "kind": "reward", "reward": 1.0},
                {**common, "kind": "status", "status": "completed", "group_size": 1},
            ])
            appended += 1
            time.sleep(append_every)
    Path(out).write_text(json.dumps({"writer": name, "appended": appended, "conflicts": store.table.conflicts}))


def compactor_main(uri: str, seconds: float, out: str) -> None:
    from trajstore.maintenance import CompactPolicy, compact_follow

    store = trajstore.open_store(uri, create=False)
    policy = CompactPolicy(every_s=10.0, min_files=16)
    merges: list[dict[str, float]] = []
    start = time.monotonic()
    passes = int(seconds // policy.every_s)
    compact_follow(store.location, store.table, policy, passes=passes, report=lambda r: merges.append(
        {"t": round(time.monotonic() - start, 1), "before": r.files_before, "after": r.files_after}))
    Path(out).write_text(json.dumps({"merges": merges, "conflicts": store.table.conflicts}))


def reader_main(uri: str, seconds: float, out: str) -> None:
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    store = trajstore.open_store(uri, create=False, spool=tempfile.mkdtemp(prefix="longrun-reader-spool-"))
    follower = store.follower()
    seen: set[str] = set()
    latencies: list[float] = []
    polls = []
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        before = store_requests(endpoint, uri)
        t0 = time.perf_counter()
        with follower.snapshot() as snap:
            rows = snap.query("SELECT event_id, time FROM events WHERE kind = 'status'").to_pylist()
            files = len(snap.pinned.table.files)
        wall = time.perf_counter() - t0
        now = datetime.now(timezone.utc)
        for r in rows:
            if r["event_id"] not in seen:
                seen.add(r["event_id"])
                if polls:  # events already there at the first poll have no first-seen time
                    latencies.append((now - r["time"]).total_seconds())
        polls.append({"t": round(time.monotonic() - start, 1), "requests": store_requests(endpoint, uri) - before,
                      "wall_s": round(wall, 3), "files": files, "events_seen": len(seen)})
        time.sleep(max(0.0, 1.0 - wall))
    Path(out).write_text(json.dumps({"polls": polls, "latencies": latencies}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--writers", type=int, default=16)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--append-every", type=float, default=1.0)
    ap.add_argument("--seal-every", type=float, default=3.0)
    ap.add_argument("--role", choices=["writer", "compactor", "reader"])
    ap.add_argument("--uri")
    ap.add_argument("--name")
    ap.add_argument("--out")
    args = ap.parse_args()
    seconds = args.minutes * 60
    if args.role == "writer":
        return writer_main(args.uri, args.name, seconds, args.append_every, args.seal_every, args.out)
    if args.role == "compactor":
        return compactor_main(args.uri, seconds, args.out)
    if args.role == "reader":
        return reader_main(args.uri, seconds, args.out)
    proc, _ = start_moto()
    work = Path(tempfile.mkdtemp(prefix="store-longrun-"))
    uri = "s3://bench/longrun"
    trajstore.open_store(uri)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRAJSTORE_SPOOL": str(work / "spool"),
           "TRAJSTORE_FILE_CACHE": str(work / "cache")}
    me = [sys.executable, __file__, "--uri", uri, "--minutes", str(args.minutes), "--append-every",
          str(args.append_every), "--seal-every", str(args.seal_every)]
    children = [subprocess.Popen(me + ["--role", "writer", "--name", f"w{i:02d}", "--out", str(work / f"w{i}.json")],
                                 env=env, cwd=ROOT) for i in range(args.writers)]
    children.append(subprocess.Popen(me + ["--role", "compactor", "--out", str(work / "compactor.json")], env=env, cwd=ROOT))
    children.append(subprocess.Popen(me + ["--role", "reader", "--out", str(work / "reader.json")], env=env, cwd=ROOT))
    try:
        for child in children:
            child.wait(timeout=seconds + 300)
    finally:
        proc.stdin.close()  # type: ignore[union-attr]
        proc.wait(timeout=10)
    writers = [json.loads((work / f"w{i}.json").read_text()) for i in range(args.writers)]
    compactor = json.loads((work / "compactor.json").read_text())
    reader = json.loads((work / "reader.json").read_text())
    report(args, writers, compactor, reader)


def report(args: argparse.Namespace, writers: list[dict], compactor: dict, reader: dict) -> None:
    lat = sorted(reader["latencies"])
    pct = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] if lat else float("nan")  # noqa: E731
    print(f"{args.writers} writers, {args.minutes:g} min, append every {args.append_every:g} s, seal every "
          f"{args.seal_every:g} s: {sum(w['appended'] for w in writers)} rollouts appended")
    print(f"commit conflicts (retried commits): writers {sum(w['conflicts'] for w in writers)}, "
          f"compactor {compactor['conflicts']}; merges {len(compactor['merges'])}")
    print(f"append-to-visible latency (reader on another host, 1 s polls): p50 {pct(0.5):.1f} s, "
          f"p99 {pct(0.99):.1f} s over {len(lat)} rollouts")
    print("| minute | sealed files (max) | poll requests (median) | poll wall s (median) |")
    print("|---|---|---|---|")
    polls = reader["polls"]
    for m in range(int(args.minutes + 0.999)):
        these = [p for p in polls if m * 60 <= p["t"] < (m + 1) * 60]
        if these:
            print(f"| {m + 1} | {max(p['files'] for p in these)} | {statistics.median(p['requests'] for p in these):.0f} "
                  f"| {statistics.median(p['wall_s'] for p in these):.2f} |")


if __name__ == "__main__":
    main()
