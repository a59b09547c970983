"""Policy-server clients: one contract run against every server, then each failure a client must name.

The contract (`test_contract_*`) runs against the embedded server (real, serving the tiny
model), the fake of vLLM's HTTP API, and real vLLM (the CPU build, marked `vllm`: the session's
server of tests/collectors/conftest.py, on a model with heads of 32). The `test_vllm_*` tests
cover what only `VLLMClient` does against the fake, where timing can be controlled (reload
protocols, stamping from the weight-version label, 503 retries); test_vllm_real.py runs them
against real vLLM. The `test_error_*` tests the named errors. No pytest-asyncio: each test
runs its scenario with `asyncio.run`.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from collectors.embedded.app import RunningServer, serve_in_thread
from collectors.errors import VersionConflict, WeightLoadError
from collectors.policy import (
    EmbeddedClient,
    PolicyClient,
    PolicyServerBadResponse,
    PolicyServerFailed,
    PolicyServerRejected,
    PolicyServerTimeout,
    PolicyServerUnreachable,
    SamplingParams,
    StreamedSample,
    VLLMClient,
)
from tests.collectors.fake_vllm import FakeVLLM, fake_vllm, free_port
from trajstore.versions import expand

PROMPT = [50, 51, 52, 53]
VOCAB = 2048  # the tiny model's, and the fake's


@dataclass
class Backend:
    client: EmbeddedClient | VLLMClient
    model_name: str
    weights: tuple[Path, Path]  # two checkpoints to reload between
    fake: FakeVLLM | None = None
    engine: Any = None  # the embedded server's engine
    version: int = 0  # the version it serves when opened

    def with_model(self, model: str) -> EmbeddedClient | VLLMClient:
        return type(self.client)(self.client.base_url, model=model)


Open = Callable[..., AbstractAsyncContextManager[Backend]]

VLLM_REAL = pytest.param("vllm", marks=pytest.mark.vllm)


@pytest.fixture(params=["embedded", "vllm-fake", VLLM_REAL])
def open_backend(request: pytest.FixtureRequest, tiny_model: Path, tiny_model_v2: Path) -> Open:
    """`open_backend(fresh=False, version=0)`: a client on a server serving policy version `version`
    (a fresh server where that matters: the embedded server is module-wide). Real vLLM is shared by
    the session and serves whatever version the tests before left it on (`Backend.version`)."""
    weights = (tiny_model, tiny_model_v2)

    @asynccontextmanager
    async def embedded(fresh: bool = False, version: int = 0) -> AsyncIterator[Backend]:
        if not fresh:
            server: RunningServer = request.getfixturevalue("server")
            async with EmbeddedClient(server.url) as client:
                yield Backend(client, server.engine.model_dir, weights, engine=server.engine)
            return
        threads = torch.get_num_threads()
        try:
            with serve_in_thread(tiny_model, threads=1, device="cpu", policy_version=version) as running:
                async with EmbeddedClient(running.url) as client:
                    yield Backend(client, running.engine.model_dir, weights, engine=running.engine, version=version)
        finally:
            torch.set_num_threads(threads)

    @asynccontextmanager
    async def vllm_fake(fresh: bool = False, version: int = 0) -> AsyncIterator[Backend]:
        # untied weights: VLLMClient refuses to reload a tied LM head (vLLM would keep the old one)
        untied = (request.getfixturevalue("vllm_model"), request.getfixturevalue("vllm_model_v2"))
        async with fake_vllm(weights=str(untied[0])) as fake, VLLMClient(fake.url, policy_version=version) as client:
            yield Backend(client, fake.model, untied, fake, version=version)

    @asynccontextmanager
    async def vllm_real(fresh: bool = False, version: int = 0) -> AsyncIterator[Backend]:
        server = request.getfixturevalue("vllm_server")
        real_weights = (request.getfixturevalue("vllm_model"), request.getfixturevalue("vllm_model_v2"))
        async with VLLMClient(server.url) as client:
            yield Backend(client, server.model, real_weights, version=await client.served_label())

    return {"embedded": embedded, "vllm-fake": vllm_fake, "vllm": vllm_real}[request.param]


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(scenario())  # type: ignore[arg-type]


# ---- the contract ----------------------------------------------------------------------------
def test_contract_a_sample_pairs_every_sampled_id_with_its_logprob(open_backend: Open) -> None:
    async def scenario() -> None:
        async with open_backend() as b:
            assert isinstance(b.client, PolicyClient)
            s = await b.client.complete(PROMPT, SamplingParams(max_tokens=12, seed=1), session_id="s-1")
            assert s.prompt_ids == PROMPT and 1 <= len(s.output_ids) <= 12
            assert len(s.output_logprobs) == len(s.output_ids)
            assert all(isinstance(t, int) and 0 <= t < VOCAB for t in s.output_ids)
            assert all(isinstance(x, float) and x <= 1e-6 for x in s.output_logprobs)
            assert s.finish_reason in ("stop", "length") and isinstance(s.text, str)
            assert s.policy_version == b.version
            assert b.model_name in await b.client.models()
    run(scenario)


def test_contract_max_tokens_ends_with_length(open_backend: Open) -> None:
    async def scenario() -> None:
        async with open_backend() as b:
            s = await b.client.complete(PROMPT, SamplingParams(max_tokens=5, seed=3))
            assert len(s.output_ids) == 5 and s.finish_reason == "length" and s.stop_reason is None
    run(scenario)


def test_contract_a_stop_string_cuts_the_text_and_keeps_the_sampled_tokens(open_backend: Open) -> None:
    async def scenario() -> None:
        async with open_backend() as b:
            body = SamplingParams(max_tokens=30, seed=5)
            full = await b.client.complete(PROMPT, body)
            stop = full.text[len(full.text) // 2:len(full.text) // 2 + 3]
            stopped = await b.client.complete(PROMPT, SamplingParams(max_tokens=30, seed=5, stop=(stop, "never-appears")))
            assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
            assert stopped.text == full.text[:full.text.index(stop)]
            assert stopped.output_ids == full.output_ids[:len(stopped.output_ids)]
            assert len(stopped.output_logprobs) == len(stopped.output_ids)
    run(scenario)


def test_contract_a_seed_reproduces_a_sample_and_another_seed_does_not(open_backend: Open) -> None:
    async def scenario() -> None:
        async with open_backend() as b:
            first, again, other = [await b.client.complete(PROMPT, SamplingParams(max_tokens=12, seed=seed))
                                   for seed in (11, 11, 12)]
            assert first.output_ids == again.output_ids and first.output_ids != other.output_ids
            assert first.output_logprobs == pytest.approx(again.output_logprobs, abs=1e-5)
    run(scenario)


async def streamed(client: PolicyClient, params: SamplingParams) -> tuple[Any, int]:
    """The stream of one completion joined into a sample, and how many chunks it came in."""
    joined, chunks = StreamedSample(PROMPT), 0
    async for chunk in client.stream(PROMPT, params, session_id="s-1"):
        joined.add(chunk)
        chunks += 1
    return joined.sample(), chunks


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=12, seed=1), SamplingParams(max_tokens=30, seed=5,
                                                                                          logprobs=3)],
                         ids=["plain", "top-logprobs"])
def test_contract_a_stream_joins_into_exactly_the_sample_complete_returns(open_backend: Open,
                                                                          params: SamplingParams) -> None:
    async def scenario() -> None:
        async with open_backend() as b:
            whole = await b.client.complete(PROMPT, params)
            joined, chunks = await streamed(b.client, params)
            assert chunks >= len(whole.output_ids) and joined.output_ids == whole.output_ids
            assert joined.output_logprobs == pytest.approx(whole.output_logprobs, abs=1e-5)
            assert (joined.finish_reason, joined.stop_reason, joined.policy_version, joined.text) == (
                whole.finish_reason, whole.stop_reason, whole.policy_version, whole.text)
            if params.logprobs:
                assert whole.top_logprobs is not None and len(whole.top_logprobs) == len(whole.output_ids)
                assert [set(t) for t in joined.top_logprobs] == [set(t) for t in whole.top_logprobs]
                assert all(len(t) >= 1 for t in whole.top_logprobs)
            else:
                assert whole.top_logprobs is None and joined.top_logprobs is None
    run(scenario)


def test_contract_a_streamed_stop_string_never_reaches_the_text(open_backend: Open) -> None:
    async def scenario() -> None:
        async with open_backend() as b:
            full = await b.client.complete(PROMPT, SamplingParams(max_tokens=30, seed=5))
            stop = full.text[len(full.text) // 2:len(full.text) // 2 + 3]
            params = SamplingParams(max_tokens=30, seed=5, stop=(stop,))
            pieces = [c.text async for c in b.client.stream(PROMPT, params)]
            assert "".join(pieces) == full.text[:full.text.index(stop)]
    run(scenario)


def test_contract_closing_a_stream_stops_the_request_on_the_server(open_backend: Open) -> None:
    async def scenario() -> None:
        async with open_backend() as b:
            before = b.engine.stats.generated_tokens if b.engine else 0
            stream = b.client.stream(PROMPT, SamplingParams(max_tokens=1500, seed=2, stop=("never-appears",)))
            first = await anext(stream)
            await stream.aclose()
            assert first.finish_reason is None and first.output_ids
            if b.engine is not None:  # the embedded server's engine drops the row long before max_tokens
                for _ in range(500):
                    if b.engine.running == 0:
                        break
                    await asyncio.sleep(0.01)
                assert b.engine.running == 0 and b.engine.stats.generated_tokens - before < 1500
    run(scenario)


def test_contract_concurrent_completions_share_one_client(open_backend: Open) -> None:
    async def scenario() -> None:
        async with open_backend() as b:
            samples = await asyncio.gather(*(b.client.complete(PROMPT, SamplingParams(max_tokens=6, seed=i))
                                             for i in range(16)))
            assert all(len(s.output_ids) == len(s.output_logprobs) > 0 for s in samples)
            assert len({tuple(s.output_ids) for s in samples}) > 1
    run(scenario)


def test_contract_the_version_stamped_is_the_version_that_sampled(open_backend: Open) -> None:
    async def scenario() -> None:
        async with open_backend(fresh=True, version=1) as b:
            v1, v2 = b.weights
            v = b.version
            await b.client.load_weights(str(v1), v + 1)
            sampling = SamplingParams(max_tokens=16, seed=9)
            first = await b.client.complete(PROMPT, sampling)
            assert first.policy_version == v + 1
            await b.client.load_weights(str(v2), v + 2)
            after = await b.client.complete(PROMPT, sampling)
            # random tiny models sample nearly uniformly, so a seed may draw the same ids: compare logprobs
            assert after.policy_version == v + 2
            assert (after.output_ids, after.output_logprobs) != (first.output_ids, pytest.approx(first.output_logprobs))
            with pytest.raises(VersionConflict):
                await b.client.load_weights(str(v1), v + 2)
            with pytest.raises(WeightLoadError, match="no-such-checkpoint"):
                await b.client.load_weights("/no-such-checkpoint", v + 3)
            await b.client.load_weights(str(v1), v + 3)  # back to the first weights, a new version
            back = await b.client.complete(PROMPT, sampling)
            assert back.policy_version == v + 3 and back.output_ids == first.output_ids
            assert back.output_logprobs == pytest.approx(first.output_logprobs, abs=1e-4)
    run(scenario)


def test_contract_a_refused_request_quotes_the_server(open_backend: Open) -> None:
    async def scenario() -> None:
        async with open_backend() as b:
            with pytest.raises(PolicyServerRejected) as oov:
                await b.client.complete([1, VOCAB + 5], SamplingParams(max_tokens=4))
            said = oov.value.server_message or ""
            assert oov.value.status == 400 and "out of vocabulary" in said.lower()
            assert b.client.base_url in str(oov.value) and said in str(oov.value)
            if isinstance(b.client, VLLMClient):  # vLLM's generate route samples (up to the context's end) instead
                long = await b.client.complete(PROMPT, SamplingParams(max_tokens=100_000))
                assert long.finish_reason in ("stop", "length") and 0 < len(long.output_ids) < 100_000
            else:
                with pytest.raises(PolicyServerRejected, match="maximum context length|max_model_len"):
                    await b.client.complete(PROMPT, SamplingParams(max_tokens=100_000))
            async with b.with_model("no-such-model") as other:
                with pytest.raises(PolicyServerRejected, match="does not exist") as unknown:
                    await other.complete(PROMPT, SamplingParams(max_tokens=4))
            assert unknown.value.status == 404
    run(scenario)


# ---- what only the vLLM client does -------------------------------------------------------------
async def _until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.002)


def test_vllm_client_sends_token_ids_and_forwards_the_session() -> None:
    async def scenario() -> None:
        async with fake_vllm() as fake, VLLMClient(fake.url) as client:
            await client.complete(PROMPT, SamplingParams(max_tokens=3, temperature=0.7, top_k=20, seed=4),
                                  session_id="rollout-7")
            await client.complete(PROMPT, SamplingParams(max_tokens=3))
            first, second = fake.served
            assert first.session_id == "rollout-7" and second.session_id is None
            assert first.body == {"prompt": PROMPT, "max_tokens": 3, "temperature": 0.7, "top_p": 1.0, "top_k": 20,
                                  "stop": [], "logprobs": 0, "return_token_ids": True, "seed": 4}
            assert "seed" not in second.body and "model" not in second.body
    run(scenario)


def test_vllm_weight_reload_keeps_calls_in_flight_and_stamps_each_token_with_its_version(vllm_model: Path,
                                                                                       vllm_model_v2: Path) -> None:
    """A keep-mode pause: the calls in flight freeze, go on with the new weights, and come back with the spans
    of each version; none is aborted, drained or sent again."""
    async def scenario() -> None:
        async with fake_vllm(weights=str(vllm_model)) as fake, VLLMClient(fake.url, policy_version=1) as client:
            fake.token_delay_s = 0.002
            early = [asyncio.create_task(client.complete(PROMPT, SamplingParams(max_tokens=40, seed=i))) for i in range(4)]
            await _until(lambda: len(fake.served) == 4 and all(s.token_ids for s in fake.served))
            await client.load_weights(str(vllm_model_v2), 2)  # returns without waiting for the calls in flight
            assert not any(task.done() for task in early), "the calls in flight were neither drained nor aborted"
            late = [asyncio.create_task(client.complete(PROMPT, SamplingParams(max_tokens=5, seed=i))) for i in range(4)]
            early_samples, late_samples = await asyncio.gather(asyncio.gather(*early), asyncio.gather(*late))
            assert len(fake.served) == 8, "one request per call: none sent again"
            assert [s.policy_version for s in early_samples] == [1] * 4
            assert all(s.version_values == [1, 2] and 0 < s.version_starts[1] < 40 for s in early_samples)
            assert all(s.policy_version == 2 and s.version_starts is None for s in late_samples)
            for sample in [*early_samples, *late_samples]:
                (served,) = [s for s in fake.served if s.token_ids == sample.output_ids]
                stamped = expand(sample.version_starts, sample.version_values, len(sample.output_ids),
                                 sample.policy_version)
                assert stamped == [1 if label == "default" else int(label) for label in served.labels]
            assert [route for route, _ in fake.control] == ["/pause", "/collective_rpc", "/update_weight_version",
                                                             "/reset_prefix_cache", "/resume"]
            assert fake.control[0][1] == "keep" and fake.control[2][1] == "2" and fake.weight_version == "2"
            assert fake.control[1][1] == {"method": "reload_weights", "kwargs": {"weights_path": str(vllm_model_v2)},
                                          "paused": True}
            streamed = StreamedSample(list(PROMPT))
            async for chunk in client.stream(PROMPT, SamplingParams(max_tokens=5, seed=9)):
                streamed.add(chunk)
            assert streamed.sample().policy_version == 2 and streamed.sample().version_starts is None
    run(scenario)


def test_vllm_without_the_generate_route_says_how_to_start_it() -> None:
    async def scenario() -> None:
        async with fake_vllm(scale_out=False) as fake, VLLMClient(fake.url) as client:
            with pytest.raises(PolicyServerRejected, match="--enable-scale-out"):
                await client.complete(PROMPT, SamplingParams(max_tokens=2))
    run(scenario)


def test_vllm_a_follower_stamps_the_reloads_another_client_makes(vllm_model: Path, vllm_model_v2: Path) -> None:

    async def scenario() -> None:
        async with fake_vllm(weights=str(vllm_model)) as fake, VLLMClient(fake.url) as owner, \
                VLLMClient(fake.url, reload="follow", follow_timeout_s=0.3) as follower:
            fake.token_delay_s = 0.002
            with pytest.raises(WeightLoadError, match="still serves version 0, not 1"):
                await follower.load_weights(str(vllm_model_v2), 1)
            samples = [asyncio.create_task(follower.complete(PROMPT, SamplingParams(max_tokens=20, seed=i)))
                       for i in range(12)]
            await asyncio.sleep(0.01)
            await owner.load_weights(str(vllm_model_v2), 1)
            await follower.load_weights(str(vllm_model_v2), 1)  # the owner loaded it: returns at once
            samples += [asyncio.create_task(follower.complete(PROMPT, SamplingParams(max_tokens=5, seed=i)))
                        for i in range(4)]
            done = await asyncio.gather(*samples)
            assert follower.policy_version == 1 and {s.policy_version for s in done[-4:]} == {1}
            assert len(fake.served) == 16, "one request per call: none sent again"
            for sample in done:  # each token stamped with the label (the weights) that sampled it
                (served,) = [s for s in fake.served if s.token_ids == sample.output_ids]
                stamped = expand(sample.version_starts, sample.version_values, len(sample.output_ids),
                                 sample.policy_version)
                assert stamped == [0 if label == "default" else int(label) for label in served.labels]
            assert [route for route, _ in fake.control].count("/pause") == 1, "only the owner pauses"
    run(scenario)


def test_vllm_503_while_the_queue_is_full_is_retried_until_served(vllm_model: Path) -> None:
    async def scenario() -> None:
        async with fake_vllm(weights=str(vllm_model), max_queued=2) as fake, VLLMClient(fake.url) as client:
            async with aiohttp.ClientSession() as http:
                await http.post(fake.url + "/pause", params={"mode": "wait"})
                calls = [asyncio.create_task(client.complete(PROMPT, SamplingParams(max_tokens=3, seed=i)))
                         for i in range(6)]
                await _until(lambda: fake.queue_refusals >= 4)
                await http.post(fake.url + "/resume")
            samples = await asyncio.gather(*calls)
            assert len(samples) == 6 and client.unavailable_retries >= 4
    run(scenario)


def test_vllm_lora_reload_names_the_adapter_per_request_and_never_pauses(tmp_path: Path) -> None:
    adapter = tmp_path / "adapter-v2"
    adapter.mkdir()

    async def scenario() -> None:
        async with fake_vllm(dev_mode=False) as fake, \
                VLLMClient(fake.url, model=fake.model, reload="lora", policy_version=1) as client, \
                VLLMClient(fake.url, model=fake.model, reload="lora", policy_version=1) as other:
            fake.token_delay_s = 0.002
            slow = asyncio.create_task(client.complete(PROMPT, SamplingParams(max_tokens=60, seed=1)))
            await _until(lambda: len(fake.served) == 1)
            await client.load_weights(str(adapter), 2)
            assert not slow.done(), "a LoRA reload does not wait for requests in flight"
            new = await client.complete(PROMPT, SamplingParams(max_tokens=5, seed=1))
            old = await slow
            assert (old.policy_version, new.policy_version) == (1, 2)
            assert [s.model for s in fake.served] == ["fake-model", "policy-v2"]
            assert fake.served[1].weights_at_start == str(adapter)
            await other.load_weights(str(adapter), 2)  # a second collector: the adapter is there already
            assert (await other.complete(PROMPT, SamplingParams(max_tokens=2))).policy_version == 2
            assert [route for route, _ in fake.control] == ["/v1/load_lora_adapter"] * 2  # no dev routes needed
            assert "policy-v2" in await client.models()
    run(scenario)


def test_vllm_reload_routes_missing_say_which_server_flag_enables_them(tmp_path: Path, vllm_model_v2: Path) -> None:
    async def scenario() -> None:
        async with fake_vllm(dev_mode=False, runtime_lora=False) as fake:
            async with VLLMClient(fake.url) as weights:
                with pytest.raises(WeightLoadError, match="VLLM_SERVER_DEV_MODE=1"):
                    await weights.load_weights(str(vllm_model_v2), 1)
                assert weights.policy_version == 0
                assert (await weights.complete(PROMPT, SamplingParams(max_tokens=2))).policy_version == 0
            async with VLLMClient(fake.url, reload="follow") as follower:
                with pytest.raises(WeightLoadError, match="no GET /weight_info"):
                    await follower.load_weights(str(vllm_model_v2), 1)
            async with VLLMClient(fake.url, reload="lora") as lora:
                with pytest.raises(WeightLoadError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"):
                    await lora.load_weights(str(tmp_path), 1)
    run(scenario)


def test_vllm_checkpoints_it_cannot_reload_are_refused_before_pausing(tmp_path: Path, tiny_model: Path) -> None:
    (tmp_path / "config.json").write_text("{}")

    async def scenario() -> None:
        async with fake_vllm() as fake, VLLMClient(fake.url) as client:
            for path, reason in (("/no-such-checkpoint", "not a checkpoint directory on this machine"),
                                 (str(tmp_path), "no \\*.safetensors"), (str(tiny_model), "tie_word_embeddings")):
                with pytest.raises(WeightLoadError, match=reason):
                    await client.load_weights(path, 1)
            assert fake.control == [] and not fake.paused
    run(scenario)


def test_vllm_a_failed_reload_keeps_the_server_paused_until_a_good_one(vllm_model_v2: Path) -> None:
    async def scenario() -> None:
        async with fake_vllm() as fake, VLLMClient(fake.url) as client:
            fake.fail_rpc = "Worker failed with error 'out of memory'"
            with pytest.raises(WeightLoadError, match="stays paused") as failed:
                await client.load_weights(str(vllm_model_v2), 1)
            assert "out of memory" in str(failed.value)
            assert fake.paused and client.policy_version == 0 and fake.weight_version == "default"
            with pytest.raises(WeightLoadError, match="stays paused"):
                await client.complete(PROMPT, SamplingParams(max_tokens=2))
            fake.fail_rpc = None
            await client.load_weights(str(vllm_model_v2), 1)
            assert not fake.paused
            assert (await client.complete(PROMPT, SamplingParams(max_tokens=2))).policy_version == 1
    run(scenario)


# ---- named errors -----------------------------------------------------------------------------
def test_error_a_vllm_without_return_token_ids_names_the_version_needed() -> None:
    async def scenario() -> None:
        async with fake_vllm(version=(0, 10, 1)) as fake, VLLMClient(fake.url) as client:
            with pytest.raises(PolicyServerBadResponse, match=r"vllm>=0\.10\.2"):
                await client.complete(PROMPT, SamplingParams(max_tokens=2))
    run(scenario)


@pytest.mark.parametrize(("malformed", "message"), [
    ("not-json", "not JSON"), ("no-logprobs", "--logprobs-mode processed_logprobs"), ("no-choices", "without choices"),
])
def test_error_a_malformed_completion_is_a_bad_response(malformed: str, message: str) -> None:
    async def scenario() -> None:
        async with fake_vllm() as fake, VLLMClient(fake.url) as client:
            fake.malformed = malformed
            with pytest.raises(PolicyServerBadResponse, match=message):
                await client.complete(PROMPT, SamplingParams(max_tokens=2))
    run(scenario)


def test_error_a_server_failure_is_a_5xx_error_quoting_the_server() -> None:
    async def scenario() -> None:
        async with fake_vllm() as fake, VLLMClient(fake.url) as client:
            fake.fail = (500, "CUDA error: out of memory")
            with pytest.raises(PolicyServerFailed, match="CUDA error: out of memory") as failed:
                await client.complete(PROMPT, SamplingParams(max_tokens=2))
            assert failed.value.status == 500
    run(scenario)


def test_a_connection_the_server_dropped_unanswered_is_retried_once_then_named() -> None:
    async def scenario() -> None:
        async with fake_vllm() as fake, VLLMClient(fake.url, reload="lora") as client:
            fake.disconnects = 1
            assert len((await client.complete(PROMPT, SamplingParams(max_tokens=3))).output_ids) == 3
            fake.disconnects = 2
            with pytest.raises(PolicyServerUnreachable, match="closed the connection"):
                await client.complete(PROMPT, SamplingParams(max_tokens=3))
            assert len(fake.served) == 1
    run(scenario)


def test_error_a_slow_server_times_out_with_the_limit_named() -> None:
    async def scenario() -> None:
        async with fake_vllm() as fake, VLLMClient(fake.url, timeout_s=0.1) as client:
            fake.delay_s = 0.4
            with pytest.raises(PolicyServerTimeout, match=r"within 0\.1 s"):
                await client.complete(PROMPT, SamplingParams(max_tokens=2))
    run(scenario)


def test_error_the_embedded_client_refuses_a_server_that_reports_no_version() -> None:
    async def scenario() -> None:
        async with fake_vllm() as fake, EmbeddedClient(fake.url) as client:
            with pytest.raises(PolicyServerBadResponse, match="use VLLMClient"):
                await client.complete(PROMPT, SamplingParams(max_tokens=2))
    run(scenario)


# VLLMClient with LoRA reloads: with full weights it reads the server's weight label (a retried GET) first
@pytest.mark.parametrize(("client_type", "hint"), [(EmbeddedClient, "trajstore serve --model DIR"),
                                                     (functools.partial(VLLMClient, reload="lora"), "vLLM is running")])
def test_error_an_unreachable_server_says_how_to_start_one(client_type: Callable[..., Any], hint: str) -> None:
    url = f"http://127.0.0.1:{free_port()}"

    async def scenario() -> None:
        async with client_type(url, connect_retries=2, retry_backoff_s=0.1) as client:
            started = time.monotonic()
            with pytest.raises(PolicyServerUnreachable, match=hint) as unreachable:
                await client.complete(PROMPT, SamplingParams(max_tokens=2))
            assert url in str(unreachable.value)
            assert time.monotonic() - started < 0.1, "completions are never retried"
            started = time.monotonic()
            with pytest.raises(PolicyServerUnreachable):
                await client.models()
            assert time.monotonic() - started >= 0.3, "control routes retry connection failures (0.1 + 0.2 s)"
    run(scenario)


def test_error_a_control_route_retry_reaches_a_server_that_comes_up_late() -> None:
    port = free_port()

    async def scenario() -> None:
        async with VLLMClient(f"http://127.0.0.1:{port}", connect_retries=4, retry_backoff_s=0.1) as client:
            models = asyncio.create_task(client.models())
            await asyncio.sleep(0.15)
            async with fake_vllm(port=port):
                assert await models == ["fake-model"]
    run(scenario)

