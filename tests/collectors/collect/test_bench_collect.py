"""benchmarks/collect.py at a toy size, so the script keeps running as `collect` changes.

It measures nothing here: it checks the busy-fraction arithmetic on hand-made intervals, and that a
tiny run (2 slots, a 20 ms upstream) completes every rollout with two upstream calls each and
reports fractions that make sense, with both ways of building the agent's client.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    # imported by its dotted name: `collect` loads the benchmark's agent as `benchmarks.collect:agent`,
    # and the upstream process (spawned) finds its entry point the same way
    return importlib.import_module("benchmarks.collect")


def test_busy_fractions_integrate_min_of_in_flight_and_slots(bench: ModuleType) -> None:
    # 2 slots over [0, 10]: 0-2 one request, 2-4 three (capped at 2), 4-6 none, 6-10 one
    intervals = [(0.0, 4.0), (2.0, 4.0), (2.0, 4.0), (6.0, 10.0)]
    busy, anyone = bench.busy_fractions(intervals, 2, 0.0, 10.0)
    assert busy == pytest.approx((2 * 1 + 2 * 2 + 4 * 1) / (2 * 10))
    assert anyone == pytest.approx(8 / 10)
    # the window clips requests that started before it or end after it
    assert bench.busy_fractions([(-5.0, 15.0)], 1, 0.0, 10.0) == (pytest.approx(1.0), pytest.approx(1.0))
    assert bench.busy_fractions([], 4, 0.0, 1.0) == (0.0, 0.0)
    assert bench.cpu_at([(0.0, 1.0), (2.0, 3.0)], 1.5) == pytest.approx(2.5)


def test_toy_run_completes_every_rollout(bench: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    rows = bench.main(["--concurrency", "2", "--latency-ms", "20", "--per-slot", "1", "--min-rollouts", "4",
                       "--shared-client"])
    printed = capsys.readouterr().out
    assert [(r["concurrency"], r["client"]) for r in rows] == [(2, "ctx.openai"), (2, "shared")], printed
    for row in rows:
        assert row["rollouts"] == 4 and row["calls"] == 2 * row["rollouts"], printed
        assert 0 < row["busy"] <= row["any_busy"] <= 1, printed
        assert row["rollouts_per_s"] > 0 and row["tokens_per_s"] > 0 and row["cpu_ms_per_call"] > 0, printed
    assert "upstream busy" in printed and "budget:" in printed
