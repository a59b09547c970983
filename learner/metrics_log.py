"""One terminal line per learner step: the numbers an RL researcher watches while a run trains."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TextIO

# (metric, label, format); a metric a step did not report is left out of its line
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("loss", "loss", "{:+.4f}"),
    ("reward_mean", "reward", "{:.3f}"),
    ("advantage_std", "adv_std", "{:.3f}"),
    ("clip_fraction", "clip", "{:.3f}"),
    ("is_weight_mean", "is_w", "{:.3f}"),
    ("mismatch_kl_k3", "mismatch_kl", "{:.2e}"),
    ("kl_ref", "kl_ref", "{:.2e}"),
    ("distill_kl", "distill_kl", "{:+.3f}"),
    ("entropy", "entropy", "{:.3f}"),
    ("grad_norm", "grad", "{:.3f}"),
    ("groups_no_spread", "flat_groups", "{:.0f}"),
    ("staleness_max", "stale", "{:.0f}"),
    ("rollouts", "rollouts", "{:.0f}"),
    ("tokens", "tokens", "{:.0f}"),
    ("tokens_per_s", "tok/s", "{:.0f}"),
    ("step_time", "time", "{:.2f}s"),
)


def format_step(step: int, version: int, metrics: Mapping[str, float]) -> str:
    """`step 3 v1 | loss +0.0123 reward 0.500 ...` for one step trained from policy version `version`."""
    parts = [f"{label} {fmt.format(metrics[name])}" for name, label, fmt in COLUMNS if name in metrics]
    return f"step {step} v{version} | " + "  ".join(parts)


def show(step: int, version: int, metrics: Mapping[str, float], stream: TextIO | None = None) -> None:
    """Print one step's line (plain text: it stays readable in log files and CI output)."""
    print(format_step(step, version, metrics), file=stream or sys.stdout, flush=True)
