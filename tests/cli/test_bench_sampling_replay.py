"""benchmarks/sampling_replay.py end to end, small: `trajstore init-model`, `collect` at top_p 0.7 and at top_k 8,
one `learn` step with replay on and off. With replay the step's importance ratio is 1 (the issue's bound: within
0.005, mismatch k3 <= 1e-4); without it, the kept mass of the truncated distribution, far from 1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # two collects and four learner processes: a few minutes on 2 busy cores

ROOT = Path(__file__).parents[2]


def test_replay_brings_the_importance_ratio_to_1_at_top_p_and_top_k(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sampling_replay.py"), "--tasks", "1", "--n", "2",
                    "--max-tokens", "8", "--settings", "top_p 0.7", "top_k 8", "--json", str(out)],
                   check=True, timeout=1500, cwd=ROOT)
    rows = {r["setting"]: r for r in json.loads(out.read_text())}
    for setting in ("top_p 0.7", "top_k 8"):
        r = rows[setting]
        assert abs(r["is_w on"] - 1) <= 0.005 and r["k3 on"] <= 1e-4, r
        assert r["is_w off"] < 0.9 and r["k3 off"] > 1e-2, r
        assert r["replayed on"] == r["tokens"] and r["replayed off"] == 0, r
    assert rows["top_p 0.7"]["bytes/token"] == 4.0  # every set above the cap: its size alone
    assert rows["top_k 8"]["bytes/token"] == 36.0  # size + 8 ids
