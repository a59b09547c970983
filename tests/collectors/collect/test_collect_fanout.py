"""Fan-out through `trajstore collect`: the sub-agent example gives one rollout several segments, and every
segment carries its rollout's advantage, from the store's SQL (the `advantages` view and a training shard)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from cli.main import main  # noqa: E402
from collectors.envs import subagent  # noqa: E402
from tests.collectors.agents_for_tests import write_tasks  # noqa: E402
from trajstore import open_store  # noqa: E402


def test_each_segment_gets_its_rollouts_advantage(tiny_model: Path, tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    tasks = write_tasks(tmp_path / "tasks.jsonl", subagent.tasks(2, seed=0))
    threads = torch.get_num_threads()
    try:  # `score` has a per-slot component, so each group's rewards spread and advantages are nonzero
        result = CliRunner().invoke(main, [
            "collect", "--store", store, "--run", "fan", "--tasks", tasks, "--n", "3", "--model", str(tiny_model),
            "--agent", "collectors.envs.subagent:agent", "--reward", "tests.collectors.agents_for_tests:score",
            "--max-tokens", "8", "--seed", "1", "--threads", "1", "--device", "cpu", "--plain",
            "--workdir", str(tmp_path / "work")], catch_exceptions=False)
    finally:
        torch.set_num_threads(threads)
    assert result.exit_code == 0, result.output

    s = open_store(store)
    rows = s.query("""
        SELECT s.rollout_id, s.segment_id, s.session_id, a.grpo, r.segments
        FROM samples s JOIN advantages a USING (rollout_id) JOIN rollouts r USING (rollout_id)
        WHERE s.run = 'fan'""").to_pylist()
    by_rollout: dict[str, list[dict]] = {}
    for row in rows:
        by_rollout.setdefault(row["rollout_id"], []).append(row)
    assert len(by_rollout) == 6
    for segments in by_rollout.values():
        assert len(segments) == 3 == segments[0]["segments"]  # main, sub, main after compaction
        assert {seg["session_id"] for seg in segments} == {"main", "sub"}
    assert any(abs(segs[0]["grpo"]) > 0.1 for segs in by_rollout.values())

    shard = s.shard(policy_version=0, max_staleness=0, run="fan", estimator="grpo")
    samples = shard.samples.to_pylist()
    assert len(samples) == 18 and all(x["rollout_segments"] == 3 for x in samples)
    grpo = {r["rollout_id"]: r["grpo"] for r in rows}
    for x in samples:  # the shard broadcasts the rollout's advantage to each of its segments
        assert x["advantage"] == pytest.approx(grpo[x["rollout_id"]])
