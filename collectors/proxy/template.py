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
method only, `getattr` (what `a.b` in a template reads), for the two reads a chat template makes
most, each of which the sandbox answers the long way (about half of a short render's time):

- `message.role` on a plain dict: the sandbox asks the dict for an attribute of that name first
  and, as a dict has none, takes its key (an exception raised and caught per read). Where the
  name is no attribute of a plain dict, `_DirectSandbox` takes the key at once;
- `loop.first`, `loop.last`, `loop.index0`, ... on jinja's own `LoopContext`: the sandbox checks
  each read against its lists of internal and mutating attributes (several abstract-class
  `isinstance` checks), which pass for every public name of that class. `_DirectSandbox` reads
  those names at once.

Every other read (a dict's own methods, a dict subclass, any other type or name) is the sandbox's,
so what a template may reach, what it refuses, and the text it renders are the sandbox's. (The
compiled template also reads its globals, `range`, `namespace`, `raise_exception` and the
others, from the environment's dict itself rather than through a `ChainMap` over it, which each
render copied key by key.)
"""

from __future__ import annotations

from collections import ChainMap
from typing import Any

from jinja2.runtime import LoopContext
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
# The public names of jinja's `LoopContext`: not underscored, not internal (`is_internal_attribute` looks at the type of
# the object read, and this one is no function, method, type, code, frame or generator), not mutating (it is no
# list, dict, set or deque): the sandbox lets each of them through as `getattr` gives it.
_LOOP_ATTRIBUTES = frozenset(["index", "index0", "revindex", "revindex0", "first", "last", "length", "depth", "depth0",
                              "previtem", "nextitem", "cycle", "changed"])


class _DirectSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox, reading a plain dict's key and a loop's public attribute the short way (module
    docstring)."""

    def getattr(self, obj: Any, attribute: str) -> Any:
        kind = type(obj)
        if kind is dict and attribute not in _DICT_ATTRIBUTES:
            # what `SandboxedEnvironment.getattr` ends with for such a name, once `getattr(obj, attribute)` failed
            try:
                return obj[attribute]
            except (TypeError, LookupError):
                return self.undefined(obj=obj, name=attribute)
        if kind is LoopContext and attribute in _LOOP_ATTRIBUTES:
            try:
                return getattr(obj, attribute)  # a value the sandbox's checks pass (see `_LOOP_ATTRIBUTES`)
            except AttributeError:  # the sandbox would try `obj[attribute]`, which a loop refuses (TypeError)
                return self.undefined(obj=obj, name=attribute)
        return super().getattr(obj, attribute)


def _compile(source: str) -> Any:
    """`source` compiled as transformers compiles it, in the `_DirectSandbox` copy of its environment (transformers'
    own compiled template where that environment is not the sandbox this copies)."""
    compiled = _compile_jinja_template(source)
    if type(compiled.environment) is not ImmutableSandboxedEnvironment:
        return compiled
    environment = compiled.environment.overlay()  # the same options, filters, globals and extensions
    environment.__class__ = _DirectSandbox
    template = environment.from_string(source)
    # Each render starts from a copy of the template's globals: a `ChainMap` of its own (none) over the environment's,
    # copied key by key in Python. The environment's dict itself holds the same names and values, and copies in C.
    chain = template.globals
    if isinstance(chain, ChainMap) and len(chain.maps) == 2 and not chain.maps[0] \
            and chain.maps[1] is environment.globals:
        template.globals = environment.globals
    return template


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
