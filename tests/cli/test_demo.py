"""The closed loop, CI-sized: `trajstore demo --quick` must make the model better, measurably.

`DemoSettings.quick` runs the same loop as `make demo` (init-model, warm start, `trajstore learn`
and `trajstore collect --follow` as real processes on one store, staleness bound 1, hot reload)
with fewer steps. The assertion is statistical, not a threshold on one number: the rollouts
sampled by the second half of the policy versions must earn more reward than those of version 0
by a margin with a one-sided z-score above 3 (Welch's unequal-variance statistic over per-rollout
rewards). Random noise alone exceeds z = 3 with probability about 0.0013. Why it is not flaky:
the warm start answers about half of the questions without the calculator, which never pays,
and the learner moves that one decision (the first sampled token) quickly, so the effect the
test measures is several times the threshold (see the numbers in the README's demo section),
not a marginal one; and every sample is seeded (per task, slot and attempt) while the learner
trains on whatever the collector finished first, so reruns differ only in that order.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from cli.demo import DemoSettings, run_demo  # noqa: E402
from trajstore import open_store  # noqa: E402


def welch_z(first: list[float], last: list[float]) -> float:
    """(mean(last) - mean(first)) / sqrt(var(first)/n1 + var(last)/n2)."""
    def mean_var(xs: list[float]) -> tuple[float, float]:
        m = sum(xs) / len(xs)
        return m, sum((x - m) ** 2 for x in xs) / (len(xs) - 1)

    (m1, v1), (m2, v2) = mean_var(first), mean_var(last)
    spread = math.sqrt(v1 / len(first) + v2 / len(last))
    return (m2 - m1) / spread if spread > 0 else (math.inf if m2 > m1 else 0.0)


def test_welch_z_by_hand() -> None:
    # first: mean 0.25, sample var 1/3 * (3 * 0.0625 + 0.5625) = 0.25; last: mean 0.75, var 0.25; n 4 each
    # z = 0.5 / sqrt(0.25/4 + 0.25/4) = 0.5 / 0.35355 = 1.41421
    assert welch_z([0, 0, 0, 1], [1, 1, 1, 0]) == pytest.approx(math.sqrt(2))
    assert welch_z([0.0, 0.0], [1.0, 1.0]) == math.inf


def test_the_closed_loop_makes_the_model_better(tmp_path: Path) -> None:
    result = run_demo(DemoSettings.quick(tmp_path / "demo"), say=lambda line: None)
    assert result.steps >= DemoSettings.quick(tmp_path).steps - 1, "the learner stopped early; see learn.log"
    rows = open_store(result.store).query(
        "SELECT min_version AS version, reward FROM rollouts WHERE run = 'demo' AND trainable").to_pylist()
    half = (max(r["version"] for r in rows) + 1) // 2
    first = [r["reward"] for r in rows if r["version"] == 0]
    last = [r["reward"] for r in rows if r["version"] >= half]
    assert len(first) >= 32 and len(last) >= 32, (len(first), len(last))
    z = welch_z(first, last)
    assert z > 3, (f"reward did not rise clearly: version 0 {sum(first) / len(first):.3f} over {len(first)} "
                   f"rollouts, versions >= {half} {sum(last) / len(last):.3f} over {len(last)}; z = {z:.2f}")
    # what the user is left with: a plot, and a store the query and replay commands read
    assert result.plot is not None and result.plot.stat().st_size > 1000
    assert [r["version"] for r in result.by_version] == sorted(r["version"] for r in result.by_version)
