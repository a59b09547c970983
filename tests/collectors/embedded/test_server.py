"""The embedded server over real HTTP on loopback, checked against transformers itself."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from collectors.embedded.app import RunningServer, _is_loopback
from tests.collectors import http


def complete(server: RunningServer, **body: Any) -> dict:
    r = http.post(server.url + "/v1/completions", body)
    assert r.status == 200, r.body
    assert int(r.headers["X-Policy-Version"]) == r.body["policy_version"]
    return r.body


def choice(server: RunningServer, **body: Any) -> dict:
    return complete(server, **body)["choices"][0]


@pytest.fixture(scope="module")
def tok(tiny_model: Path):
    return AutoTokenizer.from_pretrained(tiny_model)


def test_string_and_token_id_prompts_give_the_same_completion(server: RunningServer, tok) -> None:
    ids = tok.encode("Hello there, what is the weather?")
    by_text = complete(server, prompt="Hello there, what is the weather?", max_tokens=8, seed=3, return_token_ids=True)
    by_ids = complete(server, prompt=ids, max_tokens=8, seed=3, return_token_ids=True)
    a, b = by_text["choices"][0], by_ids["choices"][0]
    assert a["prompt_token_ids"] == b["prompt_token_ids"] == ids
    assert a["token_ids"] == b["token_ids"] and len(a["token_ids"]) == 8
    assert a["text"] == b["text"] == tok.decode(a["token_ids"], skip_special_tokens=True)
    assert by_ids["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 8, "total_tokens": len(ids) + 8}
    assert by_ids["model"] == str(server.engine.model_dir) and by_ids["object"] == "text_completion"
    assert choice(server, prompt=ids, max_tokens=4)["token_ids"] is None  # only on request, as in vLLM


def test_max_tokens_ends_with_length(server: RunningServer) -> None:
    c = choice(server, prompt=[10, 11, 12], max_tokens=5, ignore_eos=True, return_token_ids=True)
    assert c["finish_reason"] == "length" and c["stop_reason"] is None and len(c["token_ids"]) == 5


def test_seed_reproduces_and_other_seeds_differ(server: RunningServer) -> None:
    body = dict(prompt=[20, 21, 22], max_tokens=12, temperature=1.0, return_token_ids=True)
    first, again = choice(server, seed=11, **body), choice(server, seed=11, **body)
    other = choice(server, seed=12, **body)
    assert first["token_ids"] == again["token_ids"] and first["token_ids"] != other["token_ids"]


def test_stop_strings_cut_text_and_keep_the_sampled_tokens(server: RunningServer, tok) -> None:
    body = dict(prompt=[30, 31], max_tokens=40, seed=5, ignore_eos=True, return_token_ids=True)
    full = choice(server, **body)
    text = full["text"]
    start = len(text) // 2
    stop = text[start:start + 2]
    cut = text.index(stop)
    stopped = choice(server, stop=[stop, "never-appears"], **body)
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == stop
    assert stopped["text"] == text[:cut]
    ids = stopped["token_ids"]
    assert ids == full["token_ids"][:len(ids)]  # same draws up to the stop, every sampled token returned
    assert stop in tok.decode(ids) and stop not in tok.decode(ids[:-1])
    kept = choice(server, stop=stop, include_stop_str_in_output=True, **body)
    assert kept["text"] == text[:cut + len(stop)]


def test_stop_token_ids_end_with_the_token_kept_in_token_ids(server: RunningServer, tok) -> None:
    body = dict(prompt=[30, 31], max_tokens=40, seed=5, ignore_eos=True, return_token_ids=True)
    full = choice(server, **body)["token_ids"]
    token = full[len(full) // 2]
    k = full.index(token)
    c = choice(server, stop_token_ids=[token], **body)
    assert c["token_ids"] == full[:k + 1] and c["finish_reason"] == "stop" and c["stop_reason"] == token
    assert c["text"] == tok.decode(full[:k], skip_special_tokens=True)


def reference_logprobs(model, ids: list[int], n_prompt: int, temperature: float, top_k: int,
                       top_p: float) -> torch.Tensor:
    """log-softmax of the processed distribution at each output position, from one full forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, n_prompt - 1:-1].double()  # (n_out, V)
    rows = []
    for row in logits:
        row = row / (temperature if temperature > 0 else 1.0)
        order = row.argsort(descending=True)
        keep = torch.ones_like(row, dtype=torch.bool)
        if top_k > 0:
            keep &= row >= row[order[top_k - 1]]
        if top_p < 1:  # nucleus of the top-k renormalized distribution, as vLLM applies them
            probs = torch.softmax(row.masked_fill(~keep, float("-inf")), -1)[order]
            mass_before = torch.cumsum(probs, 0) - probs  # mass of the better-ranked tokens
            keep_sorted = mass_before < top_p
            keep &= torch.zeros_like(keep).scatter(0, order, keep_sorted)
        rows.append(torch.log_softmax(row.masked_fill(~keep, float("-inf")), -1))
    return torch.stack(rows)


@pytest.fixture(scope="module")
def reference_model(tiny_model: Path):
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 40, 1.0), (1.3, 0, 0.6),
                                                              (0.9, 100, 0.8), (0.0, 0, 1.0), (0.0, 30, 0.9)])
def test_logprobs_are_those_of_the_distribution_sampled_from(server: RunningServer, reference_model, tok,
                                                            temperature: float, top_k: int, top_p: float) -> None:
    text = tok.apply_chat_template([{"role": "user", "content": "Say something."}], add_generation_prompt=True,
                                   tokenize=False)
    prompt = tok.encode(text)
    c = choice(server, prompt=prompt, max_tokens=24, temperature=temperature, top_k=top_k, top_p=top_p, seed=7,
               logprobs=3, return_token_ids=True, ignore_eos=True)
    out = c["token_ids"]
    ref = reference_logprobs(reference_model, prompt + out, len(prompt), temperature, top_k, top_p)
    got = torch.tensor(c["logprobs"]["token_logprobs"], dtype=torch.float64)
    expected = ref.gather(1, torch.tensor(out).unsqueeze(1)).squeeze(1)
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()
    for i, top in enumerate(c["logprobs"]["top_logprobs"]):
        # vLLM's shape: keyed by token text, the sampled token first, then the top 3; tokens whose texts
        # collide (partial UTF-8 bytes all read '\ufffd') keep the first entry
        values, ids = ref[i].topk(3)
        want = {tok.decode([out[i]]): expected[i].item()}
        for value, tid in zip(values.tolist(), ids.tolist()):
            want.setdefault(tok.decode([tid]), value)
        assert top.keys() == want.keys() and all(abs(top[k] - want[k]) < 1e-4 for k in want), (top, want)
    if temperature == 0:
        assert out == ref.argmax(-1).tolist()
    assert c["logprobs"]["tokens"] == [tok.decode([t]) for t in out]


async def _post_all(url: str, bodies: list[dict]) -> list[dict]:
    async with aiohttp.ClientSession() as session:
        async def one(body: dict) -> dict:
            async with session.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                return await r.json()
        return await asyncio.gather(*(one(b) for b in bodies))


def test_concurrent_requests_share_decode_steps_and_match_solo_runs(server: RunningServer) -> None:
    bodies = [dict(prompt=list(range(40 + i, 40 + 3 * i + 2)), max_tokens=20 + i, seed=100 + i,
                   temperature=0.8 + 0.05 * i, top_k=[0, 50][i % 2], logprobs=0, return_token_ids=True,
                   ignore_eos=True) for i in range(8)]
    solo = [choice(server, **b) for b in bodies]
    before = server.engine.stats.decode_steps
    together = asyncio.run(_post_all(server.url, bodies))
    steps = server.engine.stats.decode_steps - before
    sequential = sum(b["max_tokens"] - 1 for b in bodies)
    assert steps < sequential / 2, f"{steps} decode steps for 8 concurrent requests; {sequential} one by one"
    assert server.engine.stats.peak_batch >= 4
    for s, t in zip(solo, together):
        c = t["choices"][0]
        assert c["token_ids"] == s["token_ids"]
        assert max(abs(a - b) for a, b in zip(c["logprobs"]["token_logprobs"], s["logprobs"]["token_logprobs"])) < 1e-4


BAD = [
    (b"{not json", 400, None, "not valid JSON"),
    (b"[1, 2]", 400, None, "must be a JSON object"),
    (json.dumps({"max_tokens": 3}).encode(), 400, "prompt", "`prompt` is required"),
    (json.dumps({"prompt": [1, 10**6]}).encode(), 400, "prompt", "out of vocabulary"),
    (json.dumps({"prompt": [1], "n": 3}).encode(), 400, "n", "n=3 is not supported"),
    (json.dumps({"prompt": [1], "temperature": -0.5, "top_p": 1.5}).encode(), 400, "temperature", "`top_p`"),
    (json.dumps({"prompt": [1], "max_tokens": 5000}).encode(), 400, "max_tokens", "maximum context length"),
    (json.dumps({"prompt": [1], "model": "gpt-5"}).encode(), 404, "model", "`gpt-5` does not exist"),
]


@pytest.mark.parametrize(("data", "status", "param", "fragment"), BAD)
def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(server: RunningServer, data: bytes, status: int,
                                                                   param: str | None, fragment: str) -> None:
    r = http.post(server.url + "/v1/completions", data=data)
    assert r.status == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert error["param"] == param and fragment in error["message"], error
    assert choice(server, prompt=[1, 2], max_tokens=2)["finish_reason"] in ("length", "stop")


def test_routes_models_health_and_unknown_paths(server: RunningServer) -> None:
    models = http.get(server.url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == str(server.engine.model_dir)
    assert models["data"][0]["max_model_len"] == 2048
    health = http.get(server.url + "/health")
    assert health.status == 200 and health.headers["X-Policy-Version"] == "0"
    missing = http.get(server.url + "/v1/chat/completions")
    assert missing.status == 404 and "routes: POST /v1/completions" in missing.json()["error"]["message"]
    wrong_method = http.get(server.url + "/v1/completions")
    assert wrong_method.status == 405 and wrong_method.json()["error"]["type"] == "MethodNotAllowed"
    before = http.get(server.url + "/stats").json()
    choice(server, prompt=[1, 2, 3], max_tokens=4, ignore_eos=True)
    stats = http.get(server.url + "/stats").json()
    assert stats["device"] == "cpu" and stats["requests"] == before["requests"] + 1
    assert stats["generated_tokens"] == before["generated_tokens"] + 4
    assert stats["prefill_steps"] == before["prefill_steps"] + 1 and stats["decode_steps"] >= before["decode_steps"] + 3


def test_load_weights_refuses_bad_input(server: RunningServer) -> None:
    def post(body: dict) -> http.Reply:
        return http.post(server.url + "/v1/load_weights", body)
    assert post({"version": 1}).json()["error"]["param"] == "path"
    nothing = post({"path": "/nonexistent/ckpt", "version": 1})
    assert nothing.status == 400 and "no config.json" in nothing.json()["error"]["message"]
    stale = post({"path": str(server.engine.model_dir), "version": 0})
    assert stale.status == 409 and "versions only go up" in stale.json()["error"]["message"]
    assert _is_loopback("127.0.0.1") and _is_loopback("::1") and not _is_loopback("10.0.0.7")
    assert not _is_loopback(None)


def test_a_control_token_opens_load_weights_to_its_holders_only(tiny_model: Path) -> None:
    """With --control-token, collectors on other machines can reload the server; nobody without the token can
    (loopback included); without one, only loopback callers can (the test above)."""
    from collectors.embedded.app import serve_in_thread
    from collectors.errors import WeightLoadError
    from collectors.policy import EmbeddedClient

    token = "s3cret-token-0123456789"
    with pytest.raises(ValueError, match="at least 16"):
        with serve_in_thread(tiny_model, control_token="short", device="cpu"):
            pass
    with serve_in_thread(tiny_model, control_token=token, device="cpu") as srv:
        async def load(with_token: str | None, version: int) -> None:
            async with EmbeddedClient(srv.url, control_token=with_token) as client:
                await client.load_weights(str(tiny_model), version)

        for wrong in (None, token + "x"):
            with pytest.raises(WeightLoadError, match="control token"):
                asyncio.run(load(wrong, 1))
        body = {"path": str(tiny_model), "version": 1}
        for header in ("Bearer \xff\xfe", f"Bearer {token}\xff", "\xff"):  # urllib sends these bytes as Latin-1
            reply = http.call_with("POST", srv.url + "/v1/load_weights", body, {"Authorization": header})
            assert reply.status == 401 and "control token" in reply.json()["error"]["message"], reply.body
        assert srv.engine.policy_version == 0
        reply = http.call_with("POST", srv.url + "/v1/load_weights", {"path": str(tiny_model), "version": 1},
                               {"Authorization": f"bearer {token}"})  # the scheme in any case, as HTTP says
        assert reply.status == 200, reply.body
        assert srv.engine.policy_version == 1
        asyncio.run(load(token, 2))
        assert srv.engine.policy_version == 2
