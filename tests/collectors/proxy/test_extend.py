"""Rendering only what is new (`collectors.proxy.extend`): a call extending its session's last call.

The prompt is the last call's prompt text plus what a short render of the new messages writes:
used only for a template whose probe conversations all render that way exactly as whole, and
checked against the whole render one call in `VERIFY_EVERY`. Through the proxy, a multi-turn
session with tools renders its later calls from what is new and stores every turn exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from collectors.proxy import extend
from collectors.proxy.chat import ChatRequest
from collectors.proxy.extend import Extender
from collectors.proxy.reconcile import reconcile
from collectors.proxy.render import ChatRenderer
from collectors.proxy.segmenter import prompt_pieces
from tests.collectors.proxy_harness import MODEL, Harness, assert_exact, call

PLAIN = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
NUMBERED = ("{% for m in messages %}<|im_start|>{{ m.role }} #{{ loop.index0 }}\n{{ m.content }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "read", "description": "Read a file.", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]


def _renderer(model: Path, template: str | None = None) -> ChatRenderer:
    tok = AutoTokenizer.from_pretrained(model)
    if template is not None:
        tok.chat_template = template
    return ChatRenderer(tok)


def test_the_shipped_template_renders_what_is_new_and_a_template_that_looks_back_does_not(tiny_model: Path) -> None:
    shipped = Extender(_renderer(tiny_model))
    assert shipped.enabled and shipped.drop_tools  # Qwen-style: the tools are in the system header only
    assert Extender(_renderer(tiny_model, PLAIN)).enabled
    assert not Extender(_renderer(tiny_model, NUMBERED)).enabled  # numbers every message: a short render differs


def _calls(renderer: ChatRenderer, extender: Extender, replies: list[str]) -> list[tuple[str, str]]:
    """(extended or whole render, whole render) of each call of a session answered with `replies`."""
    from collectors.proxy.reconcile import Answered, reply_message

    messages: list[dict[str, Any]] = [{"role": "system", "content": "sys"}, {"role": "user", "content": "go"}]
    answered, last, out = None, None, []
    for i, text in enumerate(replies):
        req = ChatRequest("openai", MODEL, list(messages), TOOLS, True, 8)
        rendered, how = reconcile(req.messages, answered)
        got = extender.prompt_text(req, rendered, how, answered, last)
        out.append((str(got), renderer.prompt_text(req, rendered)))
        answered = Answered(messages=req.messages, prompt_messages=rendered, continue_final=False, tools=TOOLS,
                            reply=reply_message(text, None, []), sampled={"role": "assistant", "content": text})
        last = prompt_pieces(got)
        messages += [{"role": "assistant", "content": text}, {"role": "tool", "content": f"result {i}"}]
    return out


def test_extended_renders_equal_whole_ones_and_a_difference_found_renders_whole(
        tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    renderer = _renderer(tiny_model)
    extender = Extender(renderer)
    calls = _calls(renderer, extender, [f"reply {i}" for i in range(6)])
    assert [got for got, _ in calls] == [whole for _, whole in calls]
    assert extender.extended == 5  # every call after the first
    monkeypatch.setattr(extend, "VERIFY_EVERY", 1)
    monkeypatch.setattr(extend, "extension", lambda *a, **k: "not what the template writes")
    calls = _calls(renderer, extender, ["a", "b", "c"])
    assert [got for got, _ in calls] == [whole for _, whole in calls]  # the checked call answered whole ...
    assert not extender.enabled  # ... and every call after it is rendered whole


def test_a_tool_session_through_the_proxy_renders_only_what_is_new_and_stores_exactly(proxy: Harness) -> None:
    rollout = proxy.open()
    extender = proxy.proxy.capture._extender  # noqa: SLF001 - how many calls took the short render
    before = extender.extended
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."},
                                      {"role": "user", "content": "Read a.py"}]
    for i in range(4):
        r = call(proxy.url + "/v1/chat/completions", {"model": MODEL, "messages": messages, "tools": TOOLS,
                                                      "max_tokens": 6}, key=rollout["api_key"])
        assert r.status == 200, r.body
        message = r.body["choices"][0]["message"]
        messages.append({k: v for k, v in message.items() if k in ("role", "content", "tool_calls")})
        messages.append({"role": "user", "content": f"and file {i}?"})
    assert extender.extended - before == 3
    turns = assert_exact(proxy, rollout["rollout_id"])
    assert len(turns) == 4 and len({t["segment_id"] for t in turns}) == 1
