"""Hot reload while serving: in-flight requests finish on their weights, the version never lies."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from collectors.embedded.app import serve_in_thread
from collectors.errors import VersionConflict
from tests.collectors import http


def wait_until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def token_logprobs(model_dir: Path, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Temperature-1 logprobs of `output` under the checkpoint in `model_dir` (one full forward pass)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(output).unsqueeze(1)).squeeze(1)


def test_reload_under_load_stamps_each_response_with_the_weights_that_made_it(tiny_model: Path,
                                                                                tiny_model_v2: Path) -> None:
    threads = torch.get_num_threads()
    body: dict[str, Any] = dict(prompt=[50, 51, 52], seed=9, temperature=1.0, logprobs=0, return_token_ids=True,
                                ignore_eos=True)
    results: dict[str, http.Reply] = {}
    try:
        with serve_in_thread(tiny_model, threads=1, device="cpu", policy_version=1) as server:
            def post(key: str, route: str, payload: dict[str, Any]) -> None:
                results[key] = http.post(server.url + route, payload)

            long = threading.Thread(target=post, args=("long", "/v1/completions", {**body, "max_tokens": 1200}))
            long.start()
            wait_until(lambda: server.engine.running == 1 and server.engine.stats.decode_steps > 5)
            load = threading.Thread(target=post, args=("load", "/v1/load_weights",
                                                        {"path": str(tiny_model_v2), "version": 2}))
            load.start()
            wait_until(lambda: server.engine.reload_pending)
            assert server.engine.running == 1, "the long request should still be in flight while the reload waits"
            post("queued", "/v1/completions", {**body, "max_tokens": 20})  # sent mid-flight: runs after the swap
            long.join()
            load.join()
            post("after", "/v1/completions", {**body, "max_tokens": 20})
            assert server.engine.stats.reloads == 1

            assert results["load"].status == 200 and results["load"].json()["policy_version"] == 2
            long_r, queued, after = (results[k].json() for k in ("long", "queued", "after"))
            assert long_r["policy_version"] == 1 and results["long"].headers["X-Policy-Version"] == "1"
            assert queued["policy_version"] == after["policy_version"] == 2
            assert results["queued"].headers["X-Policy-Version"] == "2"
            long_c, queued_c = long_r["choices"][0], queued["choices"][0]
            assert len(long_c["token_ids"]) == 1200
            # same prompt, same seed, new weights: different tokens; the new weights are deterministic
            assert queued_c["token_ids"] != long_c["token_ids"][:20]
            assert queued_c["token_ids"] == after["choices"][0]["token_ids"]
            # each response's logprobs are exactly those of the checkpoint it claims
            for model_dir, c in ((tiny_model, long_c), (tiny_model_v2, queued_c)):
                ref = token_logprobs(model_dir, body["prompt"], c["token_ids"])
                got = torch.tensor(c["logprobs"]["token_logprobs"])
                assert torch.allclose(got, ref, atol=1e-4), (model_dir, (got - ref).abs().max())

            with pytest.raises(VersionConflict):  # the Python API, same rules
                server.engine.load_weights(tiny_model, 2)
            server.engine.load_weights(tiny_model, 3)
            models = http.get(server.url + "/v1/models").json()["data"][0]
            assert models["policy_version"] == 3 and models["root"] == str(tiny_model)
            back = http.post(server.url + "/v1/completions", {**body, "max_tokens": 20}).json()
            assert back["policy_version"] == 3 and back["choices"][0]["token_ids"] == long_c["token_ids"][:20]
    finally:
        torch.set_num_threads(threads)
