"""The renderer's tokenizer calls: the Rust backend it uses gives exactly transformers' ids and text."""

from __future__ import annotations

import random
from pathlib import Path

from transformers import AutoTokenizer

from collectors.proxy.render import ChatRenderer

TEXTS = [
    "<|im_start|>user\nhé 😀 <tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call><|im_end|>\n",
    "  leading spaces,\ttabs\n\n and trailing  ",
    "<|endoftext|>x<think>\nwhy\n</think>\n\n<|im_start|>assistant\n",
    "\n",
]


def test_encode_and_decode_match_transformers(tiny_model: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model)
    renderer = ChatRenderer(tok)
    assert renderer._backend is not None  # the fast path is what this test checks
    for text in TEXTS:
        assert renderer.encode(text) == tok.encode(text, add_special_tokens=False)
    rng = random.Random(0)
    for _ in range(200):  # any ids, special tokens and partial UTF-8 sequences included
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))]
        assert renderer.decode(ids) == tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def test_a_tokenizer_that_splits_special_tokens_goes_through_transformers(tiny_model: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model, split_special_tokens=True)
    renderer = ChatRenderer(tok)
    assert renderer._backend is None
    assert renderer.encode(TEXTS[0]) == tok.encode(TEXTS[0], add_special_tokens=False)
