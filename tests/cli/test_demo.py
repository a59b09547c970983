"""The closed loop, CI-sized: `trajstore demo --quick` must make the model better, measurably.

`DemoSettings.quick` runs the same loop as `make demo` (init-model, warm start, `trajstore learn`
and `trajstore collect --follow` as real processes on one store, staleness bound 1, hot reload)
with fewer steps. The assertion is statistical, not a threshold on one number: the rollouts
sampled by the second half of the policy versions must earn more reward than those of version 0
by a margin with a one-sided z-score above 3 (a Mann-Whitney rank test over per-rollout rewards;
see `rank_z`). Random noise alone exceeds z = 3 with probability about 0.0013. Why it is not flaky:
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


def rank_z(first: list[float], last: list[float]) -> float:
    """One-sided Mann-Whitney U statistic of `last` over `first` as a z-score, with the tie correction.

    Rank-based on purpose: a reward is 0, 0.1 (the calculator was used) or 1.1 (and the answer was
    right), and a rare right answer would swamp a difference of means; ranks weigh every rollout once.
    """
    pooled = sorted([(x, 0) for x in first] + [(x, 1) for x in last])
    ranks: list[float] = [0.0] * len(pooled)
    ties = 0.0
    i = 0
    while i < len(pooled):  # average ranks over runs of equal values
        j = i
        while j + 1 < len(pooled) and pooled[j + 1][0] == pooled[i][0]:
            j += 1
        for k in range(i, j + 1):
            ranks[k] = (i + j) / 2 + 1
        ties += (j - i + 1) ** 3 - (j - i + 1)
        i = j + 1
    n1, n2 = len(first), len(last)
    n = n1 + n2
    u = sum(r for r, (_, side) in zip(ranks, pooled) if side == 1) - n2 * (n2 + 1) / 2
    sd = math.sqrt(n1 * n2 / 12 * ((n + 1) - ties / (n * (n - 1))))
    return (u - n1 * n2 / 2) / sd if sd > 0 else 0.0


def test_rank_z_by_hand() -> None:
    # first [0, 0.1], last [0.1, 1.1]: pooled 0 | 0.1 0.1 | 1.1 -> ranks 1 | 2.5 2.5 | 4; last's rank sum 6.5,
    # U = 6.5 - 3 = 3.5, mean n1 n2 / 2 = 2; ties: one pair, 2^3 - 2 = 6; var = 4/12 * (5 - 6/12) = 1.5
    assert rank_z([0, 0.1], [0.1, 1.1]) == pytest.approx(1.5 / math.sqrt(1.5))
    assert rank_z([0.0] * 5, [0.0] * 5) == 0.0
    assert rank_z([0.0] * 30, [0.1] * 30) > 7


@pytest.mark.slow
def test_the_closed_loop_makes_the_model_better(tmp_path: Path) -> None:
    result = run_demo(DemoSettings.quick(tmp_path / "demo"), say=lambda line: None)
    # the loop's time limit is a safety net far above what 10 steps take; a run it cuts short still has to show z > 3
    assert result.steps >= 6, f"the learner made {result.steps} steps; see {result.directory / 'learn.log'}"
    rows = open_store(result.store).query(
        "SELECT min_version AS version, reward FROM rollouts WHERE run = 'demo' AND trainable").to_pylist()
    half = (max(r["version"] for r in rows) + 1) // 2
    first = [r["reward"] for r in rows if r["version"] == 0]
    last = [r["reward"] for r in rows if r["version"] >= half]
    assert len(first) >= 32 and len(last) >= 32, (len(first), len(last))
    z = rank_z(first, last)
    assert z > 3, (f"reward did not rise clearly: version 0 {sum(first) / len(first):.3f} over {len(first)} "
                   f"rollouts, versions >= {half} {sum(last) / len(last):.3f} over {len(last)}; z = {z:.2f}")
    # what the user is left with: a plot, and a store the query and replay commands read
    assert result.plot is not None and result.plot.stat().st_size > 1000
    assert [r["version"] for r in result.by_version] == sorted(r["version"] for r in result.by_version)
