"""The chat template rendered directly gives exactly `apply_chat_template`'s text, for every family's template."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from collectors.model.chat_template import CHAT_TEMPLATE
from collectors.model.family_templates import (
    HARMONY_CHAT_TEMPLATE,
    LLAMA3_CHAT_TEMPLATE,
)
from collectors.proxy.frozen import freeze
from collectors.proxy.render import ChatRenderer
from collectors.proxy.template import Template

TOOLS = [{"type": "function", "function": {"name": "read", "description": "Read a file.", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
TEXT = st.text(st.characters(codec="utf-8"), max_size=12)
CALL = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries({
    "name": st.sampled_from(["read", "write"]),
    "arguments": st.one_of(st.just('{"path": "a.py"}'), st.dictionaries(st.sampled_from("ab"), TEXT, max_size=2))})})
MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user"]), "content": TEXT}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.one_of(st.none(), TEXT)}, optional={
        "reasoning_content": st.one_of(st.none(), TEXT), "reasoning": TEXT, "thinking": TEXT,
        "tool_calls": st.lists(CALL, max_size=2)}),
    st.fixed_dictionaries({"role": st.just("tool"), "content": TEXT, "tool_call_id": st.one_of(st.none(), TEXT)}))


def outcome(render: Any) -> tuple[str, Any]:
    try:
        return "text", render()
    except Exception as exc:  # noqa: BLE001 - a template that refuses must refuse the same way
        return "error", type(exc)


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, LLAMA3_CHAT_TEMPLATE, HARMONY_CHAT_TEMPLATE],
                         ids=["hermes", "llama3", "harmony"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=st.lists(MESSAGE, min_size=1, max_size=5), tools=st.sampled_from([None, [], TOOLS]),
       generation_prompt=st.booleans())
def test_a_direct_render_is_apply_chat_templates_text(tokenizer: Any, template: str, messages: list[dict[str, Any]],
                                                      tools: Any, generation_prompt: bool) -> None:
    tokenizer.chat_template = template
    direct = Template(tokenizer)
    assert outcome(lambda: direct.render(messages, tools, generation_prompt=generation_prompt)) == outcome(
        lambda: tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                              add_generation_prompt=generation_prompt))


def test_a_tokenizer_that_renders_its_own_way_goes_through_transformers(tiny_model: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model)

    class Own(type(tok)):  # type: ignore[misc]
        def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
            return "own"

    tok.__class__ = Own
    assert Template.of(tok) is None
    assert ChatRenderer(tok).render([{"role": "user", "content": "hi"}], None, generation_prompt=True) == "own"


# What a template may read of a message, a loop, a tool or a value, and what the sandbox refuses: a message's keys
# that are also a dict's methods (the method wins), a missing key, every public loop attribute, a shared (frozen)
# tool list, a string's methods, and reads and calls the sandbox refuses (internals, changing a value)
EDGE_TEMPLATE = (
    "{%- for message in messages -%}[{{ message.role }}|{{ message.get('role') }}|{{ message.items() | list | length }}"
    "|{{ message.keys is callable }}|{{ message.nothing is defined }}{{ message.nothing }}|{{ message.mro }}"
    "|{{ message.content.upper() }}|{{ message['items'] if 'items' in message }}]"
    "{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}"
    "{{ loop.length }}{{ loop.depth }}{{ loop.depth0 }}{{ loop.previtem is defined }}{{ loop.nextitem is defined }}"
    "{{ loop.cycle('odd', 'even') }}{{ loop.changed(message.role) }}{{ loop.nothing is defined }}{{ loop.nothing }}"
    "{%- endfor -%}"
    "{{ range(3) | list }}{{ namespace(a=1).a }}{{ dict(b=2).b }}{{ raise_exception is defined }}"
    "{{ strftime_now is defined }}{{ cycler is defined }}{{ eos_token }}"
    "{%- for tool in tools or [] -%}<{{ tool.function.name }}|{{ tool.items() | list | length }}|{{ tool | tojson }}>"
    "{%- endfor -%}")
REFUSED = ["{{ messages[0].__class__.__mro__ }}", "{{ messages[0].update({'role': 'x'}) }}",
           "{{ messages[0].pop('role') }}", "{{ messages[0].__init__ }}{{ messages[0].__init__.__globals__ }}",
           "{{ tools[0].function.update({'name': 'x'}) }}", "{{ tools[0].__class__.__bases__ }}",
           "{% for m in messages %}{{ loop._iterator.x }}{% endfor %}",
           "{% for m in messages %}{{ loop.__class__.__mro__ }}{% endfor %}",
           "{% for m in messages %}{{ loop.__init__.__globals__ }}{% endfor %}"]


@pytest.mark.parametrize("template", [EDGE_TEMPLATE, *REFUSED])
def test_a_direct_render_reads_and_refuses_what_the_sandbox_does(tokenizer: Any, template: str) -> None:
    tokenizer.chat_template = template
    messages = [{"role": "user", "content": "hi", "items": "a key", "keys": "another", "mro": "m"},
                {"role": "tool", "content": "out", "tool_call_id": None}]
    direct = Template(tokenizer)
    for tools in (TOOLS, freeze(TOOLS)):
        got = outcome(partial(direct.render, messages, tools, generation_prompt=True))
        assert got == outcome(partial(tokenizer.apply_chat_template, messages, tools=tools, tokenize=False,
                                      add_generation_prompt=True))
        assert (got[0] == "text") == (template == EDGE_TEMPLATE), got
