"""Peak memory of `trajstore export` as the store grows (2k, 10k, 41k rollouts), against loading the run whole.

The stores are the shard benchmark's (generated once into benchmarks/.data/, reused): groups of
8 rollouts, 2-4 tool-calling turns each (32 prompt + 64 output tokens per turn, with
logprobs), one run. Each export runs in a fresh process, which reports its peak resident set
(`ru_maxrss`) and its resident set after the imports and opening the store, so the export's own
growth is the difference.

Export: `trajstore.export.export(store, FORMAT, run="bench", out=...)`: the rows streamed from
DuckDB in record batches of 256 samples under a 512 MB DuckDB memory limit, written as they come.
Baseline ("whole"): the same rows read at once (`Snapshot.query` of the same SQL into one Arrow
table) and written with `pyarrow.parquet.write_table`, what a script over `trajstore query`
would do.

    python benchmarks/export.py                              # hf, tokens, ng-trajectory + the baseline
    python benchmarks/export.py --sizes 2048 10240 --formats hf
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import shard as shard_bench  # noqa: E402  (the generated stores)

from trajstore.export import MEMORY_LIMIT  # noqa: E402


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def child(store_path: str, fmt: str, out: str, memory_limit: str) -> dict[str, float | int]:
    """One export in this process; what it measured."""
    import pyarrow.parquet as pq

    import trajstore
    from trajstore.export import export, source

    store = trajstore.open_store(store_path, create=False)
    store.query("SELECT 1")  # DuckDB, delta-rs and the views loaded before the baseline RSS is read
    before = _rss_mb()
    t0 = time.perf_counter()
    if fmt == "whole":
        with store.snapshot() as snap:
            rows = snap.query(source.SAMPLE_ROWS + " ORDER BY rollout_id, segment_id", {"run": "bench", "run_mean": 0.0})
            pq.write_table(rows, out, compression="zstd")
            n = rows.num_rows
    else:
        n = export(store, fmt, run="bench", out=out, memory_limit=memory_limit).rows  # type: ignore[arg-type]
    return {"rows": n, "seconds": time.perf_counter() - t0, "rss_before_mb": before, "rss_peak_mb": _rss_mb()}


def measure(store_path: Path, fmt: str, tmp: Path, memory_limit: str) -> dict[str, float | int]:
    out = tmp / {"hf": "ds", "tokens": "t.parquet", "whole": "whole.parquet"}.get(fmt, "out.jsonl")
    shutil.rmtree(out, ignore_errors=True) if out.is_dir() else out.unlink(missing_ok=True)
    proc = subprocess.run([sys.executable, __file__, "--child", str(store_path), fmt, str(out), memory_limit],
                          capture_output=True, text=True, timeout=900, check=False)
    if proc.returncode:
        raise SystemExit(f"export {fmt} of {store_path} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[2048, 10240, 40960], help="rollouts per store")
    ap.add_argument("--formats", nargs="+", default=["hf", "tokens", "ng-trajectory", "whole"],
                    help="export formats (sft needs chat JSON the generated stores lack); `whole` is the baseline")
    ap.add_argument("--dir", type=Path, default=Path(__file__).parent / ".data", help="where the stores live")
    ap.add_argument("--memory-limit", default=MEMORY_LIMIT, help="DuckDB's memory limit for the export")
    ap.add_argument("--child", nargs=4, metavar=("STORE", "FORMAT", "OUT", "LIMIT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    args.dir.mkdir(parents=True, exist_ok=True)
    print(f"{'rollouts':>9} {'format':>14} {'rows':>10} {'seconds':>8} {'RSS before':>11} {'peak RSS':>9} {'growth':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            path, _ = shard_bench.ensure_store(args.dir, size)
            for fmt in args.formats:
                r = measure(path, fmt, Path(tmp), args.memory_limit)
                print(f"{size:>9,} {fmt:>14} {r['rows']:>10,} {r['seconds']:>8.1f} {r['rss_before_mb']:>9.0f}MB "
                      f"{r['rss_peak_mb']:>7.0f}MB {r['rss_peak_mb'] - r['rss_before_mb']:>6.0f}MB", flush=True)


if __name__ == "__main__":
    main()
