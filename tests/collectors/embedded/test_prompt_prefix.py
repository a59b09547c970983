"""The cached prompt prefix (`session_key`, `prompt_prefix`) over real HTTP: a prefix call answers exactly as the
whole prompt sent does, a prefix not held as named is a 409 `prefix_not_cached` that changes nothing, malformed
fields are 400s naming them, the store is bounded, and only answered calls are held."""

from __future__ import annotations

import base64
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from collectors.embedded.app import RunningServer, serve_in_thread
from collectors.embedded.prefix_cache import PrefixCache, PrefixMissing
from tests.collectors import http
from tests.collectors.embedded.test_packed_prompt import comparable, raw_post

IDS = [5, 17, 300, 1999, 42, 7, 0, 64, 1024, 9]
MORE = [11, 12, 13]


def packed(ids: list[int]) -> str:
    return base64.b64encode(np.array(ids, dtype="<i4").tobytes()).decode()


def crc(ids: list[int]) -> int:
    return zlib.crc32(np.array(ids, dtype="<i4").tobytes())


def output_ids(status: int, raw: bytes) -> list[int]:
    """The output ids of an answer, streamed or not."""
    _, body = comparable(status, raw)
    assert status == 200, body
    if isinstance(body, list):
        return [t for event in body if isinstance(event, dict) for c in event["choices"] for t in c["token_ids"]]
    return body["choices"][0]["token_ids"]


def cache_stats(server: RunningServer) -> dict[str, int]:
    return http.get(server.url + "/stats").json()["prefix_cache"]


SAME = [
    {"max_tokens": 6, "seed": 3, "return_token_ids": True},
    {"max_tokens": 6, "seed": 3, "return_token_ids": True, "logprobs": 3, "temperature": 0.8, "top_k": 20},
    {"max_tokens": 5, "seed": 5, "stream": True, "return_token_ids": True, "logprobs": 2,
     "stream_options": {"include_usage": True}},
    {"max_tokens": 4, "temperature": 0, "return_token_ids": True, "return_prompt_token_ids": False},
]


@pytest.mark.parametrize("options", SAME)
@pytest.mark.parametrize("tail_form", ["packed", "list"])
def test_a_prefix_call_answers_exactly_as_the_whole_prompt(server: RunningServer, options: dict[str, Any],
                                                           tail_form: str, request: pytest.FixtureRequest) -> None:
    key = request.node.name
    first = raw_post(server.url, {"prompt": IDS, "session_key": key, **options})
    held = IDS + output_ids(*first)  # what the server now holds: the prompt and what it sampled (streamed or not)
    tail = {"prompt_token_ids_b64": packed(MORE)} if tail_form == "packed" else {"prompt": MORE}
    by_prefix = raw_post(server.url, {"prompt_prefix": {"key": key, "tokens": len(held), "crc32": crc(held)},
                                      **tail, "session_key": key, **options})
    whole = raw_post(server.url, {"prompt": held + MORE, **options})
    assert comparable(*by_prefix) == comparable(*whole)
    # the second call was held in turn: a third names it, and an empty tail is the held ids alone
    held2 = held + MORE + output_ids(*by_prefix)
    third = raw_post(server.url, {"prompt_prefix": {"key": key, "tokens": len(held2), "crc32": crc(held2)},
                                  "prompt": [], **options})
    assert comparable(*third) == comparable(*raw_post(server.url, {"prompt": held2, **options}))
    # a shorter prefix of what is held is checked by its own crc32
    shorter = raw_post(server.url, {"prompt_prefix": {"key": key, "tokens": 4, "crc32": crc(held2[:4])},
                                    "prompt": [8, 9], **options})
    assert comparable(*shorter) == comparable(*raw_post(server.url, {"prompt": held2[:4] + [8, 9], **options}))


def test_the_answer_counts_and_echoes_the_whole_prompt(server: RunningServer) -> None:
    first = raw_post(server.url, {"prompt": IDS, "session_key": "echo", "max_tokens": 3, "seed": 1,
                                  "return_token_ids": True})
    held = IDS + output_ids(*first)
    _, body = comparable(*raw_post(server.url, {"prompt_prefix": {"key": "echo", "tokens": len(held),
                                                                  "crc32": crc(held)},
                                                "prompt": MORE, "max_tokens": 3, "return_token_ids": True}))
    assert body["choices"][0]["prompt_token_ids"] == held + MORE
    assert body["usage"]["prompt_tokens"] == len(held) + len(MORE)


MISSES = [
    (lambda held: {"key": "never-stored", "tokens": 3, "crc32": crc(IDS[:3])}, "no token ids are held"),
    (lambda held: {"key": "miss", "tokens": len(held) + 1, "crc32": crc(held)}, "fewer than"),
    (lambda held: {"key": "miss", "tokens": len(held), "crc32": (crc(held) + 1) % 2**32}, "crc32"),
    (lambda held: {"key": "miss", "tokens": 3, "crc32": crc([5, 17, 301])}, "crc32"),
]


@pytest.mark.parametrize(("ref", "fragment"), MISSES)
def test_a_prefix_not_held_as_named_is_a_409_and_changes_nothing(server: RunningServer, ref: Any,
                                                                 fragment: str) -> None:
    held = IDS + output_ids(*raw_post(server.url, {"prompt": IDS, "session_key": "miss", "max_tokens": 3,
                                                   "seed": 2, "return_token_ids": True}))
    before = cache_stats(server)
    r = http.post(server.url + "/v1/completions", {"prompt_prefix": ref(held), "prompt": MORE, "max_tokens": 2,
                                                   "session_key": "miss"})
    error = r.json()["error"]
    assert r.status == 409 and error["code"] == "prefix_not_cached" and error["param"] == "prompt_prefix", error
    assert fragment in error["message"] and "resend the whole prompt" in error["message"]
    after = cache_stats(server)
    assert (after["keys"], after["held_ids"], after["stored"]) == (before["keys"], before["held_ids"],
                                                                    before["stored"])
    assert after["misses"] == before["misses"] + 1
    ok = http.post(server.url + "/v1/completions", {"prompt_prefix": {"key": "miss", "tokens": len(held),
                                                                      "crc32": crc(held)}, "prompt": MORE})
    assert ok.status == 200  # still held as it was


BAD = [
    ({"session_key": ""}, "session_key"),
    ({"session_key": 7}, "session_key"),
    ({"session_key": "k" * 201}, "session_key"),
    ({"prompt_prefix": "k"}, "prompt_prefix"),
    ({"prompt_prefix": {"key": "", "tokens": 1, "crc32": 0}}, "prompt_prefix"),
    ({"prompt_prefix": {"key": "k", "tokens": 0, "crc32": 0}}, "prompt_prefix"),
    ({"prompt_prefix": {"key": "k", "tokens": True, "crc32": 0}}, "prompt_prefix"),
    ({"prompt_prefix": {"key": "k", "tokens": 1, "crc32": -1}}, "prompt_prefix"),
    ({"prompt_prefix": {"key": "k", "tokens": 1}}, "prompt_prefix"),
    ({"prompt_prefix": {"key": "k", "tokens": 1, "crc32": 0}, "prompt": "text"}, "prompt"),
]


@pytest.mark.parametrize(("fields", "param"), BAD)
def test_malformed_prefix_fields_are_a_400_naming_the_field(server: RunningServer, fields: dict[str, Any],
                                                            param: str) -> None:
    body = {"prompt": IDS, **fields} if "prompt" not in fields and "prompt_prefix" not in fields else fields
    r = http.post(server.url + "/v1/completions", {"max_tokens": 2, **body})
    error = r.json()["error"]
    assert r.status == 400 and error["param"] == param and f"`{param}`" in error["message"], error


def test_an_empty_prompt_without_a_prefix_is_still_refused(server: RunningServer) -> None:
    for body in ({"prompt_token_ids_b64": ""}, {"prompt": []}):
        assert http.post(server.url + "/v1/completions", body).status == 400


def test_a_failed_call_holds_nothing(server: RunningServer) -> None:
    held = IDS + output_ids(*raw_post(server.url, {"prompt": IDS, "session_key": "fails", "max_tokens": 3,
                                                   "seed": 4, "return_token_ids": True}))
    before = cache_stats(server)
    ref = {"key": "fails", "tokens": len(held), "crc32": crc(held)}
    for body in ({"prompt_prefix": ref, "prompt": MORE, "max_tokens": 5000, "session_key": "fails"},  # past the context
                 {"prompt": IDS + [10**6], "session_key": "fails"},  # out of vocabulary
                 {"prompt": [1, 2], "session_key": "fails-too", "n": 2}):
        assert http.post(server.url + "/v1/completions", body).status == 400
    after = cache_stats(server)
    assert (after["keys"], after["held_ids"], after["stored"]) == (before["keys"], before["held_ids"],
                                                                    before["stored"])
    assert http.post(server.url + "/v1/completions", {"prompt_prefix": ref, "prompt": MORE}).status == 200


@pytest.fixture(scope="module")
def small_store(tiny_model: Path) -> Iterator[RunningServer]:
    threads = torch.get_num_threads()
    try:
        with serve_in_thread(tiny_model, threads=1, device="cpu", prefix_cache_tokens=30) as running:
            yield running
    finally:
        torch.set_num_threads(threads)


def test_the_store_evicts_the_least_recently_used_past_its_budget(small_store: RunningServer) -> None:
    held: dict[str, list[int]] = {}
    for key in ("a", "b", "c"):  # 10 + 3 ids each: the third evicts the first
        held[key] = IDS + output_ids(*raw_post(small_store.url, {"prompt": IDS, "session_key": key, "max_tokens": 3,
                                                                 "seed": 1, "return_token_ids": True}))
    stats = cache_stats(small_store)
    assert (stats["keys"], stats["held_ids"], stats["evicted"]) == (2, 26, 1)

    def named(key: str) -> int:
        ref = {"key": key, "tokens": len(held[key]), "crc32": crc(held[key])}
        return http.post(small_store.url + "/v1/completions", {"prompt_prefix": ref, "prompt": []}).status

    assert named("a") == 409
    assert named("b") == 200  # now the most recently used: "c" goes next
    raw_post(small_store.url, {"prompt": IDS, "session_key": "d", "max_tokens": 3, "seed": 1})
    assert (named("c"), named("b")) == (409, 200)
    before = cache_stats(small_store)
    assert raw_post(small_store.url, {"prompt": IDS * 3, "session_key": "big", "max_tokens": 3})[0] == 200
    after = cache_stats(small_store)  # 33 ids, over the whole budget: not held, and nothing evicted for it
    assert (after["keys"], after["held_ids"], after["evicted"]) == (before["keys"], before["held_ids"],
                                                                    before["evicted"])
    assert named("b") == 200


def test_the_server_announces_the_prefix_where_it_keeps_a_store(server: RunningServer, tiny_model: Path) -> None:
    assert http.get(server.url + "/health").json()["prompt_prefix"] is True
    assert http.get(server.url + "/v1/models").json()["data"][0]["prompt_prefix"] is True
    threads = torch.get_num_threads()
    try:
        with serve_in_thread(tiny_model, threads=1, device="cpu", prefix_cache_tokens=0) as off:
            assert "prompt_prefix" not in http.get(off.url + "/health").json()
            assert "prompt_prefix" not in http.get(off.url + "/v1/models").json()["data"][0]
            r = http.post(off.url + "/v1/completions", {"prompt": IDS, "session_key": "k", "max_tokens": 2})
            assert r.status == 200 and http.get(off.url + "/stats").json()["prefix_cache"]["keys"] == 0
            r = http.post(off.url + "/v1/completions", {"prompt_prefix": {"key": "k", "tokens": 3, "crc32": 0},
                                                        "prompt": [1]})
            assert r.status == 409 and r.json()["error"]["code"] == "prefix_not_cached"
    finally:
        torch.set_num_threads(threads)


def test_the_store_itself() -> None:
    cache = PrefixCache(budget=10)
    cache.put("a", [1, 2, 3], [4])
    assert list(cache.prefix("a", 4, crc([1, 2, 3, 4]))) == [1, 2, 3, 4]
    assert list(cache.prefix("a", 2, crc([1, 2]))) == [1, 2]
    cache.put("a", [9])  # replaced
    assert cache.held == 1
    with pytest.raises(PrefixMissing):
        cache.prefix("a", 2, crc([1, 2]))
    cache.put("b", list(range(11)))  # over the whole budget: not held
    assert "b" not in cache and cache.held == 1
    with pytest.raises(ValueError, match="budget"):
        PrefixCache(budget=-1)


def test_a_put_with_its_prefix_crc_known_holds_the_crc_of_the_whole() -> None:
    """`put(known=)` runs the crc32 over what follows the known prefix only; the held crc32 is the whole's."""
    ids = np.random.default_rng(0).integers(0, 150_000, 5_000).astype("<i4")
    for n in (0, 1, 4_000, 5_000):
        cache = PrefixCache(budget=10_000)
        cache.put("k", ids[:4_500], ids[4_500:], known=(n, crc(ids[:n].tolist())))
        assert list(cache.prefix("k", 5_000, crc(ids.tolist()))) == ids.tolist()
    cache = PrefixCache(budget=10_000)
    cache.put("k", ids, known=(10, 12345))  # a wrong crc32 named: the next call misses, and resends whole
    with pytest.raises(PrefixMissing, match="crc32"):
        cache.prefix("k", 5_000, crc(ids.tolist()))
    with pytest.raises(ValueError, match="first 5001 ids"):
        cache.put("k", ids, known=(5_001, 0))
