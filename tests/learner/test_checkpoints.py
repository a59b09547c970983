"""The checkpoint directory contract: atomic versions, resume state, events, and the server loading them."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from learner import checkpoints  # noqa: E402
from tests.learner.synth import make_model  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    return make_model(tmp_path_factory.mktemp("models") / "tiny")


def trained(model_dir: Path, *, lr: float = 1e-3, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model after one AdamW step on a next-token loss (so the optimizer has state)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def info(**extra: object) -> dict[str, object]:
    return {"run": "exp", "parent": 0, "table_version": 7, "consumed": ["r1", "r2"], "metrics": {"loss": 0.5},
            "settings": {"lr": 1e-3}, **extra}


def test_publish_writes_a_whole_servable_version(model_dir: Path, tmp_path: Path) -> None:
    model, opt = trained(model_dir)
    path = checkpoints.publish(tmp_path, 1, 3, model, model_dir, opt, info=info(), adapter=False)
    assert path == tmp_path / "v000001"
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
            "generation_config.json", "trajstore_checkpoint.json", "learner_state.pt"} <= names
    record = json.loads((path / "trajstore_checkpoint.json").read_text())
    assert record["version"] == 1 and record["step"] == 3 and record["parent"] == 0 and record["run"] == "exp"
    assert record["consumed"] == ["r1", "r2"] and record["adapter"] is False
    assert record["base_model"] == str(model_dir.resolve()) and record["settings"] == {"lr": 1e-3}
    config = json.loads((path / "config.json").read_text())
    assert config["rope_theta"] == json.loads((model_dir / "config.json").read_text())["rope_theta"]
    assert (path / "generation_config.json").read_text() == (model_dir / "generation_config.json").read_text()
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    assert len(AutoTokenizer.from_pretrained(path)) == model.config.vocab_size
    assert not list(tmp_path.glob(".partial-*"))


def test_partial_leftovers_are_never_a_version_and_are_removed(model_dir: Path, tmp_path: Path) -> None:
    model, opt = trained(model_dir)
    checkpoints.publish(tmp_path, 1, 1, model, model_dir, opt, info=info(), adapter=False)
    # what a crash mid-publish leaves: a partial directory with some of the files, even the JSON
    partial = tmp_path / ".partial-v000002-deadbeef"
    shutil.copytree(tmp_path / "v000001", partial)
    (partial / "model.safetensors").write_bytes(b"torn")
    latest = checkpoints.latest(tmp_path)
    assert latest is not None and latest.version == 1 and latest.consumed == ("r1", "r2")
    assert not partial.exists()
    assert checkpoints.latest(tmp_path / "nothing-here") is None


def test_a_failed_publish_leaves_nothing_behind(model_dir: Path, tmp_path: Path) -> None:
    model, opt = trained(model_dir)
    with pytest.raises(AttributeError):  # not a transformers model: saving fails half way
        checkpoints.publish(tmp_path, 1, 1, torch.nn.Linear(2, 2), model_dir, opt, info=info(), adapter=False)
    assert list(tmp_path.iterdir()) == []
    checkpoints.publish(tmp_path, 1, 1, model, model_dir, opt, info=info(), adapter=False)
    with pytest.raises(checkpoints.CheckpointError, match="already exists"):
        checkpoints.publish(tmp_path, 1, 2, model, model_dir, opt, info=info(), adapter=False)


def test_resume_restores_weights_optimizer_and_rng(model_dir: Path, tmp_path: Path) -> None:
    model, opt = trained(model_dir)
    torch.manual_seed(123)
    path = checkpoints.publish(tmp_path, 1, 1, model, model_dir, opt, info=info(), adapter=False)
    rng_after_publish = torch.rand(3)

    resumed = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    opt2 = torch.optim.AdamW(resumed.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    torch.manual_seed(999)
    checkpoints.restore(checkpoints.load_state(checkpoints.read_info(path)), opt2, resumed)
    assert torch.equal(torch.rand(3), rng_after_publish)
    for group, group2 in zip(opt.state_dict()["state"].values(), opt2.state_dict()["state"].values()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch.as_tensor(group[key]), torch.as_tensor(group2[key]))
    # the next step from the resumed state is the step the original would have taken
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(5))
    for m, o in ((model, opt), (resumed, opt2)):
        m(input_ids=ids, labels=ids).loss.backward()
        o.step()
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def test_checkpoint_events_have_deterministic_ids(model_dir: Path, tmp_path: Path) -> None:
    model, opt = trained(model_dir)
    path = checkpoints.publish(tmp_path, 4, 9, model, model_dir, opt, info=info(), adapter=False)
    event = checkpoints.checkpoint_event(checkpoints.read_info(path), "exp", {"loss": 0.5}, 8, 2)
    assert event.event_id == "checkpoint:exp:4" and event.policy_version == 4 and event.step == 9
    assert list(event.consumed) == ["r1", "r2"] and event.table_version == 7
    assert dict(event.meta or {}) == {"path": str(path.resolve()), "adapter": False,
                                      "base_model": str(model_dir.resolve()), "groups_per_version": 8,
                                      "max_staleness": 2}
    zero = checkpoints.initial_event(model_dir, "exp", 8, 2)
    assert zero.event_id == "checkpoint:exp:0" and zero.policy_version == 0 and list(zero.consumed) == []
    assert (zero.meta or {})["path"] == str(model_dir.resolve()) and (zero.meta or {})["groups_per_version"] == 8


def test_the_embedded_server_serves_a_published_version(model_dir: Path, tmp_path: Path) -> None:
    from collectors.embedded.app import serve_in_thread
    from tests.collectors import http

    model, opt = trained(model_dir, lr=1e-2)
    path = checkpoints.publish(tmp_path, 1, 1, model, model_dir, opt, info=info(), adapter=False)
    body = {"prompt": [50, 51, 52, 53], "seed": 7, "temperature": 1.0, "max_tokens": 12, "logprobs": 0,
            "return_token_ids": True, "ignore_eos": True}
    threads = torch.get_num_threads()
    try:
        with serve_in_thread(model_dir, threads=1, device="cpu") as server:
            before = http.post(server.url + "/v1/completions", body).json()
            again = http.post(server.url + "/v1/completions", body).json()
            reply = http.post(server.url + "/v1/load_weights", {"path": str(path), "version": 1})
            assert reply.status == 200, reply.body
            after = http.post(server.url + "/v1/completions", body).json()
    finally:
        torch.set_num_threads(threads)
    assert before["choices"][0] == again["choices"][0]  # the seeded sample is reproducible
    assert before["policy_version"] == 0 and after["policy_version"] == 1
    b, a = before["choices"][0], after["choices"][0]
    assert (b["token_ids"], b["logprobs"]["token_logprobs"]) != (a["token_ids"], a["logprobs"]["token_logprobs"])
