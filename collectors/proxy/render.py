"""The proxy's side of the chat template: messages to prompt text, sampled ids to a parsed reply.

`ChatRenderer` wraps the model's tokenizer (loaded from the same checkpoint the policy server
serves) and is the only place the capture proxy renders or tokenizes:

- `prompt_text`: the conversation through the generation prompt (`<|im_start|>assistant\\n`),
  or, for an assistant prefill, through the prefill text (`continue_final_message`);
- `reply`: the sampled text (the final stop token removed, a stop string and what follows it
  cut off, as the server does) parsed by `collectors.model.toolcalls` in the model's tool-call
  format (`format`: given, or read from the chat template by `detect_format`);
- `sampled_message`: the reply exactly as sampled, in a message the template renders back to
  the sampled text (reconciliation renders it in place of the agent's copy).

`encode` never adds special tokens: Qwen-style templates write every control token themselves.

`check_fits` refuses, before anything is rendered, a request whose text alone needs more
tokens than the context holds: no token of the vocabulary spells more than
`longest_token_chars` characters, so N characters of text are at least N / that many tokens.
The bound is exact (never refuses a prompt that fits) and catches a prompt far over the
context, whose rendering and tokenization would be the costliest work a request can ask for.
Its text is counted only when the request's JSON body (`ChatRequest.body_bytes`, which bounds
the characters of its text) is large enough to be refused: an ordinary call costs nothing here.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jinja2 import TemplateError

from collectors.policy import Sample
from collectors.proxy.ascii_bpe import AsciiBPE
from collectors.proxy.chat import ChatError, ChatReply, ChatRequest
from collectors.proxy.far_tokenizer import FAR_CHARS, FarTokenizer
from collectors.proxy.piece_cache import PieceCache, unsplittable
from collectors.proxy.template import Template
from collectors.model.toolcalls import check_format, detect_format, parse_output

THROUGH_TRANSFORMERS = "the tokenizer is encoded through transformers"  # why a tokenizer gets no fast path


def text_ids(sample: Sample) -> list[int]:
    """The sampled ids a reply's text comes from: all but the stop token that ended the sample."""
    ids = list(sample.output_ids)
    ended_by_token = sample.finish_reason == "stop" and not isinstance(sample.stop_reason, str)
    return ids[:-1] if ended_by_token and ids else ids


class ChatRenderer:
    """Renders conversations and decodes replies with one tokenizer and its chat template."""

    def __init__(self, tokenizer: Any, tool_format: str | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; the proxy needs one to render conversations "
                             "(models made by `trajstore init-model` ship with it)")
        self.tokenizer = tokenizer
        self.format = check_format(tool_format) if tool_format else detect_format(tokenizer.chat_template)
        if self.format == "harmony":  # fail at start, not at the first reply, when its vocabulary is missing
            from collectors.model.harmony import encoding

            encoding()
        # A call through transformers' encode / decode costs several times the Rust tokenizer's own work,
        # and a turn makes several. The backend gives the same ids and text when transformers would not
        # truncate, pad or split special tokens, which is the case for every tokenizer loaded as is.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        plain = backend is not None and backend.truncation is None and backend.padding is None and not (
            getattr(tokenizer, "split_special_tokens", False) or backend.encode_special_tokens)
        self._backend = backend if plain else None
        self._far = FarTokenizer(backend) if plain else None
        # ASCII text through the tokenizer's own steps, without its bookkeeping: see `collectors.proxy.ascii_bpe`
        self._ascii, self._ascii_off = AsciiBPE.of(backend) if plain else (None, THROUGH_TRANSFORMERS)
        # a long text's pieces between control tokens are tokenized once: see `collectors.proxy.piece_cache`
        self._pieces = PieceCache.of(backend, encode_pieces=self._encode_pieces) if plain else None
        self._pieces_off = None if self._pieces is not None else (
            unsplittable(backend) if plain else THROUGH_TRANSFORMERS)
        self._template = Template.of(tokenizer)  # renders as apply_chat_template does, without its copies
        # byte-level and SentencePiece vocabularies spell a token with at least as many symbols as its text has
        # characters; added tokens (control tokens) are written by the template, not by the request's text
        self.longest_token_chars = max((len(t) for t in tokenizer.get_vocab()), default=1) or 1

    def encode(self, text: str) -> list[int]:
        if self._far is not None and len(text) > FAR_CHARS:  # a huge text: see `collectors.proxy.far_tokenizer`
            ids = self._far.encode(text)
            if ids is not None:
                return ids
        if self._pieces is not None and len(text) >= self._pieces.min_chars:  # tokenizes the pieces not yet seen
            return self._pieces.encode(text)
        ids = self._ascii.encode(text) if self._ascii is not None else None
        if ids is not None:
            return ids
        if self._backend is not None:
            # The same ids as `encode`, which holds the GIL for its whole run (about a second per MB of text
            # here: a render thread tokenizing a huge prompt would stop the event loop all the same);
            # `encode_batch_fast` lets other threads run meanwhile and, tracking no offsets, takes about 30%
            # less time at every length.
            return self._backend.encode_batch_fast([text], add_special_tokens=False)[0].ids
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _encode_pieces(self, pieces: list[str]) -> list[list[int]]:
        """The ids of pieces holding no added token: through the ASCII path where it applies."""
        ids = self._ascii.encode_pieces(pieces) if self._ascii is not None else None
        if ids is not None:
            return ids
        return [e.ids for e in self._backend.encode_batch_fast(pieces, add_special_tokens=False)]

    def piece_stats(self) -> dict[str, Any]:
        """The piece cache's counters (GET /stats), or why there is no cache for this tokenizer."""
        return self._pieces.as_json() if self._pieces is not None else {"off": self._pieces_off}

    def ascii_stats(self) -> dict[str, Any]:
        """What the ASCII tokenizing path did (GET /stats), or why this tokenizer has none."""
        return self._ascii.as_json() if self._ascii is not None else {"off": self._ascii_off}

    def close(self) -> None:
        """Stop the helper process that tokenizes huge texts, if one was started."""
        if self._far is not None:
            self._far.close()

    def decode(self, ids: list[int]) -> str:
        """Text of sampled ids with special tokens kept: exactly what the model wrote."""
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=False)
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *,
               generation_prompt: bool, continue_final: bool = False) -> str:
        try:
            if self._template is not None and messages and not continue_final:  # the same text, sooner
                return self._template.render(messages, tools, generation_prompt=generation_prompt)
            return self.tokenizer.apply_chat_template(
                messages, tools=tools or None, tokenize=False, add_generation_prompt=generation_prompt,
                continue_final_message=continue_final)
        except (TemplateError, ValueError, TypeError, KeyError) as exc:
            raise ChatError(f"the chat template cannot render this conversation: {exc}", param="messages") from exc

    def prompt_text(self, req: ChatRequest, messages: list[dict[str, Any]] | None = None) -> str:
        """The prompt of `req`, rendering `messages` in place of its own when given (reconciled ones)."""
        return self.render(req.messages if messages is None else messages, req.tools,
                            generation_prompt=not req.continue_final, continue_final=req.continue_final)

    def check_fits(self, req: ChatRequest, max_model_len: int) -> None:
        """Refuse `req` when its text alone needs more tokens than `max_model_len` (see the module docstring)."""
        if req.body_bytes is not None and math.ceil(req.body_bytes / self.longest_token_chars) <= max_model_len:
            return  # the body is too small to hold that much text: counting it would refuse nothing
        chars = _text_chars([req.messages, req.tools])
        at_least = math.ceil(chars / self.longest_token_chars)
        if at_least > max_model_len:
            raise ChatError(f"the prompt is at least {at_least:,} tokens ({chars:,} characters of text; no token of "
                            f"this model spells more than {self.longest_token_chars}) but the model's context holds "
                            f"{max_model_len:,}: shorten or compact the conversation", param="messages")

    @property
    def special_ids(self) -> set[int]:
        """Ids of the tokenizer's special tokens: any of them may be the token that ends a reply."""
        return set(self.tokenizer.all_special_ids)

    def reply(self, sample: Sample, req: ChatRequest, text: str, *, prompt_tokens: int, reply_id: str,
              call_id: Any, model: str, created: int, trajstore: dict[str, Any]) -> ChatReply:
        """Parse a sample whose `text_ids` decode to `text`; `call_id()` names each tool call in the
        caller's protocol."""
        ids = list(sample.output_ids)
        stop_string = sample.stop_reason if isinstance(sample.stop_reason, str) else None
        if stop_string is not None:
            hits = [i for i in (text.find(s) for s in req.sampling.stop) if i >= 0]
            text = text[:min(hits)] if hits else text
        parsed = parse_output(text, parse_tools=req.parse_tools and bool(req.tools), fmt=self.format)
        calls = tuple(dataclasses.replace(c, id=call_id()) for c in parsed.tool_calls)
        finish = "tool_calls" if calls and sample.finish_reason == "stop" else sample.finish_reason
        texts = [self.decode([t]) for t in ids] if req.options.get("logprobs") else []
        return ChatReply(id=reply_id, model=model, created=created, content=parsed.content,
                         reasoning=parsed.reasoning, tool_calls=calls, finish=finish, stop_sequence=stop_string,
                         prompt_tokens=prompt_tokens, output_ids=ids,
                         output_logprobs=list(sample.output_logprobs), token_texts=texts,
                         policy_version=sample.policy_version, trajstore=trajstore,
                         top_logprobs=sample.top_logprobs, top_n=int(req.options.get("top_logprobs") or 0))


    def sampled_message(self, text: str, answered: dict[str, Any]) -> dict[str, Any]:
        """The reply as sampled, for the template: its raw text as content where the template writes content
        verbatim (hermes, llama3); harmony writes each part on its channel, so there it is the parsed reply
        `answered`, whose calls keep the model's own arguments text."""
        return answered if self.format == "harmony" else {"role": "assistant", "content": text}


def _text_chars(value: Any) -> int:
    """The characters of every string value in `value` (iterative: any depth)."""
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return total
