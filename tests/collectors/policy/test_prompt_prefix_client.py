"""`EmbeddedClient` and the server's held prefixes, over real HTTP: a session's calls after its first send the
history as a held prefix plus the tail and get exactly what whole calls get; a server that lost the ids (restarted)
answers 409 and the call is resent whole, transparently, and counted; ids the client holds that differ from the
server's are caught by the crc32, never answered from the wrong prompt."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import pytest
import torch

from collectors.embedded.app import RunningServer, serve_in_thread
from collectors.policy import EmbeddedClient, PolicyServerUnreachable, SamplingParams
from collectors.policy.contract import Sample, StreamedSample
from collectors.policy.token_ids import TokenIds, TokenLog
from tests.collectors import http
from tests.collectors.embedded.test_packed_prompt import relay

FIRST = [5, 17, 300, 1999, 42, 7, 0, 64, 1024, 9]
DELTAS = [[11, 12, 13], [14], [15, 16, 17, 18], [19, 20]]


async def call(client: EmbeddedClient, ids: Any, sampling: SamplingParams, stream: bool) -> Sample:
    if not stream:
        return await client.complete(ids, sampling)
    for last_try in (False, True):
        joined = StreamedSample(ids)
        try:
            async for chunk in client.stream(ids, sampling):
                joined.add(chunk)
            return joined.sample()
        except PolicyServerUnreachable:  # a kept-alive connection to the server before its restart, as the proxy
            if last_try or joined.output_ids:  # does (`collectors.proxy.upstream`): sent again before a first chunk
                raise
    raise AssertionError("unreachable")


def same(a: Sample, b: Sample) -> bool:
    keep = ("output_ids", "output_logprobs", "text", "finish_reason", "stop_reason", "top_logprobs")
    return [getattr(a, k) for k in keep] == [getattr(b, k) for k in keep] and list(a.prompt_ids) == list(b.prompt_ids)


def held_stats(url: str) -> dict[str, int]:
    return http.get(url + "/stats").json()["prefix_cache"]


async def session(client: EmbeddedClient, reference: EmbeddedClient, sampling: SamplingParams,
                  deltas: list[list[int]], log: TokenLog | None = None) -> TokenLog:
    """Calls of one session (alternately streamed), each checked against the whole prompt sent by `reference`."""
    log = log if log is not None else TokenLog(FIRST)
    view: TokenIds = log.view()
    for i, delta in enumerate([[], *deltas]):
        if i:
            view = log.view(delta)
        sample = await call(client, view, sampling, stream=bool(i % 2))
        whole = await reference.complete(list(view), sampling)
        assert same(sample, whole), (i, sample, whole)
        log.extend(delta)
        log.extend(sample.output_ids)  # what the proxy appends: the ids the server sampled
    return log


@pytest.mark.parametrize("sampling", [SamplingParams(max_tokens=4, seed=2, logprobs=2),
                                      SamplingParams(max_tokens=5, temperature=0.0),
                                      SamplingParams(max_tokens=8, seed=3, stop=("a", "e", "o", " "))])
def test_a_session_sends_its_history_as_a_held_prefix(server: RunningServer, sampling: SamplingParams) -> None:
    async def scenario() -> None:
        before = held_stats(server.url)
        async with relay(server.url, older=False) as (url, seen), \
                EmbeddedClient(url, prefix_min_ids=1) as client, \
                EmbeddedClient(server.url, prompt_prefix=False) as reference:
            log = await session(client, reference, sampling, DELTAS)
        assert "prompt_prefix" not in seen[0] and seen[0]["session_key"] == log.key
        lengths = [len(FIRST)]
        for body in seen[1:]:
            prefix = body["prompt_prefix"]
            assert body["session_key"] == prefix["key"] == log.key
            assert prefix["tokens"] >= lengths[-1]  # the previous prompt and its output: never resent
            lengths.append(prefix["tokens"])
        assert client.prefix_stats.as_json() == {"prefix_calls": len(DELTAS), "resent_whole": 0}
        after = held_stats(server.url)
        assert after["hits"] - before["hits"] == len(DELTAS) and after["misses"] == before["misses"]

    asyncio.run(scenario())


def test_a_short_history_goes_whole(server: RunningServer) -> None:
    async def scenario() -> None:
        async with relay(server.url, older=False) as (url, seen), EmbeddedClient(url) as client, \
                EmbeddedClient(server.url, prompt_prefix=False) as reference:  # the default threshold: 2048 ids
            await session(client, reference, SamplingParams(max_tokens=3, seed=1), DELTAS[:2])
        assert all("prompt_prefix" not in body and "session_key" in body for body in seen)
        assert client.prefix_stats.prefix_calls == 0

    asyncio.run(scenario())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("stream_after", [False, True])
def test_a_restarted_server_gets_the_prompt_whole_again(tiny_model: Path, stream_after: bool) -> None:
    sampling = SamplingParams(max_tokens=4, seed=7)
    port, threads = free_port(), torch.get_num_threads()

    async def before_restart(client: EmbeddedClient, reference: EmbeddedClient) -> TokenLog:
        return await session(client, reference, sampling, DELTAS[:1])

    async def after_restart(client: EmbeddedClient, reference: EmbeddedClient, log: TokenLog, url: str) -> None:
        view = log.view([21, 22])
        sample = await call(client, view, sampling, stream=stream_after)
        assert same(sample, await reference.complete(list(view), sampling))
        # 2 named prefixes (3 when the stream was sent again on a connection kept from before the restart)
        assert client.prefix_stats.resent_whole == 1 and client.prefix_stats.prefix_calls in (2, 3)
        stats = held_stats(url)
        assert (stats["misses"], stats["keys"]) == (1, 1)  # the whole resend was held again
        log.extend([21, 22])
        log.extend(sample.output_ids)
        await call(client, log.view([23]), sampling, stream=False)  # and named again
        assert held_stats(url)["hits"] == 1 and client.prefix_stats.resent_whole == 1

    async def scenario() -> None:
        client = EmbeddedClient(f"http://127.0.0.1:{port}", prefix_min_ids=1)
        try:
            with serve_in_thread(tiny_model, port=port, threads=1, device="cpu") as first:
                async with EmbeddedClient(first.url, prompt_prefix=False) as reference:
                    log = await before_restart(client, reference)
            with serve_in_thread(tiny_model, port=port, threads=1, device="cpu") as second:
                async with EmbeddedClient(second.url, prompt_prefix=False) as reference:
                    await after_restart(client, reference, log, second.url)
        finally:
            await client.aclose()

    try:
        asyncio.run(scenario())
    finally:
        torch.set_num_threads(threads)


def test_ids_that_differ_from_the_servers_are_caught_by_the_crc(server: RunningServer) -> None:
    """A client whose log does not hold exactly what the server sampled (as if it had trimmed the output for a stop
    string) names ids the server does not hold: 409, resent whole, answered from the client's own ids."""
    sampling = SamplingParams(max_tokens=5, seed=9)

    async def scenario() -> None:
        async with EmbeddedClient(server.url, prefix_min_ids=1) as client, \
                EmbeddedClient(server.url, prompt_prefix=False) as reference:
            log = TokenLog(FIRST)
            first = await client.complete(log.view(), sampling)
            log.extend(first.output_ids[:-1] + [(first.output_ids[-1] + 1) % 2048])  # one id not the sampled one
            view = log.view([11, 12])
            sample = await client.complete(view, sampling)
            assert same(sample, await reference.complete(list(view), sampling))
            assert client.prefix_stats.as_json() == {"prefix_calls": 1, "resent_whole": 1}

    asyncio.run(scenario())


def test_a_log_keeps_the_crc32_of_its_ids_as_it_grows() -> None:
    import base64
    import zlib

    import numpy as np

    log = TokenLog(range(100))
    for n in (100, 37, 100, 0):
        assert log.crc32(n) == zlib.crc32(np.arange(n, dtype="<i4").tobytes())
    log.extend(range(100, 70000))
    view = log.view([5])
    assert view.logged_crc32() == zlib.crc32(np.arange(70000, dtype="<i4").tobytes())
    # the int32 form grown by crc32 alone: packing still writes all of it (its base64 catches up)
    expected = np.append(np.arange(70000), 5).astype("<i4").tobytes()
    assert view.packed() == b'"' + base64.b64encode(expected) + b'"'

    assert TokenLog().key != TokenLog().key
