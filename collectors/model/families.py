"""The chat-format families `trajstore init-model` can build: each one's template, control tokens and stop tokens.

A family is what a tokenizer and chat template must agree on for one model line: which
control tokens exist (special, so no text the agent sends can spell them), which token ends
the tokenizer's turn (`eos`), and which sampled tokens end a reply (`stops`, written to
generation_config.json, where the embedded server and vLLM read them). The tool-call format
of each family (how `collectors.model.toolcalls` parses a reply) has the family's name.

- hermes: Qwen2.5 / Hermes ChatML, `<tool_call>` JSON blocks, `<think>` reasoning;
- llama3: Llama 3.1's header tokens, JSON calls (optionally after `<|python_tag|>`), a turn
  ended by `<|eot_id|>` or, after a call to the executor, `<|eom_id|>`;
- harmony: gpt-oss's messages with channels (analysis, commentary, final), calls addressed
  `to=functions.NAME`, a reply ended by `<|return|>` (final answer) or `<|call|>` (tool call).
"""

from __future__ import annotations

from dataclasses import dataclass

from collectors.model.chat_template import CHAT_TEMPLATE
from collectors.model.family_templates import HARMONY_CHAT_TEMPLATE, LLAMA3_CHAT_TEMPLATE


@dataclass(frozen=True)
class Family:
    name: str
    template: str
    special: tuple[str, ...]  # control tokens: special, skipped by decode(skip_special_tokens=True)
    markup: tuple[str, ...]  # plain added tokens: kept in decoded text, where parsers look for them
    eos: str  # the tokenizer's eos token
    pad: str
    stops: tuple[str, ...]  # every token that ends a sampled reply (generation_config's eos_token_id)
    bos: str | None = None  # written by the template itself, never added by encode


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("hermes", CHAT_TEMPLATE, special=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
           markup=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"),
           eos="<|im_end|>", pad="<|endoftext|>", stops=("<|im_end|>", "<|endoftext|>")),
    Family("llama3", LLAMA3_CHAT_TEMPLATE,
           special=("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                    "<|eom_id|>", "<|python_tag|>"),
           markup=(), eos="<|eot_id|>", pad="<|end_of_text|>",
           stops=("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"), bos="<|begin_of_text|>"),
    Family("harmony", HARMONY_CHAT_TEMPLATE,
           special=("<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                    "<|return|>", "<|call|>"),
           markup=(), eos="<|return|>", pad="<|endoftext|>", stops=("<|return|>", "<|call|>", "<|endoftext|>")),
)}


def family(name: str) -> Family:
    """The family called `name`, or an error listing the ones there are."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; choose one of {', '.join(FAMILIES)}") from None
