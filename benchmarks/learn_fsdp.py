"""Memory per rank: `trajstore learn` in one process against `torchrun --nproc-per-node 2` (FSDP2, gloo, CPU).

The same model (built with `init_model`, random weights) and the same generated run (the
store `benchmarks/learn.py` writes: groups of 8 rollouts with long-tailed lengths) are trained
for a few steps twice, with the same settings: by one `trajstore learn` process, and by two
ranks under torchrun, whose FSDP2 shards parameters, gradients and AdamW state. Both runs log
per-step metrics to their store (`learner.distributed.memory`), which this script reads back:

- training state per rank: bytes of the parameters, gradients and AdamW moments a rank holds
  (exact, from the tensors' local shards);
- peak RSS per rank: the process's high-water mark (getrusage), Python runtime, libraries,
  the full model each rank loads before sharding it, activations and buffers included;

and the largest difference between the two runs' final weights. The baseline is one process
holding the whole model, as the learner does without torchrun.

    python benchmarks/learn_fsdp.py                 # 28M parameters, 2 steps; ~3 minutes on 2 cores
    python benchmarks/learn_fsdp.py --hidden 256 --layers 4 --steps 1
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/learn.py writes the run

from safetensors.torch import load_file  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

import trajstore  # noqa: E402
from collectors.model.build import ModelSize, init_model  # noqa: E402
from learn import RUN, ShardShape, write_run  # noqa: E402
from learner import checkpoints  # noqa: E402

BIN = Path(sys.executable).parent
TRAJSTORE = shutil.which("trajstore") or str(BIN / "trajstore")
TORCHRUN = shutil.which("torchrun") or str(BIN / "torchrun")


def run_learner(launcher: list[str], store: Path, model: Path, ckpts: Path, args: argparse.Namespace) -> float:
    command = [*launcher, "learn", "--store", str(store), "--run", RUN, "--model", str(model), "--checkpoints",
               str(ckpts), "--groups-per-step", "2", "--steps", str(args.steps), "--micro-batch-tokens",
               str(args.micro_batch_tokens), "--lr", "1e-4", "--max-staleness", "100", "--device", "cpu",
               "--wait-timeout", "5"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return time.perf_counter() - started


def last_metrics(store: Path) -> dict[str, float]:
    rows = trajstore.open_store(store).query(
        "SELECT name, value FROM metrics WHERE step = (SELECT max(step) FROM metrics)").to_pylist()
    return {r["name"]: r["value"] for r in rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--micro-batch-tokens", type=int, default=1024)
    args = ap.parse_args()
    hf_logging.disable_progress_bar()
    size = ModelSize(vocab_size=args.vocab, hidden_size=args.hidden, layers=args.layers, heads=args.heads,
                     kv_heads=max(1, args.heads // 4), intermediate_size=3 * args.hidden, max_positions=4096)
    with tempfile.TemporaryDirectory(prefix="learn-fsdp-") as tmp_name:
        tmp = Path(tmp_name)
        built = init_model(tmp / "model", size, seed=0)
        write_run(tmp / "one" / "store", ShardShape(groups=2 * args.steps, median_len=192, max_len=1024,
                                                    vocab=built.vocab_size))
        shutil.copytree(tmp / "one", tmp / "two")
        print(f"model: init_model Qwen2, {built.parameters:,} parameters (hidden {args.hidden}, {args.layers} layers, "
              f"vocab {built.vocab_size}), float32, AdamW; {args.steps} steps of 2 groups x 8 rollouts; "
              f"machine: {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f} at start")
        wall = {"one": run_learner([TRAJSTORE], tmp / "one" / "store", tmp / "model", tmp / "one" / "ckpts", args),
                "two": run_learner([TORCHRUN, "--standalone", "--nproc-per-node", "2", TRAJSTORE, "--"],
                                   tmp / "two" / "store", tmp / "model", tmp / "two" / "ckpts", args)}
        metrics = {name: last_metrics(tmp / name / "store") for name in wall}
        newest = {name: checkpoints.latest(tmp / name / "ckpts") for name in wall}
        final = {name: load_file(str(info.path / "model.safetensors")) for name, info in newest.items() if info}
    worst = max((final["one"][k] - final["two"][k]).abs().max().item() for k in final["one"])
    base = metrics["one"]
    print(f"\n  {'learner':<34} {'state MiB/rank':>15} {'vs one':>7} {'peak RSS MiB/rank':>18} {'vs one':>7} "
          f"{'wall s':>7}")
    for name, label in (("one", "one process"), ("two", "torchrun, 2 ranks (FSDP2, gloo)")):
        m = metrics[name]
        state, rss = m["state_mb_per_rank"], m["rss_peak_mb_per_rank"]
        print(f"  {label:<34} {state:>15,.1f} {state / base['state_mb_per_rank']:>6.2f}x {rss:>18,.0f} "
              f"{rss / base['rss_peak_mb_per_rank']:>6.2f}x {wall[name]:>7.1f}")
    print(f"\nlargest difference between the two runs' final weights: {worst:.2e}; "
          f"loss of the last step: {base['loss']:.6f} (one) vs {metrics['two']['loss']:.6f} (two ranks)")


if __name__ == "__main__":
    main()
