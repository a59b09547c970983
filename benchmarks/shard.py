"""Time to cut a 512-rollout training shard (GRPO advantages) as the store grows: 10k, 100k, 1M rollouts.

Each store is generated once into benchmarks/.data/shard-<size>/ and reused (10k: ~8 s,
100k: ~1 min, 1M: ~11 min and 2 GB on 2 busy cores). It looks like a run that has been
going for a while: groups of 8 rollouts, 2-4 tool-calling turns each (32 prompt + 64
output tokens per turn, with logprobs), a reward and a completed status per rollout. The policy version rises every 1,024 rollouts (two learner steps of 512); each
version's events are sealed as 3 collector files plus 1 learner file holding the
checkpoint event, which consumes the rollouts of the version before (the learner runs one
version behind), so everything but the latest 1,024 rollouts is consumed. Ids come from
`trajstore.ids.new_id` as a writer would mint them. To be quick, generation skips the
write-ahead log and writes the sealed Parquet files directly (`Table.write_file` +
`Table.commit`, several versions per Delta commit); the planner sees the same files and
statistics a sealing writer would leave.

The timed call is what a learner does every step:
`store.shard(policy_version=<latest>, max_staleness=2, max_rollouts=512, estimator="grpo")`
on an open store. Before each timed call an empty commit (not timed) moves the table to a new
version, so every call lists the table's files afresh, as it must while collectors keep
sealing. The first, cold call is printed apart: it reads the Delta log and every file's
statistics.

    python benchmarks/shard.py                          # 10k, 100k, 1M (first run: ~12 min to generate)
    python benchmarks/shard.py --sizes 10000 100000     # skip the 1M store (~1 min to generate)
    python benchmarks/shard.py --quick                  # 10k and 100k, 3 repeats
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

import trajstore
from trajstore import ids
from trajstore.schema import EVENT_SCHEMA

GROUP = 8
ROLLOUTS_PER_VERSION = 1024
COLLECTORS = 3
PROMPT, OUTPUT, VOCAB = 32, 64, 32_000
VERSIONS_PER_COMMIT = 8
FORMAT = 1  # bump when the generated layout changes, so old stores are regenerated
START = datetime(2026, 1, 1, tzinfo=timezone.utc)


# ---------------------------------------------------------------- generation


def _list(flat: np.ndarray, lengths: np.ndarray, typ: pa.DataType, valid: np.ndarray) -> pa.Array:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat), type=typ, mask=pa.array(~valid))


def _table(cols: dict[str, Any], n: int) -> pa.Table:
    """A table of the event schema from the given columns; the rest are null."""
    arrays = []
    for field in EVENT_SCHEMA:
        value = cols.get(field.name)
        if value is None:
            arrays.append(pa.nulls(n, field.type))
        elif isinstance(value, pa.Array):
            arrays.append(value)
        else:
            arrays.append(pa.array(value, type=field.type))
    return pa.Table.from_arrays(arrays, schema=EVENT_SCHEMA)


def collector_file(rng: np.random.Generator, version: int, groups: list[str], rollouts: list[list[str]],
                   writer: str, seq0: int, clock: datetime) -> pa.Table:
    """The events one collector sealed for its groups: turns, then a reward and a status per rollout."""
    kind, group_col, rollout_col, session, segment, turn_index, finish, when = ([] for _ in range(8))
    reward, reward_name, status, group_size = [], [], [], []
    t = clock
    for g, members in zip(groups, rollouts):
        skill = rng.random()
        for r in members:
            n_turns = int(rng.integers(2, 5))
            for k in range(n_turns):
                t += timedelta(milliseconds=int(rng.integers(5, 40)))
                kind.append("turn"); group_col.append(g); rollout_col.append(r)
                session.append(f"{r}-main"); segment.append(f"{r}-s0"); turn_index.append(k)
                finish.append("stop" if k == n_turns - 1 else "tool_calls"); when.append(t)
                reward.append(None); reward_name.append(None); status.append(None); group_size.append(None)
            for ev in ("reward", "status"):
                t += timedelta(milliseconds=1)
                kind.append(ev); group_col.append(g); rollout_col.append(r)
                session.append(None); segment.append(None); turn_index.append(None)
                finish.append(None); when.append(t)
                reward.append(float(rng.random() < skill) if ev == "reward" else None)
                reward_name.append("correct" if ev == "reward" else None)
                status.append("completed" if ev == "status" else None)
                group_size.append(GROUP if ev == "status" else None)
    n = len(kind)
    is_turn = np.array([k == "turn" for k in kind])
    n_turns = int(is_turn.sum())
    p_len = np.where(is_turn, PROMPT, 0)
    o_len = np.where(is_turn, OUTPUT, 0)
    cols = {
        "event_id": [ids.new_id() for _ in range(n)],
        "kind": kind, "time": when, "writer": [writer] * n,
        "writer_epoch": np.ones(n, dtype=np.int64), "writer_seq": np.arange(seq0, seq0 + n, dtype=np.int64),
        "run": ["bench"] * n, "group_id": group_col, "rollout_id": rollout_col, "session_id": session,
        "segment_id": segment, "turn_index": turn_index,
        "policy_version": [version if k == "turn" else None for k in kind],
        "prompt_ids": _list(rng.integers(0, VOCAB, n_turns * PROMPT, dtype=np.int32), p_len,
                            EVENT_SCHEMA.field("prompt_ids").type, is_turn),
        "output_ids": _list(rng.integers(0, VOCAB, n_turns * OUTPUT, dtype=np.int32), o_len,
                            EVENT_SCHEMA.field("output_ids").type, is_turn),
        "output_logprobs": _list(-rng.exponential(0.4, n_turns * OUTPUT).astype(np.float32), o_len,
                                 EVENT_SCHEMA.field("output_logprobs").type, is_turn),
        "prompt_tokens": pa.array(p_len.astype(np.int32), mask=~is_turn),
        "output_tokens": pa.array(o_len.astype(np.int32), mask=~is_turn),
        "trainable_tokens": pa.array(o_len.astype(np.int32), mask=~is_turn),
        "finish_reason": finish, "reward": reward, "reward_name": reward_name, "status": status,
        "group_size": group_size,
    }
    return _table(cols, n)


def learner_file(version: int, consumed: list[str], seq: int, clock: datetime) -> pa.Table:
    """The learner's checkpoint event publishing `version`, with the rollouts it trained on."""
    return _table({
        "event_id": [ids.new_id()], "kind": ["checkpoint"], "time": [clock], "writer": ["learner"],
        "writer_epoch": [1], "writer_seq": [seq], "run": ["bench"], "policy_version": [version],
        "step": [version * 2], "consumed": [consumed], "meta": [json.dumps({"path": f"ckpt/{version:06d}"})],
    }, 1)


def generate(path: Path, versions: int, seed: int = 0) -> None:
    """A store of `versions` x 1,024 rollouts at `path` (replaced if present)."""
    shutil.rmtree(path, ignore_errors=True)
    store = trajstore.open_store(path)
    rng = np.random.default_rng(seed)
    seqs = {f"collector-{k}": 0 for k in range(COLLECTORS)}
    learner_seq = 0
    previous: list[str] = []
    pending = []
    t0 = time.perf_counter()
    for v in range(versions):
        clock = START + timedelta(minutes=5 * v)
        groups = [ids.new_id("g-") for _ in range(ROLLOUTS_PER_VERSION // GROUP)]
        rollouts = [[ids.new_id("r-") for _ in range(GROUP)] for _ in groups]
        for k in range(COLLECTORS):
            writer = f"collector-{k}"
            data = collector_file(rng, v, groups[k::COLLECTORS], rollouts[k::COLLECTORS], writer, seqs[writer], clock)
            seqs[writer] += data.num_rows
            pending.append(store.table.write_file(data, prefix=f"seal-{writer}"))
        # the learner, one version behind, publishes v + 1 having trained on version v - 1's rollouts
        ckpt = learner_file(v + 1, previous, learner_seq, clock + timedelta(minutes=4))
        learner_seq += 1
        pending.append(store.table.write_file(ckpt, prefix="seal-learner"))
        previous = [r for members in rollouts for r in members]
        if len(pending) >= VERSIONS_PER_COMMIT * (COLLECTORS + 1) or v == versions - 1:
            store.table.commit(pending, operation="bench-generate")
            pending = []
        if (v + 1) % 50 == 0:
            done = (v + 1) / versions
            print(f"    {v + 1}/{versions} versions, {time.perf_counter() - t0:.0f} s "
                  f"(~{(time.perf_counter() - t0) / done * (1 - done):.0f} s left)", flush=True)


def ensure_store(root: Path, size: int) -> tuple[Path, int]:
    versions = max(2, round(size / ROLLOUTS_PER_VERSION))
    path = root / f"shard-{size}"
    marker = path / "GENERATED.json"
    want = {"format": FORMAT, "versions": versions, "rollouts_per_version": ROLLOUTS_PER_VERSION,
            "collectors": COLLECTORS, "group": GROUP}
    if marker.exists() and json.loads(marker.read_text()) == want:
        return path, versions
    print(f"  generating {versions * ROLLOUTS_PER_VERSION:,} rollouts into {path} (once; reused later)", flush=True)
    t0 = time.perf_counter()
    generate(path, versions)
    marker.write_text(json.dumps(want))
    print(f"  generated in {time.perf_counter() - t0:.0f} s", flush=True)
    return path, versions


# ---------------------------------------------------------------- timing


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000],
                    help="store sizes in rollouts (default 10000 100000 1000000)")
    ap.add_argument("--repeats", type=int, default=7, help="timed shards per size; the median counts (default 7)")
    ap.add_argument("--staleness", type=int, default=2, help="max_staleness of the shard (default 2)")
    ap.add_argument("--dir", type=Path, default=Path(__file__).parent / ".data", help="where the stores live")
    ap.add_argument("--quick", action="store_true", help="10k and 100k only, 3 repeats")
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.repeats = [s for s in args.sizes if s <= 100_000] or [10_000], 3
    args.dir.mkdir(parents=True, exist_ok=True)

    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start "
          "(other processes inflate wall times)")
    stores = []
    for size in args.sizes:
        path, versions = ensure_store(args.dir, size)
        store = trajstore.open_store(path, create=False)
        # the last checkpoint published version `versions`: shard for the learner at that version
        call = dict(policy_version=versions, max_staleness=args.staleness, max_rollouts=512, estimator="grpo")
        t0 = time.perf_counter()
        shard = store.shard(**call)
        cold = time.perf_counter() - t0
        assert shard.num_rollouts == 512 and len(shard.group_ids) == 64, (shard.num_rollouts, len(shard.group_ids))
        assert shard.samples.column("advantage").null_count == 0
        stores.append((size, versions, path, store, call, cold, shard.num_tokens, []))
    for _ in range(args.repeats):  # round robin over the sizes, so a busy moment hits them alike
        for _, _, _, store, call, _, _, times in stores:
            # as in a live run the table moves on between shards (an empty commit here, so the
            # stored data stays as generated): no call reuses the previous call's file list
            store.table.commit([], operation="bench-tick")
            t0 = time.perf_counter()
            store.shard(**call)
            times.append(time.perf_counter() - t0)
    rows = [(size, versions * ROLLOUTS_PER_VERSION, len(store.table.snapshot().files), du(path), cold,
             statistics.median(times), min(times), tokens)
            for size, versions, path, store, _, cold, tokens, times in stores]

    print(f"\n512-rollout GRPO shard, policy_version=<latest>, max_staleness={args.staleness}; "
          f"median of {args.repeats} on an open store")
    print(f"  {'store (rollouts)':>16} {'sealed files':>12} {'on disk':>9} {'first call':>10} "
          f"{'median':>8} {'best':>8} {'shard tokens':>12}")
    for size, rollouts, files, nbytes, cold, med, best, tokens in rows:
        print(f"  {rollouts:>16,} {files:>12,} {nbytes / 2**30:>7.2f} GB {cold:>9.3f}s {med:>7.3f}s "
              f"{best:>7.3f}s {tokens:>12,}")
    for (s1, r1, _, _, _, m1, _, _), (s2, r2, _, _, _, m2, _, _) in zip(rows, rows[1:]):
        print(f"  growth {r1:,} -> {r2:,} rollouts ({r2 / r1:.1f}x the store): shard time x{m2 / m1:.2f}")


if __name__ == "__main__":
    main()
