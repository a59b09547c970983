"""What the rehearsal runs on its hosts besides the real commands: append, watch and check.

    python -m tests.multihost.probe append --store URI --prefix P --count N --ack FILE
        appends N events one by one (the first half `metric`s, the rest `status`es), and logs each
        acknowledged event_id with the time its append returned; killed at any point, the log
        holds exactly what was acknowledged.
    python -m tests.multihost.probe watch --store URI --prefix P --expect N --out FILE
        polls the store as a machine without any live rows sees it, logging when each event of
        P first became visible, and checking that every snapshot holds, per writer, at least
        what the one before held (snapshots only grow).
    python -m tests.multihost.probe check --store URI --run R --max-staleness K
        prints the closed loop's invariants as one JSON object (tests/multihost/test_rehearsal.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import trajstore
from tests.ledger import ledger_problems


def append(a: argparse.Namespace) -> None:
    store = trajstore.open_store(a.store)
    store.seal_orphans()  # what an earlier, killed run of this machine acknowledged (as `collect` does)
    with store.writer(seal_interval=a.seal_interval) as writer, open(a.ack, "a") as log:
        for i in range(a.count):
            eid = f"{a.prefix}-{os.getpid()}-{i}"
            if i >= a.count // 2:  # the first half: metrics, sealed by the interval; then statuses, sealed at once
                event = {"kind": "status", "run": a.prefix, "group_id": "g", "rollout_id": eid, "status": "completed"}
            else:
                event = {"kind": "metric", "run": a.prefix, "step": i, "metrics": {"i": float(i)}}
            writer.append([{**event, "event_id": eid}])
            log.write(json.dumps({"id": eid, "kind": event["kind"], "t": time.time(), "writer": writer.name}) + "\n")
            log.flush()
            time.sleep(a.every)


def watch(a: argparse.Namespace) -> None:
    deadline = time.monotonic() + a.timeout
    while True:  # the store may not be created yet
        try:
            store = trajstore.open_store(a.store, create=False)
            break
        except trajstore.StoreNotFoundError:
            if time.monotonic() > deadline:
                raise
            time.sleep(a.poll)
    seen: dict[str, float] = {}
    high: dict[str, int] = {}
    shrank: list[str] = []
    version = -1
    snapshots = 0
    while len(seen) < a.expect and time.monotonic() < deadline and not (a.stop and os.path.exists(a.stop)):
        with store.snapshot() as snap:
            snapshots += 1
            now = time.time()
            if snap.table_version < version:
                shrank.append(f"table version went back from {version} to {snap.table_version}")
            version = snap.table_version
            counts = snap.query("SELECT writer, count(*) AS n, list(event_id) FILTER (WHERE starts_with(event_id, ?)) "
                                "AS ids FROM events GROUP BY writer", [a.prefix + "-"]).to_pylist()  # one scan
        for row in counts:
            if row["n"] < high.get(row["writer"], 0):
                shrank.append(f"writer {row['writer']}: {high[row['writer']]} events, then {row['n']}")
            high[row["writer"]] = max(row["n"], high.get(row["writer"], 0))
            for eid in row["ids"] or ():
                seen.setdefault(eid, now)
        time.sleep(a.poll)
    with open(a.out, "w") as f:
        json.dump({"seen": seen, "shrank": shrank, "table_version": version, "snapshots": snapshots}, f)


def check(a: argparse.Namespace) -> None:
    store = trajstore.open_store(a.store, create=False)
    q = lambda sql, *params: store.query(sql, list(params)).to_pylist()
    raw = q("SELECT count(*) AS n, count(DISTINCT event_id) AS ids FROM _raw")[0]
    writers = q("SELECT writer, count(*) AS n, min(writer_seq) AS lo, max(writer_seq) AS hi, "
                "count(DISTINCT writer_seq) AS seqs FROM events GROUP BY writer ORDER BY writer")
    versions = [r["version"] for r in q("SELECT DISTINCT version FROM checkpoints WHERE run = ? ORDER BY version", a.run)]
    consumed = q("SELECT version, rollout_id FROM consumed WHERE run = ?", a.run)
    per_rollout: dict[str, list[int]] = {}
    for row in consumed:
        per_rollout.setdefault(row["rollout_id"], []).append(row["version"])
    # a version v is trained at v - 1: its rollouts' oldest tokens must be at most K versions older
    stale = q("SELECT c.version, c.rollout_id, r.min_version FROM consumed c JOIN rollouts r USING (rollout_id) "
              "WHERE c.run = ? AND (c.version - 1) - r.min_version > ?", a.run, a.max_staleness)
    unknown = q("SELECT count(*) AS n FROM consumed WHERE run = ? AND rollout_id NOT IN (SELECT rollout_id "
                "FROM rollouts)", a.run)[0]["n"]
    sampled = q("SELECT writer, min(policy_version) AS lo, max(policy_version) AS hi, count(*) AS turns FROM turns "
                "WHERE run = ? GROUP BY writer ORDER BY writer", a.run)
    groups = q("SELECT count(*) AS groups, count(*) FILTER (WHERE complete) AS complete FROM groups WHERE run = ?",
               a.run)[0]
    ledger, ledger_problems_found = ledger_problems(store, a.run)
    snap = store.table.snapshot()
    json.dump({"ledger": ledger, "ledger_problems": ledger_problems_found, "table_version": snap.version, "sealed_files": len(snap.files), "groups": groups, "sampled_versions": sampled, "raw_rows": raw["n"], "distinct_ids": raw["ids"], "writers": writers, "versions": versions,
               "consumed_twice": {r: v for r, v in per_rollout.items() if len(v) > 1},
               "consumed": len(per_rollout), "stale": stale, "unknown_consumed": unknown,
               "live_rows": sum(len(b) for b in store.live().by_writer.values())}, sys.stdout, default=str)
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("append")
    p.add_argument("--store", required=True)
    p.add_argument("--prefix", required=True)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--every", type=float, default=0.05)
    p.add_argument("--seal-interval", type=float, default=1.0)
    p.add_argument("--ack", required=True)
    p = sub.add_parser("watch")
    p.add_argument("--store", required=True)
    p.add_argument("--prefix", required=True)
    p.add_argument("--expect", type=int, required=True)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--out", required=True)
    p.add_argument("--stop", help="stop watching once this file exists")
    p.add_argument("--poll", type=float, default=0.1, help="seconds between snapshots")
    p = sub.add_parser("check")
    p.add_argument("--store", required=True)
    p.add_argument("--run", required=True)
    p.add_argument("--max-staleness", type=int, required=True)
    a = ap.parse_args()
    {"append": append, "watch": watch, "check": check}[a.cmd](a)


if __name__ == "__main__":
    main()
