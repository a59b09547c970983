"""Page response times of `trajstore view` on the generated stores of benchmarks/shard.py, against a baseline.

The stores are the shard benchmark's (generated once into benchmarks/.data/, reused): groups of
8 rollouts, 2-4 turns each, policy versions rising every 1,024 rollouts, ~5 events per rollout,
sealed as 4 files per version (10k rollouts: 40 files; 100k: 392 files, 0.21 GB).

Viewer: `trajstore view` in its own process; each page fetched over HTTP on loopback (the whole
response, HTML or JSON), round robin over the pages, median of --repeats.
Baseline: the same answer from the store without the viewer's pruning, i.e. the same SQL over
the views of the whole latest version (`Store.query`, what `trajstore query` runs; for an episode,
the rollout's turns and events, as `trajstore replay` read them before the viewer). Both sides
pin the latest version per request.

The runs page aggregates every rollout of every run by definition (reward by policy version); it
is cached per table version, so it is timed twice: after an empty commit moved the table on (a
new version, as a live run makes every few seconds: "cold") and again at the same version.

    python benchmarks/view.py                      # 10k and 100k rollouts (first run generates them: ~1 min)
    python benchmarks/view.py --sizes 100000 --repeats 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import shard as shard_bench  # noqa: E402  (the generated stores)

import trajstore  # noqa: E402
from collectors.children import spawn_child  # noqa: E402
from collectors.viewer.listing import ROW_SQL  # noqa: E402

EPISODE_TURNS = ("SELECT run, group_id, session_id, segment_id, turn_index, policy_version, prompt_ids, output_ids, "
                 "output_logprobs, output_mask, finish_reason, sampling, request, response, meta FROM turns "
                 "WHERE rollout_id = ? ORDER BY time, turn_index")
EPISODE_EVENTS = ("SELECT kind, reward, reward_name, segment_id, status, error, meta FROM events WHERE rollout_id = ? "
                  "AND kind IN ('reward', 'status') ORDER BY time, writer, writer_seq")


def start_viewer(store: Path) -> tuple[subprocess.Popen[str], str]:
    proc = spawn_child([sys.executable, "-m", "cli.main", "view", "--store", str(store), "--port", "0"],
                            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent)
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if "http://" not in line:
        proc.kill()
        raise RuntimeError(f"trajstore view did not start: {line!r}")
    return proc, line.split("view: ", 1)[1].split("/ ", 1)[0]


def fetch(url: str) -> float:
    t0 = time.perf_counter()
    with urllib.request.urlopen(url, timeout=600) as reply:
        reply.read()
        assert reply.status == 200
    return time.perf_counter() - t0


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def pages(store: trajstore.Store, versions: int) -> list[tuple[str, str, Callable[[], Any]]]:
    """(name, viewer path, baseline) for each page measured."""
    newest = store.query(ROW_SQL + " ORDER BY started DESC, rollout_id DESC LIMIT 50").to_pylist()
    last = newest[-1]
    rid, gid = newest[0]["rollout_id"], newest[0]["group_id"]
    mid = versions // 2
    after = f"{last['started'].isoformat()}|{last['rollout_id']}".replace("+", "%2B").replace("|", "%7C")

    def q(sql: str, params: Any = None) -> Callable[[], Any]:
        return lambda: store.query(sql, params)

    def episode() -> None:
        store.query(EPISODE_TURNS, [rid])
        store.query(EPISODE_EVENTS, [rid])

    return [
        ("rollouts: newest 50", "/rollouts", q(ROW_SQL + " ORDER BY started DESC, rollout_id DESC LIMIT 50")),
        ("rollouts: next 50 (cursor)", f"/rollouts?after={after}",
         q(ROW_SQL + " ORDER BY started DESC, rollout_id DESC LIMIT 50 OFFSET 50")),
        (f"rollouts: version {mid}, lowest reward", f"/rollouts?vmin={mid}&vmax={mid}&order=reward_asc",
         q(ROW_SQL + " WHERE r.min_version = $v ORDER BY reward, rollout_id LIMIT 50", {"v": mid})),
        ("rollouts: one group", f"/rollouts?group={gid}", q(ROW_SQL + " WHERE r.group_id = $g", {"g": gid})),
        ("episode page (text view)", f"/rollouts/{rid}", episode),
        ("episode tokens (JSON)", f"/api/rollouts/{rid}/tokens", episode),
        ("group page", f"/groups/{gid}",
         q("SELECT * FROM advantages a JOIN rollouts r USING (rollout_id) WHERE r.group_id = $g", {"g": gid})),
        ("rollouts: lowest reward, no filter (whole store)", "/rollouts?order=reward_asc",
         q(ROW_SQL + " ORDER BY reward, rollout_id LIMIT 50")),
        ("rollouts: status failed (none: reads all)", "/rollouts?status=failed",
         q(ROW_SQL + " WHERE r.status = 'failed' ORDER BY started DESC LIMIT 50")),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000], help="store sizes in rollouts")
    ap.add_argument("--repeats", type=int, default=5, help="timed fetches per page; the median counts (default 5)")
    ap.add_argument("--dir", type=Path, default=Path(__file__).parent / ".data", help="where the stores live")
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start "
          "(other processes inflate wall times)")
    for size in args.sizes:
        path, versions = shard_bench.ensure_store(args.dir, size)
        store = trajstore.open_store(path, create=False)
        files = len(store.table.snapshot().files)
        proc, url = start_viewer(path)
        try:
            measured = pages(store, versions)
            first = {name: fetch(url + p) for name, p, _ in measured}  # cold: footers checked, caches empty
            view: dict[str, list[float]] = {name: [] for name, _, _ in measured}
            base: dict[str, list[float]] = {name: [] for name, _, _ in measured}
            runs_cold, runs_warm, runs_base = [], [], []
            for _ in range(args.repeats):
                for name, p, baseline in measured:
                    view[name].append(fetch(url + p))
                    base[name].append(timed(baseline))
                store.table.commit([], operation="bench-tick")  # a new table version: the runs page recomputes
                runs_cold.append(fetch(url + "/"))
                runs_warm.append(fetch(url + "/"))
                runs_base.append(timed(lambda: store.query(
                    "SELECT run, min_version, count(*), avg(reward) FILTER (WHERE trainable) FROM rollouts "
                    "GROUP BY ALL")))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        print(f"\n{versions * shard_bench.ROLLOUTS_PER_VERSION:,} rollouts, {files} sealed files; median of "
              f"{args.repeats}, seconds")
        print(f"  {'page':<50} {'viewer':>8} {'1st call':>9} {'baseline':>9} {'speedup':>8}")
        for name, _, _ in measured:
            v, b = statistics.median(view[name]), statistics.median(base[name])
            print(f"  {name:<50} {v:>8.3f} {first[name]:>9.3f} {b:>9.3f} {b / v:>7.1f}x")
        c, w, b = (statistics.median(x) for x in (runs_cold, runs_warm, runs_base))
        print(f"  {'runs page, new table version':<50} {c:>8.3f} {'':>9} {b:>9.3f} {b / c:>7.1f}x")
        print(f"  {'runs page, same version (cached)':<50} {w:>8.3f} {'':>9} {b:>9.3f} {b / w:>7.1f}x")


if __name__ == "__main__":
    main()
