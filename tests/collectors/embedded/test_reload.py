"""Hot reload while serving: in-flight requests go on with the new weights, every token's version is exact."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from collectors.embedded.app import serve_in_thread
from collectors.errors import VersionConflict
from collectors.policy import Sample, parse_completion
from collectors.policy.versions import int_label
from tests.collectors import http
from tests.collectors.recompute import DIFFER, MATCH, cached_model, max_diff, recompute_spans

EMBEDDED_PARITY = 1e-6  # max |embedded server - float32 recomputation| per token, across a reload too (issue 24)


def wait_until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def sample_of(body: dict[str, Any], prompt: list[int]) -> Sample:
    """The completion as the embedded client reads it (version spans included)."""
    return parse_completion(body, prompt, policy_version=-1, url="embedded", label=int_label)


def test_reload_lands_mid_call_and_every_token_is_stamped_with_the_weights_that_sampled_it(
        tiny_model: Path, tiny_model_v2: Path) -> None:
    """A reload during a long generation neither aborts, drains nor resamples it: the weights change between
    two decode steps, the call goes on over its cache, and its tokens carry two version spans, each token's
    logprob that of the version stamped on it (recomputed over the cache as the server kept it)."""
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
            post("load", "/v1/load_weights", {"path": str(tiny_model_v2), "version": 2})
            assert server.engine.running == 1, "the reload returned while the long call still generates"
            post("queued", "/v1/completions", {**body, "max_tokens": 20})  # sent after the reload
            long.join()
            post("after", "/v1/completions", {**body, "max_tokens": 20})
            stats = server.engine.stats
            assert stats.reloads == 1 and stats.inflight_swaps == 1
            assert stats.requests == 3, "no call was sampled again"

            assert results["load"].status == 200 and results["load"].json()["policy_version"] == 2
            long_r, queued, after = (results[k].json() for k in ("long", "queued", "after"))
            # the first token's version, as before; the spans say where version 2 took over
            assert long_r["policy_version"] == 1 and results["long"].headers["X-Policy-Version"] == "1"
            long_c = long_r["choices"][0]
            assert long_c["finish_reason"] == "length" and len(long_c["token_ids"]) == 1200
            spans = long_c["weight_versions"]
            assert [s["version"] for s in spans] == ["1", "2"] and 5 < spans[1]["start"] < 1200
            sample = sample_of(long_r, body["prompt"])
            assert sample.policy_version == 1 and sample.version_values == [1, 2]
            assert sample.version_starts == [0, spans[1]["start"]]
            assert queued["policy_version"] == after["policy_version"] == 2
            assert queued["choices"][0]["weight_versions"] == [{"version": "2", "start": 0, "end": 20}]
            assert queued["choices"][0]["token_ids"] == after["choices"][0]["token_ids"]

            models = {1: cached_model(str(tiny_model)), 2: cached_model(str(tiny_model_v2))}
            got = sample.output_logprobs
            # the embedded server against a float32 recomputation under the stamped versions: the parity bound
            assert max_diff(got, recompute_spans(models, sample)) <= EMBEDDED_PARITY
            # stamped with one version, the tokens after the reload would not match
            one = replace(sample, version_starts=None, version_values=None)
            cut = sample.version_starts[1]
            assert sum(abs(a - b) for a, b in zip(got[cut:], recompute_spans(models, one)[cut:])) / (1200 - cut) > DIFFER
            queued_s = sample_of(queued, body["prompt"])
            assert queued_s.version_starts is None
            assert max_diff(queued_s.output_logprobs, recompute_spans(models, queued_s)) < MATCH

            with pytest.raises(VersionConflict):  # the Python API, same rules
                server.engine.load_weights(tiny_model, 2)
            server.engine.load_weights(tiny_model, 3)
            models = http.get(server.url + "/v1/models").json()["data"][0]
            assert models["policy_version"] == 3 and models["root"] == str(tiny_model)
            back = http.post(server.url + "/v1/completions", {**body, "max_tokens": 20}).json()
            head = min(20, cut)  # the long call's tokens before the reload came from these weights
            assert back["policy_version"] == 3 and back["choices"][0]["token_ids"][:head] == long_c["token_ids"][:head]
    finally:
        torch.set_num_threads(threads)


def test_a_checkpoint_with_another_cache_layout_waits_for_the_calls_in_flight(tiny_model: Path, tmp_path: Path) -> None:
    """Three layers cannot continue a two-layer cache: the call in flight finishes on its weights, then the swap."""
    from collectors.model.build import init_model
    from tests.collectors.conftest import TINY

    deeper = tmp_path / "deeper"
    init_model(deeper, replace(TINY, layers=3), seed=5)
    threads = torch.get_num_threads()
    results: dict[str, http.Reply] = {}
    try:
        with serve_in_thread(tiny_model, threads=1, device="cpu", policy_version=1) as server:
            body = dict(prompt=[50, 51, 52], seed=9, max_tokens=300, ignore_eos=True, return_token_ids=True)
            long = threading.Thread(target=lambda: results.update(long=http.post(server.url + "/v1/completions",
                                                                                 body)))
            long.start()
            wait_until(lambda: server.engine.running == 1 and server.engine.stats.decode_steps > 5)
            load = http.post(server.url + "/v1/load_weights", {"path": str(deeper), "version": 2})
            long.join()
            assert load.status == 200 and server.engine.stats.inflight_swaps == 0
            choice = results["long"].json()["choices"][0]
            assert choice["weight_versions"] == [{"version": "1", "start": 0, "end": 300}]
    finally:
        torch.set_num_threads(threads)
