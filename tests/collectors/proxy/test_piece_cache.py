"""The piece cache gives exactly the whole-text ids, for every tokenizer family, cold and warm; it turns
itself off where piece-wise encoding would not be exact; it stays bounded; the proxy reports its hits."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from collectors.model.families import FAMILIES
from collectors.model.tokenizer import train_tokenizer
from collectors.proxy.piece_cache import PieceCache, unsplittable
from collectors.proxy.render import ChatRenderer
from tests.collectors.proxy_harness import MODEL, Scripted, call, running_proxy

FAMILY_NAMES = sorted(FAMILIES)
OVERLAPPING = ["<x>", "<x><y>", "<y>", "ab|", "|cd", "<|im_end|>x"]  # prefixes of and overlaps with each other


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, PreTrainedTokenizerFast]:
    made = {name: train_tokenizer(1024, family=name) for name in FAMILY_NAMES}
    made["overlapping"] = train_tokenizer(1024, family="hermes")  # leftmost-longest matching decides the split
    made["overlapping"].add_tokens([AddedToken(t, normalized=False) for t in OVERLAPPING])
    return made


def whole(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tok.backend_tokenizer.encode(text, add_special_tokens=False).ids


def _texts(added: list[str]) -> st.SearchStrategy[str]:
    """Texts of random pieces: added tokens (repeated, adjacent), their partial forms, edge whitespace,
    combining marks and NFC-sensitive sequences, and any unicode."""
    partial = [t[:k] for t in added for k in (1, 2, len(t) // 2, len(t) - 1)] + [t[1:] for t in added]
    odd = ["e\u0301", "\u0041\u030a", "\u212b", "\u1e9b\u0323", "\ufb01", "\u0301", " ", "  ", "\n", "\t\n ",
           "\r\n", "😀", "<|", "|>", "<", ">", ""]
    piece = st.one_of(st.sampled_from(added), st.sampled_from(partial), st.sampled_from(odd),
                      st.text(max_size=12), st.text(alphabet="ab \n\u0301\u00e9<|>_", max_size=12))
    return st.lists(piece, max_size=40).map("".join)


@pytest.mark.parametrize("family", [*FAMILY_NAMES, "overlapping"])
def test_pieces_give_the_whole_text_ids(tokenizers: dict[str, PreTrainedTokenizerFast], family: str) -> None:
    tok = tokenizers[family]
    backend = tok.backend_tokenizer
    assert unsplittable(backend) is None
    roomy = PieceCache(backend, min_chars=0)  # every text goes through it, and stays warm across examples
    tight = PieceCache(backend, min_chars=0, max_chars=24)  # evicts nearly everything all the time
    added = [t.content for t in backend.get_added_tokens_decoder().values()]

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(_texts(added))
    def check(text: str) -> None:
        expected = whole(tok, text)
        assert roomy.encode(text) == expected
        assert roomy.encode(text) == expected  # warm: every piece from the cache
        assert tight.encode(text) == expected

    check()
    assert roomy.counters.pieces_hit > 0 and roomy.counters.pieces_tokenized > 0


def _conversation(turns: int, user: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    tools = [{"type": "function", "function": {
        "name": f"tool_{i}", "description": "Reads a file and returns its lines, numbered. " * 20,
        "parameters": {"type": "object", "properties": {"path": {"type": "string", "description": "é\u0301 path " * 10},
                                                        "limit": {"type": "integer"}}, "required": ["path"]}}}
        for i in range(8)]
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful coding agent.  \n" * 40},
                                      {"role": "user", "content": user}]
    for i in range(turns):
        messages.append({"role": "assistant", "content": f"Looking at part {i}.", "tool_calls": [
            {"id": f"c{i}", "type": "function",
             "function": {"name": "tool_1", "arguments": {"path": f"src/m{i}.py", "limit": i}}}]})
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "name": "tool_1",
                         "content": f"1 def f{i}():\n2     return '<|im_' + 'end|>'  \n3 \u00e9\u0301\n" * 30})
    return messages, tools


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_rendered_conversations_encode_identically_cold_and_warm(
        tokenizers: dict[str, PreTrainedTokenizerFast], family: str) -> None:
    tok = tokenizers[family]
    renderer = ChatRenderer(tok)
    assert renderer._pieces is not None
    first = renderer.render(*_conversation(6, "Fix the failing test."), generation_prompt=True)
    other = renderer.render(*_conversation(6, "Now add a test for m3."), generation_prompt=True)
    assert len(first) > renderer._pieces.min_chars
    assert renderer.encode(first) == whole(tok, first)  # cold
    cold = renderer.piece_stats()
    assert renderer.encode(first) == whole(tok, first)  # warm: nothing tokenized again
    assert renderer.piece_stats()["chars_tokenized"] == cold["chars_tokenized"]
    assert renderer.encode(other) == whole(tok, other)  # another session: only its user message is new
    tokenized = renderer.piece_stats()["chars_tokenized"] - cold["chars_tokenized"]
    assert 0 < tokenized < 200, tokenized


def _trained(pre: Any) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre
    tok.train_from_iterator(["hello world, a short corpus of words"] * 10,
                            trainers.BpeTrainer(vocab_size=80, show_progress=False))
    return tok


@pytest.mark.parametrize("flag", ["lstrip", "rstrip", "normalized", "single_word"])
def test_an_added_token_that_looks_at_its_neighbours_turns_the_cache_off(
        tokenizers: dict[str, PreTrainedTokenizerFast], flag: str) -> None:
    tok = train_tokenizer(1024, family="hermes")
    tok.add_tokens([AddedToken("<mark>", **{flag: True})])
    text = ("one  <mark>  two <|im_start|>x<mark>y\n" * 400)
    forced = PieceCache(tok.backend_tokenizer, min_chars=0)
    if flag in ("lstrip", "rstrip"):  # the condition is needed: piece by piece differs from the whole
        assert forced.encode(text) != whole(tok, text)
    renderer = ChatRenderer(tok)
    assert renderer._pieces is None and flag in renderer.piece_stats()["off"]
    assert renderer.encode(text) == whole(tok, text)


def test_a_pre_tokenizer_that_marks_the_first_piece_turns_the_cache_off() -> None:
    tok = _trained(pre_tokenizers.Metaspace(prepend_scheme="first"))
    tok.add_special_tokens(["<s>"])
    text = "hello<s>world hello"
    assert PieceCache(tok, min_chars=0).encode(text) != tok.encode(text, add_special_tokens=False).ids
    assert "first" in unsplittable(tok)
    assert unsplittable(_trained(pre_tokenizers.Metaspace(prepend_scheme="always"))) is not None  # no added tokens
    always = _trained(pre_tokenizers.Metaspace(prepend_scheme="always"))
    always.add_special_tokens(["<s>"])
    assert unsplittable(always) is None
    assert PieceCache(always, min_chars=0).encode(text) == always.encode(text, add_special_tokens=False).ids


def test_the_cache_is_bounded_by_characters_and_evicts_the_oldest(
        tokenizers: dict[str, PreTrainedTokenizerFast]) -> None:
    tok = tokenizers["hermes"]
    cache = PieceCache(tok.backend_tokenizer, min_chars=0, max_chars=1000)
    texts = [f"<|im_start|>{'x' * 300} {i}<|im_end|>" for i in range(10)]
    for text in texts:
        assert cache.encode(text) == whole(tok, text)
        assert cache.as_json()["held_chars"] <= 1000
    held = cache.as_json()
    assert held["held_pieces"] == 3 and held["pieces_tokenized"] == 10
    assert cache.encode(texts[-1]) == whole(tok, texts[-1])  # the newest is kept
    assert cache.as_json()["pieces_hit"] == 1
    assert cache.encode(texts[0]) == whole(tok, texts[0])  # the oldest was evicted: tokenized again
    assert cache.as_json()["pieces_tokenized"] == 11
    big = "y" * 2000  # a piece larger than the whole cache is encoded but not kept
    assert cache.encode(big) == whole(tok, big) and cache.as_json()["held_chars"] <= 1000


def test_a_second_sessions_first_call_through_the_proxy_tokenizes_only_what_differs(
        tiny_model: Path, tmp_path: Path) -> None:
    messages, tools = _conversation(0, "")
    upstream = Scripted(AutoTokenizer.from_pretrained(tiny_model))
    with running_proxy(upstream, tmp_path / "store", tiny_model, max_model_len=200_000) as h:
        before = call(h.url + "/stats").body["piece_cache"]
        assert before["chars_tokenized"] == 0
        sizes = []
        for task in ("Fix the failing test in src/m1.py.", "Add a docstring to src/m2.py."):
            rollout = h.open(group_id="agent")
            body = {"model": MODEL, "messages": [*messages[:1], {"role": "user", "content": task}], "tools": tools}
            reply = call(rollout["base_urls"]["openai"] + "/chat/completions", body, key=rollout["api_key"])
            assert reply.status == 200, reply.body
            stats = call(h.url + "/stats").body["piece_cache"]
            sizes.append(stats["chars_tokenized"] - before["chars_tokenized"])
            before = stats
            assert h.close(rollout).status == 200
        system_and_tools = len(json.dumps(tools))  # at least this much text is shared by the two first calls
        assert sizes[0] > system_and_tools and 0 < sizes[1] < 200, sizes
        assert stats["chars_hit"] > system_and_tools


def test_threads_share_one_cache(tokenizers: dict[str, PreTrainedTokenizerFast]) -> None:
    tok = tokenizers["hermes"]
    cache = PieceCache(tok.backend_tokenizer, min_chars=0, max_chars=3000)  # small: threads evict each other's
    texts = [f"<|im_start|>system\n{'shared head ' * 40}<|im_end|>\n<|im_start|>user\n{i % 7} {'z' * (i * 13)}"
             f"<|im_end|>\n" for i in range(60)]
    expected = [whole(tok, t) for t in texts]
    failures: list[int] = []

    def run(offset: int) -> None:
        for k in range(len(texts)):
            i = (k + offset) % len(texts)
            if cache.encode(texts[i]) != expected[i]:
                failures.append(i)

    threads = [threading.Thread(target=run, args=(n * 15,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    held = cache.as_json()
    assert held["held_chars"] == sum(map(len, cache._pieces)) <= 3000 and held["pieces_hit"] > 0
