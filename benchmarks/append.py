"""Durable appends: trajstore against the ways RL frameworks dump rollouts today.

Every writer gets the same generated turns (64 prompt + 512 output tokens with a logprob
each, ids, sampling settings) in batches of 64 turns, and every batch is durable (fsync'd)
before the next one starts:

- trajstore       `Writer.append(list_of_dicts)`: validation, Arrow conversion, one
                  checksummed Arrow IPC batch in the write-ahead segment, fsync
- JSON lines      one `json.dumps` line per turn appended to one file, fsync per batch
                  (verl's rollout dump)
- torch.save      the batch's list of dicts pickled to its own file, fsync (slime's dump)
- Parquet         the batch as its own Parquet file, fsync (TRL's completion logs)

A file created per batch is durable only once its directory entry is, so the per-file
baselines fsync the directory too (measured here: ~0.1 ms, small beside the rest).

Each writer runs twice: token lists as Python lists, then as numpy arrays (int32 ids,
float32 logprobs, what an inference engine hands back). JSON lines must call `.tolist()`
on arrays; torch.save gets `torch.from_numpy` tensors (zero copy); Parquet and trajstore
take the arrays as they are. trajstore's writer is opened with a large `seal_bytes` so the
timed loop measures appends only; sealing into Parquet/Delta happens at close, outside
the clock (its time is printed below the tables).

    python benchmarks/append.py                # ~1-2 minutes
    python benchmarks/append.py --quick        # ~10 seconds
    python benchmarks/append.py --batches 200 --threads 8 --repeats 7
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import trajstore
from trajstore.durable import fsync_path as fsync_dir
from trajstore.durable import sync_file

try:
    import torch
except ImportError as exc:  # torch is only a baseline: `pip install -e '.[bench]'` (CPU build)
    torch = None
    TORCH_MISSING = f"torch is not installed ({exc}); install the CPU build with `pip install -e '.[bench]'`"
else:
    TORCH_MISSING = ""

PROMPT_TOKENS = 64
OUTPUT_TOKENS = 512
TOKENS_PER_TURN = PROMPT_TOKENS + OUTPUT_TOKENS
VOCAB = 151_936  # Qwen-sized vocabulary


# ---------------------------------------------------------------- data


def make_turns(n: int, *, arrays: bool, seed: int = 0) -> list[dict[str, Any]]:
    """n turn events shaped like a real agent run: groups of 8 rollouts, 4 turns each."""
    rng = np.random.default_rng(seed)
    turns = []
    for i in range(n):
        group, rollout, turn = i // 32, i // 4, i % 4
        prompt = rng.integers(0, VOCAB, PROMPT_TOKENS, dtype=np.int32)
        output = rng.integers(0, VOCAB, OUTPUT_TOKENS, dtype=np.int32)
        logprobs = -rng.exponential(0.7, OUTPUT_TOKENS).astype(np.float32)
        turns.append({
            "kind": "turn",
            "event_id": trajstore.new_id("e-"),
            "run": "bench",
            "group_id": f"g-{group:08d}",
            "rollout_id": f"r-{rollout:08d}",
            "segment_id": f"s-{rollout:08d}",
            "turn_index": turn,
            "policy_version": 3,
            "prompt_ids": prompt if arrays else prompt.tolist(),
            "output_ids": output if arrays else output.tolist(),
            "output_logprobs": logprobs if arrays else logprobs.tolist(),
            "finish_reason": "stop",
            "sampling": {"temperature": 1.0, "top_p": 1.0, "max_tokens": OUTPUT_TOKENS, "seed": i},
        })
    return turns


def batches_of(turns: list[dict[str, Any]], size: int) -> list[list[dict[str, Any]]]:
    return [turns[i:i + size] for i in range(0, len(turns), size)]


# ---------------------------------------------------------------- writers
# Each takes (directory, batches) and returns the seconds spent appending them durably.


def write_jsonl(root: Path, batches: list[list[dict[str, Any]]]) -> float:
    def plain(value: Any) -> Any:  # numpy arrays -> lists, as a JSON dump of rollouts must
        return value.tolist() if isinstance(value, np.ndarray) else value

    t0 = time.perf_counter()
    with open(root / "rollouts.jsonl", "ab") as f:
        for batch in batches:
            f.write("".join(json.dumps(t, default=plain) + "\n" for t in batch).encode())
            sync_file(f)
    return time.perf_counter() - t0


def write_torch(root: Path, batches: list[list[dict[str, Any]]]) -> float:
    assert torch is not None
    t0 = time.perf_counter()
    for i, batch in enumerate(batches):
        data = [{k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in t.items()} for t in batch]
        path = root / f"rollout_{i:06d}.pt"
        with open(path, "wb") as f:
            torch.save(data, f)
            sync_file(f)
        fsync_dir(root)
    return time.perf_counter() - t0


def write_parquet(root: Path, batches: list[list[dict[str, Any]]]) -> float:
    t0 = time.perf_counter()
    for i, batch in enumerate(batches):
        rows = [{**t, "sampling": json.dumps(t["sampling"])} for t in batch]
        table = pa.Table.from_pylist(rows)
        path = root / f"completions_{i:06d}.parquet"
        with open(path, "wb") as f:
            pq.write_table(table, f)
            sync_file(f)
        fsync_dir(root)
    return time.perf_counter() - t0


SEAL_SECONDS: list[float] = []


def write_trajstore(root: Path, batches: list[list[dict[str, Any]]], threads: int = 1) -> float:
    store = trajstore.open_store(root / "store")
    w = store.writer("bench", seal_bytes=1 << 40, seal_interval=1e6)
    try:
        if threads == 1:
            t0 = time.perf_counter()
            for batch in batches:
                w.append(batch)
            elapsed = time.perf_counter() - t0
        else:
            errors: list[BaseException] = []
            start = threading.Barrier(threads + 1)

            def work(part: list[list[dict[str, Any]]]) -> None:
                start.wait()
                try:
                    for batch in part:
                        w.append(batch)
                except BaseException as exc:  # noqa: BLE001 - reported after the join
                    errors.append(exc)

            pool = [threading.Thread(target=work, args=(batches[k::threads],)) for k in range(threads)]
            for t in pool:
                t.start()
            start.wait()
            t0 = time.perf_counter()
            for t in pool:
                t.join()
            elapsed = time.perf_counter() - t0
            if errors:
                raise errors[0]
    finally:
        t1 = time.perf_counter()
        w.close()  # seals the segment into Parquet + Delta: outside the timed loop
        SEAL_SECONDS.append(time.perf_counter() - t1)
    return elapsed


# ---------------------------------------------------------------- harness


def run_once(fn: Callable[[Path, list[list[dict[str, Any]]]], float], batches: list[list[dict[str, Any]]],
             parent: Path) -> float:
    """Seconds of one run into a fresh directory (removed afterwards)."""
    root = Path(tempfile.mkdtemp(prefix="append-", dir=parent))
    try:
        return fn(root, batches)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=64, help="batches per run (default 64)")
    ap.add_argument("--batch-size", type=int, default=64, help="turns per batch (default 64)")
    ap.add_argument("--repeats", type=int, default=5, help="runs per writer, round robin; the median counts (default 5)")
    ap.add_argument("--threads", type=int, default=4, help="appender threads for the group-commit row (default 4)")
    ap.add_argument("--dir", type=Path, default=Path(__file__).parent / ".data",
                    help="where the files go; must be a real disk, fsync on tmpfs is free (default benchmarks/.data)")
    ap.add_argument("--quick", action="store_true", help="short run: 12 batches, 1 repeat")
    args = ap.parse_args()
    if args.quick:
        args.batches, args.repeats = 12, 1
    args.dir.mkdir(parents=True, exist_ok=True)

    n_turns = args.batches * args.batch_size
    tokens = n_turns * TOKENS_PER_TURN
    print(f"{args.batches} batches x {args.batch_size} turns x {TOKENS_PER_TURN} tokens "
          f"({PROMPT_TOKENS} prompt + {OUTPUT_TOKENS} output, each with a logprob) = {tokens:,} tokens per run; "
          f"fsync after every batch; median of {args.repeats}; files under {args.dir}")
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start "
          "(other processes inflate wall times)")
    if TORCH_MISSING:
        print(f"skipping torch.save: {TORCH_MISSING}")

    writers: list[tuple[str, Callable[..., float]]] = [
        ("JSON lines + fsync (verl)", write_jsonl),
        ("torch.save per batch + fsync (slime)", write_torch),
        ("Parquet per batch + fsync (TRL)", write_parquet),
        ("trajstore Writer.append", write_trajstore),
        (f"trajstore, {args.threads} appender threads (group commit)",
         lambda root, b: write_trajstore(root, b, threads=args.threads)),
    ]
    for arrays in (False, True):
        title = "numpy arrays (int32 ids, float32 logprobs)" if arrays else "Python lists"
        batches = batches_of(make_turns(n_turns, arrays=arrays), args.batch_size)
        times: dict[str, list[float]] = {name: [] for name, fn in writers
                                         if not (fn is write_torch and TORCH_MISSING)}
        for _ in range(args.repeats):  # round robin, so a busy moment of the machine hits every writer alike
            for name, fn in writers:
                if name in times:
                    times[name].append(run_once(fn, batches, args.dir))
        rates = {name: tokens / statistics.median(t) for name, t in times.items()}
        base = rates["JSON lines + fsync (verl)"]
        print(f"\ntoken lists as {title}")
        print(f"  {'writer':<52} {'tokens/s':>12} {'turns/s':>9} {'vs JSON lines':>14}")
        for name, rate in rates.items():
            print(f"  {name:<52} {rate:>12,.0f} {rate / TOKENS_PER_TURN:>9,.0f} {rate / base:>13.1f}x")
    if SEAL_SECONDS:
        print(f"\ntrajstore seal at close (not in the tables): median {statistics.median(SEAL_SECONDS):.2f} s "
              f"for {n_turns} turns")


if __name__ == "__main__":
    main()
