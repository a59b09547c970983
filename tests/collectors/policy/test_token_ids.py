"""`TokenLog`/`TokenIds`: a session's ids with their JSON kept beside them, sent byte for byte as a plain list.

The request a policy server gets from a `TokenIds` prompt must be exactly the one it would get from
the same ids as a list (vLLM and the embedded server read plain JSON ids), however the log grew;
a view must not change as its log grows afterwards; both clients must send and check it like a list.
"""

from __future__ import annotations

import asyncio
import gc
import random
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collectors.embedded.app import RunningServer
from collectors.policy import (
    EmbeddedClient,
    SamplingParams,
    VLLMClient,
    completion_body,
    token_ids,
)
from collectors.policy.http import dumps, prompt_list
from collectors.policy.token_ids import PackedIds, TokenIds, TokenLog
from collectors.policy.vllm_generate import generate_body
from tests.collectors.fake_vllm import fake_vllm


def grown(rng: random.Random) -> tuple[TokenLog, list[int]]:
    """A log grown by a few extends of random sizes (empty ones included), and the same ids as a list."""
    log, plain = TokenLog(), []
    for _ in range(rng.randrange(0, 6)):
        more = [rng.randrange(0, 200_000) for _ in range(rng.choice([0, 1, 2, 50]))]
        log.extend(more)
        plain += more
    return log, plain


def test_a_view_writes_exactly_the_json_of_its_ids_as_a_list() -> None:
    rng = random.Random(0)
    for _ in range(300):
        log, plain = grown(rng)
        delta = [rng.randrange(0, 200_000) for _ in range(rng.choice([0, 1, 3, 40]))]
        view = log.view(delta)
        assert view.json() == orjson.dumps(plain + delta)
        assert view == plain + delta and plain + delta == view and len(view) == len(plain) + len(delta)


def test_a_view_does_not_change_as_its_log_grows() -> None:
    log = TokenLog([1, 2, 3])
    view = log.view([4, 5])
    log.extend([4, 5])
    log.extend([6, 7])
    assert view == [1, 2, 3, 4, 5] and view.json() == b"[1,2,3,4,5]"
    assert log.view().json() == b"[1,2,3,4,5,6,7]" and log.view() == [1, 2, 3, 4, 5, 6, 7]


def test_a_log_makes_its_json_only_when_a_view_asks_and_then_only_for_the_ids_added_since() -> None:
    """A session sent only packed ids (to a server holding its prefix) never encodes JSON; a view of an older
    length than what was encoded since is still exact."""
    log = TokenLog([1, 2, 3])
    for more in ([4], [5, 6]):
        view = log.view(more)
        view.packed()  # what a packed prompt costs: no JSON
        log.extend(view.tail, view.tail_json(made_only=True), view.tail_int32(made_only=True))
    assert log._json_n == 0 and log.ids.tolist() == [1, 2, 3, 4, 5, 6]  # noqa: SLF001
    old = log.view()
    log.extend([7])
    assert log.view([8]).json() == b"[1,2,3,4,5,6,7,8]" and log._json_n == 7  # noqa: SLF001
    assert old.json() == b"[1,2,3,4,5,6]"  # older than the JSON form: encoded on its own
    log.extend([9], b"[9]")  # a caught-up form takes the JSON a caller has
    assert log._json_n == 8 and log.view().json() == b"[1,2,3,4,5,6,7,9]"  # noqa: SLF001


def test_a_view_reads_as_the_list_it_stands_for() -> None:
    log = TokenLog([10, 11, 12])
    view, plain = log.view([13, 14]), [10, 11, 12, 13, 14]
    assert list(view) == plain and view[0] == 10 and view[3] == 13 and view[-1] == 14 and view[-4] == 11
    for cut in (slice(None), slice(1, 4), slice(-2, None), slice(3, 100), slice(None, -1), slice(None, None, 2),
                slice(5, 2)):
        assert view[cut] == plain[cut], cut
    with pytest.raises(IndexError):
        view[5]
    assert view != [10, 11, 12, 13] and view != [10, 11, 12, 13, 15] and view != "abcde"
    log.extend(np.array([13, 14], dtype=np.int64))  # ids of any integer type are kept as Python ints
    assert log.view().json() == b"[10,11,12,13,14]" and all(type(t) is int for t in log.ids)


def test_a_request_with_a_view_is_byte_for_byte_the_request_with_the_list() -> None:
    rng = random.Random(1)
    sampling = SamplingParams(max_tokens=7, temperature=0.5, top_k=3, seed=9, stop=("x",), logprobs=2)
    for _ in range(50):
        log, plain = grown(rng)
        delta = [rng.randrange(0, 50_000) for _ in range(rng.randrange(1, 30))]
        view = log.view(delta)
        assert dumps(completion_body(view, sampling, "m", echo_prompt=False)) == \
            orjson.dumps(completion_body(plain + delta, sampling, "m", echo_prompt=False))
        assert dumps(generate_body(view, sampling, None, 3, extra={"sampling_params": {"n": 1}})) == \
            orjson.dumps(generate_body(plain + delta, sampling, None, 3, extra={"sampling_params": {"n": 1}}))
    # what orjson cannot write falls back to the standard library, the view as its ids
    assert orjson.loads(dumps({"prompt": TokenLog([1]).view([2]), "seed": 2**70})) == {"prompt": [1, 2], "seed": 2**70}


def test_the_clients_keep_a_view_as_the_prompt_without_copying_it() -> None:
    view = TokenLog([1, 2]).view([3])
    assert prompt_list(view) is view
    assert isinstance(prompt_list([1, 2]), list) and prompt_list(np.array([1, 2])) == [1, 2]
    with pytest.raises(ValueError, match="empty"):
        prompt_list(TokenLog().view())


def test_vllm_is_sent_a_view_as_plain_token_ids() -> None:
    async def scenario() -> None:
        log = TokenLog([50, 51])
        async with fake_vllm() as fake, VLLMClient(fake.url) as client:
            sample = await client.complete(log.view([52, 53]), SamplingParams(max_tokens=3, seed=4))
            log.extend([52, 53, *sample.output_ids])
            assert fake.served[0].body["prompt"] == [50, 51, 52, 53]  # the lora path sends /v1/completions
            assert isinstance(sample.prompt_ids, TokenIds) and sample.prompt_ids == [50, 51, 52, 53]
            again = await client.complete(log.view([54]), SamplingParams(max_tokens=3, seed=4))
            assert fake.served[1].body["prompt"] == [50, 51, 52, 53, *sample.output_ids, 54]
            assert again.prompt_ids == fake.served[1].body["prompt"]
    asyncio.run(scenario())


def test_the_embedded_server_samples_from_a_view_as_from_the_list(server: RunningServer, tiny_model: Path) -> None:
    async def scenario() -> None:
        params = SamplingParams(max_tokens=5, seed=3)
        async with EmbeddedClient(server.url) as client:
            plain = await client.complete([50, 51, 52, 53], params)
            log = TokenLog([50, 51])
            viewed = await client.complete(log.view([52, 53]), params)
            assert viewed.prompt_ids == [50, 51, 52, 53]  # the server's count of the prompt matched its length
            assert (viewed.output_ids, viewed.output_logprobs) == (plain.output_ids, plain.output_logprobs)
            chunks = [c async for c in client.stream(log.view([52, 53]), params)]
            assert [t for c in chunks for t in c.output_ids] == plain.output_ids
    asyncio.run(scenario())


# ---------------------------------------------------------------- long lists, a slice at a time


class CountingOrjson:
    """`orjson` as `collectors.policy.token_ids` uses it, recording how many ids each `dumps` call encodes."""

    def __init__(self) -> None:
        self.encoded: list[int] = []

    def dumps(self, value: Any) -> bytes:
        self.encoded.append(len(value))
        return orjson.dumps(value)

    def __getattr__(self, name: str) -> Any:
        return getattr(orjson, name)


@settings(max_examples=150, deadline=None)
@given(parts=st.lists(st.lists(st.integers(0, 300_000), max_size=12), max_size=5), delta=st.lists(
    st.integers(0, 300_000), max_size=12), size=st.integers(1, 4), cut=st.tuples(st.integers(-30, 30),
                                                                                 st.integers(-30, 30)))
def test_in_slices_the_json_and_the_lists_are_those_of_one_call(parts: list[list[int]], delta: list[int], size: int,
                                                              cut: tuple[int, int]) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(token_ids, "SLICE", size)
        log, plain = TokenLog(), []
        for part in parts:
            log.extend(part)
            plain += part
        view = log.view(delta)
        assert view.json() == orjson.dumps(plain + delta) and view.tail_json() == orjson.dumps(delta)
        assert token_ids.ids_json(plain) == orjson.dumps(plain) and token_ids.copied(plain) == plain
        assert view[cut[0]:cut[1]] == (plain + delta)[cut[0]:cut[1]] and view[:] == plain + delta
        whole = TokenLog(view)  # a view of a log's ids: copied and encoded again
        assert whole.ids.tolist() == plain + delta and whole.view().json() == view.json()
        log.extend(delta, view.tail_json())  # the ids the view was sent with, and their JSON as sent
        assert log.ids.tolist() == plain + delta and log.view().json() == view.json()


def test_no_call_encodes_or_copies_more_than_a_slice_of_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    counting = CountingOrjson()
    monkeypatch.setattr(token_ids, "orjson", counting)
    monkeypatch.setattr(token_ids, "SLICE", 8)
    ids = list(range(100))
    assert token_ids.ids_json(ids) == orjson.dumps(ids)
    log = TokenLog(ids)
    view = log.view(list(range(100, 150)))
    assert view.json() == orjson.dumps(list(range(150))) and view[:] == list(range(150))
    assert counting.encoded and max(counting.encoded) <= 8


def test_a_view_of_no_log_brings_its_json_to_the_log_it_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    counting = CountingOrjson()
    monkeypatch.setattr(token_ids, "orjson", counting)
    view = TokenLog().view([5, 6, 7])
    assert view.json() == b"[5,6,7]" and counting.encoded == [3]
    log = TokenLog(view)  # the ids a new segment was sent with: its log takes their JSON, encoded once
    log.extend([8, 9], log.view([8, 9]).tail_json())
    assert counting.encoded == [3, 2] and log.view().json() == b"[5,6,7,8,9]" and log.ids.tolist() == [5, 6, 7, 8, 9]


def test_a_log_holds_int32_ids_and_refuses_others_leaving_itself_as_it_was() -> None:
    """4 bytes an id and nothing for the garbage collector to walk (a list of ints was ~40 bytes an id, each an
    object a full collection visits: 2.75 million for 32 sessions at 80k tokens); its bytes are the packed form."""
    log = TokenLog([1, 2, 3])
    assert log.ids.itemsize == 4 and not [r for r in gc.get_referents(log.ids) if isinstance(r, int)]
    with pytest.raises(ValueError, match="within int32"):
        log.extend([4, 2**31])
    with pytest.raises(ValueError, match="within int32"):
        log.extend([-(2**31) - 1])
    assert log.ids.tolist() == [1, 2, 3] and log.view([4]).json() == b"[1,2,3,4]"
    assert log.view([4]).packed() == PackedIds([1, 2, 3, 4]).quoted()