"""A tokenizer's chat template rendered directly, to the text `apply_chat_template` gives. Pure.

transformers' `apply_chat_template(..., tokenize=False)` copies every message twice before it
renders (objects to dicts, then to plain JSON types, so a template never sees rich objects),
drops the keys whose value is None, and aliases the reasoning fields; for the short renders a
call makes (`collectors.proxy.extend`) that costs as much as the template itself. The proxy's
messages and tools are plain JSON values already (decoded from a request body, or built from
strings), so `Template.render` does the rest of what it does, with the same compiled template
(transformers' own, cached by it) and the same variables, and gives the same text. A
tokenizer whose class renders otherwise (one that overrides `apply_chat_template`), or a
transformers without those helpers, is not rendered here (`Template.of` gives None), nor is an empty conversation or an assistant prefill
(`continue_final_message`), whose handling is left to transformers.

The template is compiled once more, from the same source, in a copy of transformers' sandbox
(`jinja2`'s `overlay`: the same options, filters, globals and extensions) that differs in one
method only: reading `message.role` from a plain dict. The sandbox asks the dict for an
attribute of that name first and, as a dict has none, takes its key: an exception raised and
caught for each such read, about a quarter of a short render's time. `_PlainDictSandbox` takes
the key at once where the name is no attribute of a plain dict, and leaves every other read
(a dict's own methods, any other type, a dict subclass) to the sandbox, so what a template may
reach, and the text it renders, are the sandbox's.
"""

from __future__ import annotations

from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from transformers import PreTrainedTokenizerBase

try:  # transformers' own helpers; a version without them renders through `apply_chat_template`
    from transformers.utils.chat_template_utils import (
        _compile_jinja_template,
        _plain_template_data,
    )
except ImportError:  # pragma: no cover - depends on the installed transformers
    _compile_jinja_template = _plain_template_data = None

# the names a message's reasoning is read under, as transformers aliases them (`_alias_reasoning_fields`)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# Every name `getattr` can find on a plain dict (dict's and object's attributes; a dict instance has no `__dict__`),
# and type's too, which it cannot, to leave the sandbox more than it needs: any other name is no attribute of one.
_DICT_ATTRIBUTES = frozenset(dir(dict)) | frozenset(dir(type))


class _PlainDictSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox, reading a plain dict's key without first failing to read it as an attribute (module
    docstring)."""

    def getattr(self, obj: Any, attribute: str) -> Any:
        if type(obj) is dict and attribute not in _DICT_ATTRIBUTES:
            # what `SandboxedEnvironment.getattr` ends with for such a name, once `getattr(obj, attribute)` failed
            try:
                return obj[attribute]
            except (TypeError, LookupError):
                return self.undefined(obj=obj, name=attribute)
        return super().getattr(obj, attribute)


def _compile(source: str) -> Any:
    """`source` compiled as transformers compiles it, in the `_PlainDictSandbox` copy of its environment (transformers'
    own compiled template where that environment is not the sandbox this copies)."""
    compiled = _compile_jinja_template(source)
    if type(compiled.environment) is not ImmutableSandboxedEnvironment:
        return compiled
    environment = compiled.environment.overlay()  # the same options, filters, globals and extensions
    environment.__class__ = _PlainDictSandbox
    return environment.from_string(source)


class Template:
    """The compiled chat template(s) of one tokenizer and the variables transformers passes them."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._variables = _plain_template_data(dict(tokenizer.special_tokens_map))
        self._compiled: dict[str, Any] = {}

    @classmethod
    def of(cls, tokenizer: Any) -> Template | None:
        """A direct renderer for `tokenizer`, or None when its class renders its own way."""
        if _compile_jinja_template is None or getattr(
                type(tokenizer), "apply_chat_template", None) is not PreTrainedTokenizerBase.apply_chat_template:
            return None
        return cls(tokenizer)

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *,
               generation_prompt: bool) -> str:
        """What `apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=...)`
        returns for a non-empty list of plain JSON messages (its exceptions too)."""
        tools = tools or None
        source = self.tokenizer.get_chat_template(None, tools)
        compiled = self._compiled.get(source)
        if compiled is None:
            compiled = self._compiled[source] = _compile(source)
        chat = []
        for message in messages:
            if not isinstance(message, dict):
                raise TypeError(f"Chat messages should be dicts, but got {message!r}.")
            message = {k: v for k, v in message.items() if v is not None}
            reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
            chat.append(message)
        return compiled.render(messages=chat, tools=None if tools is None else list(tools), documents=None,
                               add_generation_prompt=generation_prompt, **self._variables)
