"""Render only what is new: a call whose history extends its session's last call.

An agent resends its whole conversation on every call, and rendering it with the chat template
costs in proportion to its number of messages (about 35 microseconds a message here, jinja and
transformers' conversion of every message, on every call). When `collectors.proxy.reconcile`
finds that a call's messages are the last call's, then the reply the model sampled, then new
messages (`exact` or `reserialized`), with the same tools and no assistant prefill, the prompt is

    the last call's prompt text  +  what the template writes after its generation prompt
                                    for [the last message before the reply, the reply, the new ones]

where the second part is read off a render of just those messages (a short conversation that
puts the template in the same place: after that message, at the reply). That holds for templates
that write each message from itself and its neighbours only (Qwen/Hermes-style, and the one
`trajstore init-model` ships); a template that looks further back (numbering tool calls across
the conversation, say) would differ. So it is used only where it is known to give the full
render's text: a renderer tries it on probe conversations of every shape first (system or not,
tools or not, tool calls, runs of tool results, reasoning, new user turns) and uses it only if
every probe renders exactly as whole; and one call in `VERIFY_EVERY` is rendered whole as well
and compared, so a template that differs on real conversations is found out and rendered whole
from then on (logged once). A call where it does not apply is rendered whole, as before.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from collectors.model.toolcalls import THINK_CLOSE, THINK_OPEN, render_call
from collectors.proxy.chat import ChatError, ChatRequest, Message
from collectors.proxy.reconcile import EXACT, RESERIALIZED, Answered
from collectors.proxy.render import ChatRenderer
from collectors.proxy.segmenter import Extended, Prompt

log = logging.getLogger(__name__)
VERIFY_EVERY = 64  # one extended render in this many is checked against the whole render


class Extender:
    """Renders a call's prompt from the session's last prompt and what is new (module docstring)."""

    def __init__(self, renderer: ChatRenderer) -> None:
        self.renderer = renderer
        self.enabled = _probe(renderer, drop_tools=False)
        # templates that write the tools into the system header only (most) render what is new without them: the
        # tool list is the costliest part of a short render (transformers converts every schema on every call)
        self.drop_tools = self.enabled and _probe(renderer, drop_tools=True)
        self.extended = 0  # calls rendered from what is new only
        self._lock = threading.Lock()  # render threads count and may disable it at once

    def prompt_text(self, req: ChatRequest, messages: list[Message], history: str, answered: Answered | None,
                    last_prompt: tuple[str, ...] | None) -> Prompt:
        """The prompt of `req` rendered from `messages` (reconciled), from what is new where that is exact: then
        as the last call's prompt (`last_prompt`, its pieces) and the new text, never joined (`Extended`)."""
        text = self._extend(req, messages, history, answered, last_prompt)
        if text is None:
            return self.renderer.prompt_text(req, messages)
        with self._lock:
            self.extended += 1
            verify = self.extended % VERIFY_EVERY == 0
        if verify:
            whole = self.renderer.prompt_text(req, messages)
            if whole != str(text):
                with self._lock:
                    if self.enabled:
                        log.warning("the chat template renders a conversation differently from its last call's "
                                    "prompt plus what is new; rendering every call whole from now on")
                    self.enabled = False
                return whole
        return text

    def _extend(self, req: ChatRequest, messages: list[Message], history: str, answered: Answered | None,
                last_prompt: tuple[str, ...] | None) -> Extended | None:
        if not self.enabled or history not in (EXACT, RESERIALIZED) or answered is None or last_prompt is None:
            return None
        if req.continue_final or answered.continue_final or req.tools != answered.tools:
            return None
        k = len(answered.messages)  # messages[k] is the sampled reply, messages[k - 1] the message before it
        if k < 1 or len(messages) <= k:
            return None
        new = extension(self.renderer, messages[k - 1:], None if self.drop_tools else req.tools)
        return None if new is None else Extended(last_prompt, new)


def extension(renderer: ChatRenderer, window: list[Message], tools: list[dict[str, Any]] | None) -> str | None:
    """What the template writes after the generation prompt that follows `window[0]`, when rendering `window`
    (None when the generation prompt is not how the template opens the reply): what follows the last prompt."""
    try:
        head = renderer.render(window[:1], tools, generation_prompt=True)
        whole = renderer.render(window, tools, generation_prompt=True)
    except ChatError:
        return None
    return whole[len(head):] if whole.startswith(head) else None


def _probe(renderer: ChatRenderer, *, drop_tools: bool) -> bool:
    """Whether every probe conversation renders, call by call, exactly as its last prompt plus what is new
    (rendered without the tools, with `drop_tools`)."""
    call = render_call("read", {"path": "a.py"})
    tools = [{"type": "function", "function": {"name": "read", "description": "Read a file.", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
    sampled = [f"Let me look.\n{call}", call, "Done: the bug is fixed.", f"{THINK_OPEN}\nhm\n{THINK_CLOSE}\n\nIt works."]
    news: list[list[Message]] = [
        [{"role": "tool", "content": "def f():\n    return 1"}],
        [{"role": "tool", "content": "one"}, {"role": "tool", "content": "two"}],
        [{"role": "user", "content": "And now?"}],
        [{"role": "tool", "content": "x = 2"}, {"role": "user", "content": "Also this."}]]
    starts: list[list[Message]] = [
        [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "Fix the bug."}],
        [{"role": "user", "content": "Fix the bug."}]]
    try:
        for tool_list in (tools, None):
            for start in starts:
                messages = list(start)
                prompt = renderer.render(messages, tool_list, generation_prompt=True)
                for i in range(8):
                    reply: Message = {"role": "assistant", "content": sampled[i % len(sampled)]}
                    new = news[i % len(news)]
                    window = [messages[-1], reply, *new]
                    messages = [*messages, reply, *new]
                    whole = renderer.render(messages, tool_list, generation_prompt=True)
                    new = extension(renderer, window, None if drop_tools else tool_list)
                    if new is None or prompt + new != whole:
                        return False
                    prompt = whole
    except ChatError:
        return False
    return True
