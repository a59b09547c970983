"""Two `trajstore collect` processes on one real vLLM: one reloads it, the other follows; every turn is stamped right.

The test plays the learner: it announces versions (checkpoint events pointing at two
checkpoints in turn) while both collectors run `--forever` against the session's vLLM. The
owner (`--vllm-reload weights`) pauses vLLM in keep mode, reloads and labels it; the follower
(`--vllm-reload follow`) never does, rides through the pauses (calls in flight frozen and
resumed on the new weights, new ones held, 503 past the server's small queue limit, retried)
and stamps its tokens from vLLM's `weight_versions` spans. Then every stored token is checked
against the ground truth: its logprob recomputed with transformers under the weights of the
version stamped on it (tests/collectors/recompute.py, `recompute_spans`).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from collectors.children import spawn_child
from collectors.policy import Sample
from collectors.policy.vllm_server import VLLMServer
from tests.collectors.agents_for_tests import rollout_rows, write_tasks
from tests.collectors.recompute import DIFFER, MATCH, cached_model, max_diff, recompute_spans
from trajstore import Checkpoint, open_store

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[3]
TRAJSTORE = shutil.which("trajstore") or str(Path(sys.executable).parent / "trajstore")
A = "tests.collectors.agents_for_tests"


def test_two_collectors_share_one_vllm_one_reloads_and_both_stamp_the_version_that_sampled(
        vllm_server: VLLMServer, vllm_model: Path, vllm_model_v2: Path, served_label: Callable[[], int],
        tmp_path: Path) -> None:
    import asyncio

    from collectors.policy import VLLMClient

    async def load(version: int) -> None:  # start from known weights: the shared server's are whatever
        async with VLLMClient(vllm_server.url) as client:
            await client.load_weights(str(vllm_model), version)

    first = served_label() + 1
    asyncio.run(load(first))
    weights = {first + i: (vllm_model_v2 if i % 2 else vllm_model) for i in range(4)}
    store_dir = tmp_path / "store"
    store = open_store(store_dir)
    with store.writer("learner") as learner:
        def announce(version: int) -> None:
            learner.append([Checkpoint(run="two", policy_version=version, step=version - first, consumed=[],
                                       meta={"path": str(weights[version]), "groups_per_version": 2},
                                       event_id=f"checkpoint:two:{version}")])

        announce(first)
        tasks = write_tasks(tmp_path / "tasks.jsonl", [{"id": f"t{i}", "prompt": f"task {i}"} for i in range(6)])
        env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
        procs = {role: spawn_child(
            [TRAJSTORE, "collect", "--store", str(store_dir), "--run", "two", "--tasks", tasks, "--n", "2",
             "--model", str(vllm_model), "--server", vllm_server.url, "--vllm", "--vllm-reload", role,
             "--policy-version", str(first), "--agent", f"{A}:chat", "--reward", f"{A}:score", "--forever",
             "--concurrency", "6", "--max-tokens", "16", "--seed", "7", "--plain", "--workdir", str(tmp_path / role)],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for role in ("weights", "follow")}
        try:
            writers: dict[str, str] = {}

            def versions_by_writer() -> dict[str, set[int]]:
                for role, proc in procs.items():
                    if proc.poll() is not None:
                        raise AssertionError(f"the {role} collector exited ({proc.returncode}): {proc.stdout.read()}")
                rows = store.query("SELECT writer, policy_version FROM turns WHERE run = 'two'").to_pylist()
                out: dict[str, set[int]] = {}
                for row in rows:
                    out.setdefault(row["writer"], set()).add(row["policy_version"])
                return out

            def wait_for(condition: Callable[[dict[str, set[int]]], bool], what: str) -> None:
                deadline = time.monotonic() + 180
                while not condition(versions_by_writer()):
                    assert time.monotonic() < deadline, f"timed out waiting for {what}"
                    time.sleep(0.3)

            wait_for(lambda seen: len(seen) == 2, "turns from both collectors")
            for version in range(first + 1, first + 4):
                announce(version)
                wait_for(lambda seen, v=version: all(v in versions for versions in seen.values()),
                         f"turns of version {version} from both collectors")
            writers = {w: w for w in versions_by_writer()}
        finally:
            outputs = {}
            for role, proc in procs.items():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)
            for role, proc in procs.items():
                try:
                    outputs[role], _ = proc.communicate(timeout=120)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    outputs[role], _ = proc.communicate()
    for role, proc in procs.items():
        assert proc.returncode == 130, f"{role}: {outputs[role]}"  # interrupted, as asked

    rows = rollout_rows(store, "two")
    assert rows and not [r for r in rows if r["status"] == "failed"], "no agent call failed through the reloads"
    turns = store.query("SELECT writer, policy_version, prompt_ids, output_ids, output_logprobs, "
                        "output_version_starts, output_version_values FROM turns WHERE run = 'two'").to_pylist()
    assert {t["writer"] for t in turns} == set(writers)
    samples = [Sample(prompt_ids=t["prompt_ids"], output_ids=t["output_ids"], output_logprobs=t["output_logprobs"],
                      text="", finish_reason="stop", policy_version=t["policy_version"],
                      version_starts=t["output_version_starts"], version_values=t["output_version_values"])
               for t in turns]
    models = {v: cached_model(str(p)) for v, p in weights.items()}
    others = {v: cached_model(str(vllm_model_v2 if p == vllm_model else vllm_model)) for v, p in weights.items()}
    for i, s in enumerate(samples):
        mine = recompute_spans(models, s)
        assert max_diff(s.output_logprobs, mine) < MATCH, \
            f"a turn stamped {s.version_values or s.policy_version} by {turns[i]['writer']} was not sampled so"
        theirs = recompute_spans(others, s)
        assert sum(abs(x - y) for x, y in zip(mine, theirs)) / len(mine) > DIFFER
    assert served_label() == first + 3
