"""S3 requests and wall time of the store's reads as the number of sealed files grows, on moto.

A store of N small sealed files (one rollout each: turns, rewards, status; a checkpoint every
50 files) is built on the project's moto S3 server (`tests/moto_s3.py`, which counts requests
per store prefix), then each read is measured in its own fresh process:

- poll: a follower (`Store.follower()`, what `collect`'s poller uses) that has read the store
  once polls again with nothing new: the collector's two poll queries (head, groups)
- poll-old (--old): the same two queries over a fresh `store.snapshot()`, the poller before,
  in the same process after a warm-up
- newest: the newest 100 events in a fresh process on a fresh host (empty file cache):
  `trajstore query --newest 100 "SELECT ... FROM events ORDER BY time DESC"`
- newest-old (--old): the same SQL with `LIMIT 100` over the whole store, fresh host
- plan: a learner step's shard planning (`store.shard(...)` at the newest policy version,
  max_staleness 2) in a fresh process: on a fresh host (cold), again on the same host (warm:
  the file cache holds the files), and on a local-disk copy of the store

Wall times are on moto on loopback on a shared, loaded 2-core machine: compare within a column.

    python benchmarks/store_reads.py                     # 200, 1,000 and 3,000 files
    python benchmarks/store_reads.py --sizes 200,1000 --old   # also the old full-scan paths
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import trajstore  # noqa: E402
from tests.conftest import store_requests  # noqa: E402
from trajstore.events import to_columns  # noqa: E402
from trajstore.schema import EVENT_SCHEMA  # noqa: E402
from trajstore.synth import generate_run  # noqa: E402

COMMIT_FILES = 50  # files added per commit while building (a real run commits one per seal)
NEWEST_SQL = "SELECT event_id, kind, time, rollout_id FROM events ORDER BY time DESC"


def start_moto() -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "tests.moto_s3", "--exit-on-eof"], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    endpoint = proc.stdout.readline().strip()  # type: ignore[union-attr]
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_REGION="us-east-1")
    import boto3

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
    return proc, endpoint


def file_events(i: int, start: datetime) -> list[dict[str, Any]]:
    """One sealed file's events: one rollout of a group of one (and a checkpoint every 50 files)."""
    events = generate_run(run="bench", groups=1, group_size=1, versions=1, seed=i,
                          start=start + timedelta(seconds=10 * i))
    for e in events:
        e["group_id"], e["rollout_id"] = f"g{i:05d}", f"g{i:05d}-r0"
        e["policy_version"] = i // 50 if e["kind"] == "turn" else None
        e["event_id"] = f"e{i:05d}-{events.index(e)}"
    if i % 50 == 49:
        events.append(dict(kind="checkpoint", run="bench", policy_version=i // 50 + 1, step=i // 50 + 1,
                           time=(start + timedelta(seconds=10 * i + 5)).isoformat(), event_id=f"ck{i:05d}"))
    return events


def build(uri: str, n: int) -> None:
    """A store of `n` sealed files, written 8 at a time and committed `COMMIT_FILES` at a time."""
    import pyarrow as pa

    store = trajstore.open_store(uri)
    start = datetime(2026, 1, 1, tzinfo=timezone.utc)

    def write(i: int) -> Any:
        cols = to_columns(file_events(i, start))
        k = len(cols["event_id"])
        cols.update(writer=pa.array(["bench"] * k), writer_epoch=pa.array([0] * k, pa.int64()),
                    writer_seq=pa.array(range(10 * i, 10 * i + k), pa.int64()))
        data = pa.table({f.name: cols[f.name] for f in EVENT_SCHEMA}, schema=EVENT_SCHEMA)
        return store.table.write_file(data, prefix="bench")

    with ThreadPoolExecutor(8) as pool:
        for first in range(0, n, COMMIT_FILES):
            store.table.commit(list(pool.map(write, range(first, min(n, first + COMMIT_FILES)))), operation="seal")
    store.table.current().create_checkpoint()  # as `compact --follow` leaves the log after its passes


def measure(uri: str, what: str, cache: str) -> dict[str, float]:
    """Run one read in a fresh process with the sealed-file cache at `cache`; its S3 requests and wall time."""
    out = subprocess.run([sys.executable, __file__, "--child", what, "--uri", uri], cwd=ROOT, check=True,
                         capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "TRAJSTORE_FILE_CACHE": cache})
    return json.loads(out.stdout.strip().splitlines()[-1])


def child(what: str, uri: str) -> None:
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    store = trajstore.open_store(uri, create=False)

    def timed(call: Any) -> dict[str, float]:
        before = store_requests(endpoint, uri) if uri.startswith("s3://") else 0
        t0 = time.perf_counter()
        call()
        wall = time.perf_counter() - t0
        after = store_requests(endpoint, uri) if uri.startswith("s3://") else 0
        return {"requests": after - before, "wall_s": wall}

    from collectors.collect.admission import read_group_rows
    from collectors.collect.reload import read_head

    if what in ("poll", "poll-old"):
        source = store.follower() if what == "poll" else store  # the follower, or a fresh snapshot per poll

        def poll() -> None:
            with source.snapshot() as snap:
                read_head(snap, "bench")
                read_group_rows(snap, "bench")
        poll()
        result = timed(poll)
    elif what == "newest":
        result = timed(lambda: store.query(NEWEST_SQL, scope=trajstore.Scope(newest=100)))
    elif what == "newest-old":
        result = timed(lambda: store.query(NEWEST_SQL + " LIMIT 100"))
    elif what == "plan":
        version = len(store.table.snapshot().files) // 50  # the newest checkpoint (file_events), read from no file
        result = timed(lambda: store.shard(policy_version=version, max_staleness=2, max_rollouts=64, run="bench"))
    else:
        raise SystemExit(f"unknown read {what}")
    print(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="200,1000,3000")
    ap.add_argument("--old", action="store_true", help="also measure the old full-scan poll")
    ap.add_argument("--child")
    ap.add_argument("--uri")
    args = ap.parse_args()
    if args.child:
        child(args.child, args.uri)
        return
    proc, _ = start_moto()
    try:
        rows = []
        for n in (int(s) for s in args.sizes.split(",")):
            uri = f"s3://bench/n{n}"
            local = tempfile.mkdtemp(prefix=f"store-reads-{n}-")
            t0 = time.perf_counter()
            build(uri, n)
            build(local, n)
            print(f"built {n} files in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
            row: dict[str, Any] = {"files": n}
            warm = tempfile.mkdtemp(prefix="store-reads-cache-")
            reads = [("poll", uri, "poll", None), ("newest", uri, "newest", None)]
            if args.old:
                reads = [("poll-old", uri, "poll-old", None), ("newest-old", uri, "newest-old", None)] + reads
            reads += [("plan (S3, cold)", uri, "plan", warm), ("plan (S3, warm)", uri, "plan", warm),
                      ("plan (local disk)", local, "plan", None)]
            for label, where, what, cache in reads:
                row[label] = measure(where, what, cache or tempfile.mkdtemp(prefix="store-reads-cache-"))
                print(label, row[label], file=sys.stderr, flush=True)
            rows.append(row)
        print_table(rows)
    finally:
        proc.stdin.close()  # type: ignore[union-attr]
        proc.wait(timeout=10)


def print_table(rows: list[dict[str, Any]]) -> None:
    keys = [k for k in rows[0] if k != "files"]
    print("| read | " + " | ".join(f"{r['files']:,} files" for r in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for k in keys:
        print(f"| {k}: S3 requests | " + " | ".join(str(int(r[k]["requests"])) for r in rows) + " |")
        print(f"| {k}: wall s | " + " | ".join(f"{r[k]['wall_s']:.2f}" for r in rows) + " |")


if __name__ == "__main__":
    main()
