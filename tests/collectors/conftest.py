"""Fixtures for the collectors: a tiny model made by init-model, a second checkpoint of it, a server.

The model is built once per session in a temporary directory (no downloads). The server runs
in-process on a free loopback port with one torch thread: on a small CPU a tiny model runs
fastest single-threaded, and the setting is restored when the module's server stops.

`vllm_server` is one real vLLM (the CPU build, from `.venv-vllm`) for the whole session, on
`vllm_model`: the tiny model's shape with heads of 32 (vLLM's CPU attention takes no smaller)
and, like init-model's default, an LM head of its own (tied ones do not hot-reload in vLLM).
Its queue limit is small (`VLLM_MAX_QUEUED`), so tests that send more at once meet vLLM's
real 503. Tests share it: whoever reloads it loads a version above the one it serves
(`served_label`). Its tests are skipped only where vLLM's CPU backend cannot run (not x86-64
Linux with AVX2), or outside CI when the vLLM virtualenv was not built (`make test` builds it;
with CI set a missing virtualenv fails the tests instead).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach for the Hub

from collectors.embedded.app import RunningServer, serve_in_thread  # noqa: E402
from collectors.model.build import ModelSize, init_model  # noqa: E402
from collectors.policy.vllm_server import (  # noqa: E402
    VLLMServer,
    VLLMUnavailable,
    cpu_problem,
    start_vllm,
    vllm_python,
)
from tests.collectors.proxy_harness import Harness  # noqa: E402

TINY = ModelSize(vocab_size=2048, hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate_size=128,
                 max_positions=2048, tie_embeddings=True)
VLLM_TINY = ModelSize(vocab_size=2048, hidden_size=64, layers=2, heads=2, kv_heads=1, intermediate_size=128,
                      max_positions=2048)
VLLM_MAX_QUEUED = 8


@pytest.fixture(scope="session")
def tiny_size() -> ModelSize:
    return TINY


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny-v1"
    init_model(path, TINY, seed=0)
    return path


def new_weights(model_dir: Path, path: Path, seed: int = 1234) -> Path:
    """The same architecture and tokenizer with freshly initialized weights: a 'newer checkpoint'."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(model_dir / name, path / name)
    return path


@pytest.fixture(scope="session")
def tiny_model_v2(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return new_weights(tiny_model, tmp_path_factory.mktemp("models") / "tiny-v2")


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "vllm-tiny-v1"
    init_model(path, VLLM_TINY, seed=0)
    return path


@pytest.fixture(scope="session")
def vllm_model_v2(vllm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return new_weights(vllm_model, tmp_path_factory.mktemp("models") / "vllm-tiny-v2")


def vllm_or_skip() -> None:
    """Skip where vLLM's CPU backend cannot run, or (outside CI) where its virtualenv was not built."""
    problem = cpu_problem()
    if problem:
        pytest.skip(f"vLLM's CPU backend cannot run on this machine: {problem}")
    try:
        vllm_python()
    except VLLMUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI runs the vllm tests: {exc}")
        pytest.skip(f"{exc}. Outside CI these tests are skipped; CI fails without the virtualenv")


@pytest.fixture(scope="session")
def vllm_server(vllm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """One real vLLM for the session (see the module docstring), stopped by its process id at the end."""
    vllm_or_skip()
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    server = start_vllm(vllm_model, lora_rank=8, max_queued=VLLM_MAX_QUEUED, log_path=log)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def served_label(vllm_server: VLLMServer) -> Callable[[], int]:
    """The version the session's vLLM serves now (its weight-version label; 0 before any reload)."""
    import asyncio

    from collectors.policy import VLLMClient

    async def ask() -> int:
        async with VLLMClient(vllm_server.url) as client:
            return await client.served_label()

    return lambda: asyncio.run(ask())


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[RunningServer]:
    threads = torch.get_num_threads()
    try:
        with serve_in_thread(tiny_model, threads=1, max_batch=16, device="cpu") as running:
            yield running
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def proxy(server: RunningServer, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    """A capture proxy (one per test module, with its own store) in front of the embedded server,
    recording every upstream sample so stored turns can be checked against them."""
    from collectors.policy import EmbeddedClient
    from tests.collectors.proxy_harness import Recording, running_proxy

    with running_proxy(Recording(EmbeddedClient(server.url)), tmp_path_factory.mktemp("store"), tiny_model) as h:
        yield h
