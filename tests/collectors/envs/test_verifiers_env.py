"""A local verifiers (0.4) environment, run by verifiers itself in `.venv-envs`, collected through the capture
proxy: every model call of its harness is a stored turn whose ids and logprobs are the policy's own (checked
against a transformers recompute), the text verifiers saw is the text stored, and its rubric's weighted
scores are stored as reward components."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli.main import main
from collectors.collect.tasks import load_tasks
from collectors.envs import verifiers as vf_env
from collectors.envs.venv import EnvsVenvMissing, envs_python
from collectors.model.replies import response_text
from collectors.policy import Sample
from tests.collectors.recompute import MATCH, cached_model, max_diff, recompute_all
from trajstore import open_store

LOCAL = Path(__file__).parent / "vf_local"  # the environment's modules (verifiers imports them, the project never)
WEIGHTS = {"similarity": 1.0, "short": 0.5}  # vf_echo_for_tests' rubric
TURNS = 2  # vf_inproc_harness' model calls per episode


def write_tasks(path: Path, count: int) -> Path:
    path.write_text("".join(json.dumps({"id": f"vf-{i}", "verifiers": {
        "taskset": "vf_echo_for_tests", "idx": i, "harness": "vf_inproc_harness", "path": str(LOCAL)}}) + "\n"
        for i in range(count)))
    return path


@pytest.mark.slow  # about a minute: vf-eval starts a process per rollout
def test_collect_through_the_proxy_stores_every_turn_exactly(envs_venv_python: Path, tiny_model: Path,
                                                             tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path / "tasks.jsonl", 2)
    assert len(load_tasks(tasks)) == 2  # a task with only `verifiers` is a valid task
    store = str(tmp_path / "store")
    result = CliRunner().invoke(main, [
        "collect", "--store", store, "--run", "vf", "--tasks", str(tasks), "--n", "2", "--model", str(tiny_model),
        "--agent", "collectors.envs.verifiers:agent", "--reward", "collectors.envs.verifiers:reward",
        "--max-tokens", "6", "--seed", "0", "--threads", "1", "--device", "cpu", "--plain", "--retries", "0",
        "--rollout-timeout", "300", "--workdir", str(tmp_path / "work")], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    s = open_store(store)
    rollouts = s.query("""
        SELECT r.rollout_id, r.status, r.reward, json_extract(f.meta, '$.result') AS result
        FROM rollouts r JOIN events f ON f.rollout_id = r.rollout_id AND f.kind = 'status' AND f.status = r.status
        WHERE r.run = 'vf'""").to_pylist()
    assert len(rollouts) == 4 and {r["status"] for r in rollouts} <= {"completed", "truncated"}
    components = s.query("SELECT rollout_id, reward_name, reward FROM events WHERE kind = 'reward'").to_pylist()
    for r in rollouts:
        res = json.loads(r["result"])
        assert res["weights"] == WEIGHTS and res["calls"] == TURNS
        mine = {c["reward_name"]: c["reward"] for c in components if c["rollout_id"] == r["rollout_id"]}
        # each rubric function its own component, weighted; the rollout's reward is verifiers' weighted total
        assert mine == pytest.approx({n: res["rewards"][n] * w for n, w in WEIGHTS.items()})
        assert r["reward"] == pytest.approx(sum(mine.values()))
        turns = s.query("SELECT prompt_ids, output_ids, output_logprobs, policy_version, response, "
                        "json_extract_string(meta, '$.history') AS history FROM turns WHERE rollout_id = $r "
                        "ORDER BY turn_index", {"r": r["rollout_id"]}).to_pylist()
        # every call of the harness is a stored turn, and what verifiers saw is what the store holds
        assert [response_text(t["response"]) for t in turns] == res["replies"] and len(turns) == TURNS
        # the second call continues the first token-exact: its turn stores only the new prompt tokens after the
        # first reply's sampled ids (history "exact"), nothing re-rendered
        assert [t["history"] for t in turns] == ["first", "exact"]
        samples, context = [], []
        for t in turns:
            context += t["prompt_ids"]
            samples.append(Sample(prompt_ids=list(context), output_ids=t["output_ids"], text="", finish_reason="stop",
                                  output_logprobs=t["output_logprobs"], policy_version=t["policy_version"]))
            context += t["output_ids"]
        for sample, again in zip(samples, recompute_all(cached_model(str(tiny_model)), samples), strict=True):
            assert sample.output_ids and max_diff(sample.output_logprobs, again) < MATCH


def test_a_failed_episode_fails_the_rollout_with_verifiers_errors() -> None:
    with pytest.raises(vf_env.VerifiersError, match="episode failed: upstream 404"):
        vf_env.summarize({"ok": False, "traces": [{"errors": [{"message": "upstream 404: no such model"}]}]})
    with pytest.raises(vf_env.VerifiersError, match="is not a verifiers task"):
        vf_env.spec({"id": "x", "prompt": "hi"})
    with pytest.raises(vf_env.VerifiersError, match="scores the result of collectors.envs.verifiers:agent"):
        vf_env.reward({}, "some text")


def test_the_envs_python_can_be_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAJSTORE_ENVS_PYTHON", str(tmp_path / "nope"))
    with pytest.raises(EnvsVenvMissing, match="make envs"):
        envs_python()
