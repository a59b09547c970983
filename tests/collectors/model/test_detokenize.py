"""Incremental detokenization equals decoding everything at once, token by token (byte-level BPE, multibyte text)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from collectors.model.detokenize import IncrementalText

TEXTS = ["Hello, world! The answer is 42.", "naïve café — 東京 and 😀 emoji", "<tool_call>\n{\"a\": 1}\n</tool_call>",
         "  spaces\n\nand\ttabs  "]


@pytest.fixture(scope="module")
def tok(tiny_model: Path):
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.mark.parametrize("skip", [True, False])
def test_the_running_text_is_the_whole_decode_at_every_complete_character(tok, skip: bool) -> None:
    rng = random.Random(0)
    specials = [tok.convert_tokens_to_ids("<|im_end|>")]
    streams = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    streams += [[rng.randrange(tok.vocab_size) for _ in range(60)] for _ in range(20)]  # any ids at all
    streams += [s + specials + s for s in streams[:2]]
    for ids in streams:
        inc = IncrementalText(lambda x: tok.decode(x, skip_special_tokens=skip))
        for k, token in enumerate(ids, 1):
            inc.push(token)
            whole = tok.decode(ids[:k], skip_special_tokens=skip)
            assert whole.startswith(inc.text)
            assert whole == inc.text or whole.endswith("\ufffd")  # only an incomplete character waits
        final = tok.decode(ids, skip_special_tokens=skip)
        assert final.rstrip("\ufffd") == inc.text.rstrip("\ufffd")


def test_push_returns_exactly_the_new_text(tok) -> None:
    ids = tok.encode(TEXTS[1], add_special_tokens=False)
    inc = IncrementalText(lambda x: tok.decode(x))
    assert "".join(inc.push(t) for t in ids) == inc.text == TEXTS[1]
