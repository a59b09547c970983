"""benchmarks/learn.py at a toy size, so the script keeps running as the learner changes.

It measures nothing here; it checks that the three ways of training one shard (padded,
padded with the LM head on trainable positions, packed) give the same loss from the same
weights, and that the --mfu path builds its model and FLOPs plan.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "learn.py"
TOY = ["--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--intermediate", "64",
       "--groups", "1", "--min-len", "16", "--median-len", "40", "--max-len", "160", "--budget", "256",
       "--threads", "1"]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_learn", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_padded_and_packed_steps_agree(bench: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    try:
        out = bench.main([*TOY, "--vocab", "512", "--repeats", "1"])
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    assert out["loss_rel_diff"] < 1e-4, printed
    assert out["ratio"] > 0
    for row in ("padded ", "padded, head K", "packed "):
        assert row in printed
    assert "packed / padded tokens/s:" in printed


def test_mfu_path_builds_on_cpu(bench: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    try:
        plan = bench.main(["--mfu", "--dry-run", "--groups", "1"])  # the 0.5B shape, on the meta device
        toy = bench.main(["--mfu", *TOY, "--vocab", "1000", "--repeats", "1", "--warmup", "0",
                          "--no-head-baseline", "--peak-tflops", "1"])
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    assert "494,032,768 parameters" in printed, printed  # Qwen2.5-0.5B's count
    assert plan["flops"] > 0
    assert 0 < toy["mfu"] and toy["loss_rel_diff"] < 1e-4, printed
    assert "MFU of the packed step" in printed
