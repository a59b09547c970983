"""Fixtures for the collectors: a tiny model made by init-model, a second checkpoint of it, a server.

The model is built once per session in a temporary directory (no downloads). The server runs
in-process on a free loopback port with one torch thread: on a small CPU a tiny model runs
fastest single-threaded, and the setting is restored when the module's server stops.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach for the Hub

from collectors.embedded.app import RunningServer, serve_in_thread  # noqa: E402
from collectors.model.build import ModelSize, init_model  # noqa: E402
from tests.collectors.proxy_harness import Harness  # noqa: E402

TINY = ModelSize(vocab_size=2048, hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate_size=128,
                 max_positions=2048)


@pytest.fixture(scope="session")
def tiny_size() -> ModelSize:
    return TINY


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny-v1"
    init_model(path, TINY, seed=0)
    return path


@pytest.fixture(scope="session")
def tiny_model_v2(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same architecture and tokenizer with freshly initialized weights: a 'newer checkpoint'."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tmp_path_factory.mktemp("models") / "tiny-v2"
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model), dtype=torch.float32)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(tiny_model / name, path / name)
    return path


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
