"""The generated tokenizer and its chat template, loaded the way any HF consumer loads them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from collectors.model.tokenizer import MARKUP_TOKENS, SPECIAL_TOKENS, generated_corpus

TEXTS = [
    "Hello, world! What's the weather in Paris?",
    "def f(x):\n    return x + 1\n\n\n",
    '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}',
    "tabs\tand   runs of    spaces \r\n and trailing space ",
    "naïve café — 日本語のテキスト, emoji 🎉👩‍💻, math ∑x² ≤ 10",
    "<|im_start|>user\nhi<|im_end|>\n<tool_call>\n{}\n</tool_call><think>\nhm\n</think>",
    "",
]


@pytest.fixture(scope="module")
def tok(tiny_model: Path):
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_and_agreement_with_tokenizer_json(tok, tiny_model: Path, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    raw = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))  # what vLLM and Rust loaders see
    assert raw.encode(text, add_special_tokens=False).ids == ids


def test_control_tokens_are_single_ids_and_only_chatml_ones_are_skipped(tok) -> None:
    for token in (*SPECIAL_TOKENS, *MARKUP_TOKENS):
        assert len(tok.encode(token, add_special_tokens=False)) == 1, token
    ids = tok.encode("<|im_start|>a<tool_call>b</tool_call><think>c</think><|im_end|><|endoftext|>",
                     add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "a<tool_call>b</tool_call><think>c</think>"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"


def test_corpus_is_deterministic_in_its_seed() -> None:
    assert list(generated_corpus(3, 40)) == list(generated_corpus(3, 40))
    assert list(generated_corpus(3, 40)) != list(generated_corpus(4, 40))
    text = "\n".join(generated_corpus(0, 400))
    assert "<tool_call>" in text and "def " in text and '"parameters"' in text


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def conversation(arguments: object) -> list[dict]:
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "content": '{"temp": 3}'},
        {"role": "assistant", "content": "3 degrees."},
    ]


def test_template_renders_tools_tool_calls_and_results(tok) -> None:
    text = tok.apply_chat_template(conversation({"city": "Oslo"}), tools=[WEATHER_TOOL], tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user "
        "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(WEATHER_TOOL) + "\n</tools>\n\nFor each function call, return a json object with function name "
        "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
        "\"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nWeather in Oslo?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n"
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n{\"temp\": 3}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n3 degrees.<|im_end|>\n")
    # OpenAI sends arguments as a JSON string: it is written as is, not encoded twice
    as_string = tok.apply_chat_template(conversation('{"city": "Oslo"}'), tools=[WEATHER_TOOL], tokenize=False)
    assert as_string == text


def test_generation_prompt_and_plain_chat(tok) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"


def test_each_turn_extends_the_previous_prompt_token_for_token(tok) -> None:
    """What segmentation relies on: the prompt for turn k+1 starts with turn k's prompt plus its output."""
    messages = conversation({"city": "Oslo"}) + [{"role": "user", "content": "Thanks"}]
    messages[4]["reasoning_content"] = "The tool said 3."
    for k in range(2, len(messages)):
        if messages[k]["role"] != "assistant":
            continue
        prompt = tok.apply_chat_template(messages[:k], tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False)
        after = tok.apply_chat_template(messages[:k + 1], tools=[WEATHER_TOOL], tokenize=False)
        assert after.startswith(prompt)
        sampled = after[len(prompt):]
        assert sampled.endswith("<|im_end|>\n")
        ids_prompt = tok.encode(prompt, add_special_tokens=False)
        ids_after = tok.encode(after, add_special_tokens=False)
        assert ids_after[:len(ids_prompt)] == ids_prompt
    assert "<think>\nThe tool said 3.\n</think>\n\n3 degrees." in after
