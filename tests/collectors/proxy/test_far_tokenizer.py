"""Huge texts are tokenized by a helper process: the same ids as in the proxy, and a helper that dies is replaced."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from collectors.proxy import far_tokenizer, render
from collectors.proxy.render import ChatRenderer

TEXTS = ["<|im_start|>user\nSummarize:\n" + "héllo wörld 12345, ünïcode → ✓ 🙂\n\n  tabs\tand  spaces " * 40,
         "x" * 3000, " \n" * 1500 + "<|im_end|>" * 7]


@pytest.fixture
def renderer(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> ChatRenderer:
    monkeypatch.setattr(render, "FAR_CHARS", 1000)  # these texts stand for megabytes
    made = ChatRenderer(AutoTokenizer.from_pretrained(tiny_model))
    yield made
    made.close()


def here(renderer: ChatRenderer, text: str) -> list[int]:
    return renderer.tokenizer.encode(text, add_special_tokens=False)


def test_a_huge_text_is_tokenized_by_the_helper_to_the_same_ids(renderer: ChatRenderer) -> None:
    assert renderer.encode("short") == here(renderer, "short") and renderer._far._helper is None
    for text in TEXTS:
        assert renderer.encode(text) == here(renderer, text)
    assert renderer._far._helper is not None and renderer._far._helper.poll() is None


def test_a_helper_that_died_is_replaced_and_the_text_tokenized_all_the_same(renderer: ChatRenderer) -> None:
    assert renderer.encode(TEXTS[0]) == here(renderer, TEXTS[0])
    first = renderer._far._helper
    first.kill()
    first.wait()
    assert renderer.encode(TEXTS[1]) == here(renderer, TEXTS[1])  # by a new helper
    assert renderer._far._helper is not None and renderer._far._helper is not first
    renderer._far._helper.stdout.close()  # as if it died mid-text: this one is tokenized here
    assert renderer.encode(TEXTS[2]) == here(renderer, TEXTS[2]) and renderer._far._helper is None
    renderer.close()
    assert renderer._far._helper is None and first.poll() is not None


def test_raw_ids_become_the_same_list_a_slice_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    import array

    from collectors.policy import token_ids

    monkeypatch.setattr(token_ids, "SLICE", 7)  # `listed`'s slices
    ids = list(range(0, 300_000, 997))
    assert far_tokenizer.ids_from_bytes(array.array("I", ids).tobytes()) == ids
