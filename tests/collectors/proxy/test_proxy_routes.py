"""MoE routes from `trajstore init-model --moe`, through the embedded server's JSON and the capture proxy, into turns.

The model is built by the CLI, served over loopback HTTP, and called by the real OpenAI SDK
through the proxy for a three-turn chat. Each stored turn must hold exactly the slice of its own
call's routes that `trajstore.routes` prescribes (its prompt delta and its output, shifted to the
position that predicted each token), and the sample must line up with its tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from cli.main import main
from collectors.embedded.app import serve_in_thread
from collectors.policy import EmbeddedClient
from tests.collectors.proxy_harness import MODEL, Harness, Recording, openai_client, running_proxy
from trajstore import routes


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "moe"
    result = CliRunner().invoke(main, ["init-model", str(path), "--moe", "--experts", "4", "--experts-per-token", "2",
                                       "--vocab-size", "1024", "--max-positions", "1024"])
    assert result.exit_code == 0, result.output
    assert "Qwen3-MoE (4 experts, top-2)" in result.output
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["num_experts"] == 4
    return path


@pytest.fixture(scope="module")
def moe_proxy(moe_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    threads = torch.get_num_threads()
    try:
        with serve_in_thread(moe_model, threads=1, device="cpu") as server, \
                running_proxy(Recording(EmbeddedClient(server.url)), tmp_path_factory.mktemp("store"), moe_model) as h:
            yield h
    finally:
        torch.set_num_threads(threads)


def test_init_model_refuses_more_experts_per_token_than_experts(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["init-model", str(tmp_path / "m"), "--moe", "--experts", "2",
                                       "--experts-per-token", "3"])
    assert result.exit_code == 2 and "experts_per_token 3 must be at most experts 2" in result.output


def test_each_turn_stores_its_own_calls_routes_aligned_with_its_tokens(moe_proxy: Harness) -> None:
    rollout = moe_proxy.open(group_id="moe")
    client = openai_client(rollout)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Name three fruits."}]
    for i in range(3):
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, seed=i)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": f"And {i}?"}]
    turns = moe_proxy.turns(rollout["rollout_id"])
    calls = moe_proxy.upstream.calls
    assert len(turns) == len(calls) == 3
    for t, (sent, sample) in zip(turns, calls, strict=True):
        assert sample.routed_experts.shape == (len(sent) + len(sample.output_ids) - 1, 2, 2)
        n = len(t["prompt_ids"]) + len(t["output_ids"])
        assert t["routed_experts_shape"] == [n, 2, 2]
        want = routes.turn_rows(sample.routed_experts, len(sent), len(sample.output_ids), len(t["prompt_ids"]))
        assert t["routed_experts"] == want.reshape(-1).tolist()
    (s,) = moe_proxy.store.query("SELECT tokens, routed_experts, routed_experts_shape FROM samples WHERE rollout_id = ?",
                                 [rollout["rollout_id"]]).to_pylist()
    table = np.array(s["routed_experts"]).reshape(s["routed_experts_shape"])
    assert len(table) == len(s["tokens"]) and (table[0] == routes.ABSENT).all() and (table[1:] >= 0).all()
    assert moe_proxy.close(rollout).status == 200


def test_a_streamed_call_stores_the_routes_of_its_last_event(moe_proxy: Harness) -> None:
    rollout = moe_proxy.open(group_id="moe-stream")
    stream = openai_client(rollout).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count."}], max_tokens=6, seed=3, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert isinstance(text, str)
    (t,) = moe_proxy.turns(rollout["rollout_id"])
    sent, sample = moe_proxy.upstream.calls[-1]
    assert sample.routed_experts is not None
    want = routes.turn_rows(sample.routed_experts, len(sent), len(sample.output_ids), len(t["prompt_ids"]))
    assert t["routed_experts"] == want.reshape(-1).tolist()
    assert t["routed_experts_shape"] == [len(t["prompt_ids"]) + len(t["output_ids"]), 2, 2]
    assert moe_proxy.close(rollout).status == 200
