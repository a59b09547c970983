"""The packed prompt (`prompt_token_ids_b64`) over real HTTP: the same answers as the ids sent as a JSON
list, clear 400s naming the field, the announcement, and `EmbeddedClient` choosing the form by it.

`relay` is a loopback server in front of the real embedded server that records each completion body
it passes on; as an "older" server it drops the announcement from /health and refuses packed prompts
as a server without the field does (it reads no `prompt`).
"""

from __future__ import annotations

import asyncio
import base64
import json
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from collectors.embedded.app import RunningServer
from collectors.policy import EmbeddedClient, SamplingParams
from collectors.policy.token_ids import TokenLog
from collectors.serving import start_app
from tests.collectors import http

FIELD = "prompt_token_ids_b64"
IDS = [5, 17, 300, 1999, 42, 7, 0, 64, 1024, 9]


def packed(ids: list[int]) -> str:
    return base64.b64encode(np.array(ids, dtype="<i4").tobytes()).decode()


def raw_post(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def comparable(status: int, raw: bytes) -> tuple[int, Any]:
    """The answer without what differs between any two calls (id, created)."""
    def strip(event: Any) -> Any:
        return {k: v for k, v in event.items() if k not in ("id", "created")} if isinstance(event, dict) else event

    text = raw.decode()
    if text.startswith("data: "):
        return status, [strip(json.loads(line[6:])) if line != "data: [DONE]" else line
                        for line in text.split("\n\n") if line]
    return status, strip(json.loads(text))


SAME = [
    {"max_tokens": 6, "seed": 3, "return_token_ids": True},
    {"max_tokens": 6, "seed": 3, "return_token_ids": True, "return_prompt_token_ids": False, "logprobs": 3},
    {"max_tokens": 8, "seed": 4, "temperature": 0.8, "top_k": 20, "top_p": 0.9, "return_token_ids": True, "logprobs": 0},
    {"max_tokens": 5, "seed": 5, "stream": True, "return_token_ids": True, "logprobs": 2,
         "stream_options": {"include_usage": True}},
    {"max_tokens": 5, "seed": 5, "stream": True, "return_token_ids": True, "return_prompt_token_ids": False},
    {"max_tokens": 3000},  # past the context: the same 400
    {"max_tokens": 3, "n": 2},
]


@pytest.mark.parametrize("options", SAME)
def test_a_packed_prompt_gets_exactly_the_answer_of_the_json_list(server: RunningServer,
                                                                   options: dict[str, Any]) -> None:
    as_list = comparable(*raw_post(server.url, {"prompt": IDS, **options}))
    as_packed = comparable(*raw_post(server.url, {FIELD: packed(IDS), **options}))
    assert as_packed == as_list


BAD = [
    ({FIELD: packed([1, 2]), "prompt": [1, 2]}, "not both"),
    ({FIELD: ""}, "it is empty"),
    ({FIELD: "not base64!"}, "not base64"),
    ({FIELD: "AAAA"}, "3 bytes, not a multiple of 4"),
    ({FIELD: [1, 2, 3]}, "got a JSON list, not a string"),
    ({FIELD: "é"}, "not base64"),
    ({FIELD: packed([1, -5, 3])}, "token ids must be >= 0, got -5"),
    ({FIELD: packed([1, 10**6])}, "token id 1000000 is out of vocabulary: the model has 2048 tokens"),
]


@pytest.mark.parametrize(("body", "fragment"), BAD)
def test_a_bad_packed_prompt_is_a_400_naming_the_field(server: RunningServer, body: dict[str, Any],
                                                       fragment: str) -> None:
    r = http.post(server.url + "/v1/completions", body)
    error = r.json()["error"]
    assert r.status == 400 and error["code"] == 400 and error["type"] == "BadRequestError"
    assert error["param"] == FIELD and fragment in error["message"], error
    assert any(how in error["message"] for how in ("little-endian int32", "vocabulary", "not both"))


def test_the_server_announces_the_packed_prompt(server: RunningServer) -> None:
    assert http.get(server.url + "/health").json()[FIELD] is True
    assert http.get(server.url + "/v1/models").json()["data"][0][FIELD] is True


@asynccontextmanager
async def relay(target: str, *, older: bool) -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    """A loopback server passing calls on to `target`, recording completion bodies (module docstring)."""
    seen: list[dict[str, Any]] = []
    session = aiohttp.ClientSession()

    async def health(request: web.Request) -> web.Response:
        async with session.get(target + "/health") as r:
            body = await r.json()
        if older:
            body.pop(FIELD)
            body.pop("prompt_prefix", None)  # nor this one
        return web.json_response(body, headers={"X-Policy-Version": str(body["policy_version"])})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body)
        if older and "prompt" not in body:
            return web.json_response({"error": {"message": "`prompt` is required", "type": "BadRequestError",
                                                "param": "prompt", "code": 400}}, status=400)
        async with session.post(target + "/v1/completions", json=body) as r:
            data = await r.read()
            headers = {k: v for k, v in r.headers.items() if k in ("Content-Type", "X-Policy-Version")}
        return web.Response(body=data, status=r.status, headers=headers)

    app = web.Application(client_max_size=64 << 20)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completions)
    runner, url = await start_app(app)
    try:
        yield url, seen
    finally:
        await runner.cleanup()
        await session.close()


@pytest.mark.parametrize("older", [False, True])
def test_the_client_packs_prompts_for_a_server_that_announces_it_only(server: RunningServer, older: bool) -> None:
    sampling = SamplingParams(max_tokens=4, seed=2, logprobs=1)

    async def scenario() -> None:
        log = TokenLog(IDS[:7])
        async with relay(server.url, older=older) as (url, seen), EmbeddedClient(url) as client:
            first = await client.complete(log.view(IDS[7:]), sampling)
            log.extend(IDS[7:])
            chunks = [c async for c in client.stream(log.view([11, 12]), sampling)]
            plain = await client.complete(IDS, sampling)
        assert [sorted(k for k in b if k in ("prompt", FIELD)) for b in seen] == [[ "prompt" if older else FIELD]] * 3
        if not older:
            assert [b[FIELD] for b in seen] == [packed(IDS), packed(IDS + [11, 12]), packed(IDS)]
        async with EmbeddedClient(server.url, packed_prompts=False) as direct:
            reference = await direct.complete(IDS, sampling)
        assert first.output_ids == plain.output_ids == reference.output_ids
        assert first.output_logprobs == reference.output_logprobs and list(first.prompt_ids) == IDS
        assert sum(len(c.output_ids) for c in chunks) == 4

    asyncio.run(scenario())
