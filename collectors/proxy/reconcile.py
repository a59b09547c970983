"""The agent's copy of the conversation reconciled with what the model sampled. Pure.

An agent sends the whole history back on every call, and its copy of the model's own last
reply is rarely the text the model wrote: SDKs and frameworks re-serialize tool-call arguments
(`{"a":2,"b":2}` for the sampled `{"a": 2, "b": 2}`), trim or re-join whitespace, drop the
`<think>` block, or send a Hermes call back as structured `tool_calls`. Rendered as sent, that
history does not extend the tokens the session holds, and every such turn would fork a new
segment (`collectors.proxy.segmenter`), so a multi-turn episode would fall apart into one-turn
samples.

`reconcile` runs before rendering. A session remembers, from its last call, the messages the
agent sent (`Answered.messages`), what was rendered for them (`prompt_messages`), the reply the
agent was answered (`reply`, in the template's message format) and the reply exactly as sampled
(`sampled`: the raw text as the assistant's content, which the template writes verbatim). When
the new call's messages start with the previous call's messages (same meaning) followed by a
reply with the same meaning as the one answered, the sampled reply is rendered in its place,
and the earlier messages as they were rendered before: the prompt then extends the held text
and the segment continues with the exact sampled tokens.

Same meaning, for the model's own replies only: the same tool calls (names, and arguments equal
as JSON values), the same content and reasoning up to whitespace, and reasoning either equal or
dropped (also when the agent left `<think>...</think>` inside the content). Every other message
must be equal as translated. Anything else (compaction, an edited or removed message, changed
tools or system prompt, a reply the agent rewrote) is a real rewrite: nothing is substituted,
and the segmenter forks. How each call's history was reconciled is recorded in its turn's meta
(`history`) and counted in /stats:

    first         the session's first call (nothing to reconcile)
    exact         the reply came back exactly as answered (the sampled text is rendered anyway)
    reserialized  the reply came back with the same meaning in another serialization
    rewritten     the history does not extend the last call's: nothing substituted

Limit: the sampled text is rendered as the assistant message's content, which extends the held
text for templates that write assistant content verbatim (Qwen/Hermes-style, and the template
`trajstore init-model` ships); a template that rewrites content still forks with reason
template drift, as before.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from collectors.proxy.chat import Message
from collectors.model.toolcalls import split_reasoning

FIRST, EXACT, RESERIALIZED, REWRITTEN = "first", "exact", "reserialized", "rewritten"


@dataclass(frozen=True)
class Answered:
    """What a session's last call sent, rendered, answered and sampled (see the module docstring)."""

    messages: list[Message]  # as the agent sent them (translated to template messages)
    prompt_messages: list[Message]  # as they were rendered, one for one
    reply: Message  # the reply as the agent was answered (an assistant prefill included)
    sampled: Message  # the reply exactly as sampled: {"role": "assistant", "content": raw text}
    continue_final: bool  # the last call continued an assistant prefill (its last message)
    tools: list[dict[str, Any]] | None = None  # the tools it was rendered with


def _words(text: Any) -> str:
    return " ".join(text.split()) if isinstance(text, str) else ""


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def _calls(message: Message) -> list[tuple[Any, Any]]:
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call) if isinstance(call, dict) else {}
        calls.append((fn.get("name"), _arguments(fn.get("arguments"))))
    return calls


def same_reply(sent: Message, answered: Message) -> bool:
    """Whether the agent's copy `sent` of a reply means what `answered` said (see the module docstring)."""
    if sent.get("role") != "assistant" or answered.get("role") != "assistant":
        return sent == answered
    content, reasoning = sent.get("content"), sent.get("reasoning_content")
    if reasoning is None and isinstance(content, str):
        reasoning, content = split_reasoning(content)
    if _words(content) != _words(answered.get("content")):
        return False
    if reasoning is not None and _words(reasoning) and _words(reasoning) != _words(answered.get("reasoning_content")):
        return False
    return _calls(sent) == _calls(answered)


def _exact(sent: Message, answered: Message) -> bool:
    """The reply came back as it was answered on the wire (arguments sent as objects compare as values)."""
    if (sent.get("content") or "") != (answered.get("content") or "") or \
            sent.get("reasoning_content") != answered.get("reasoning_content"):
        return False
    mine = [c.get("function", c) for c in sent.get("tool_calls") or []]
    theirs = [c.get("function", c) for c in answered.get("tool_calls") or []]
    return len(mine) == len(theirs) and all(
        m.get("name") == t.get("name") and (m.get("arguments") == t.get("arguments") if isinstance(
            m.get("arguments"), str) else m.get("arguments") == _arguments(t.get("arguments")))
        for m, t in zip(mine, theirs))


def _same(sent: Message, before: Message) -> bool:
    """An earlier message of the call means what it meant in the last call: equal, or the same reply."""
    return sent == before or (sent.get("role") == "assistant" and same_reply(sent, before))


def _same_history(sent: list[Message], before: list[Message]) -> bool:
    """`_same` for each message, one for one; an agent that sends its history back unchanged (the common case) is
    answered by one comparison of the lists in C, whatever the history's length."""
    return sent == before or all(_same(m, b) for m, b in zip(sent, before))


def reconcile(messages: list[Message], answered: Answered | None) -> tuple[list[Message], str]:
    """The messages to render for a call, and how its history was reconciled (first | exact | reserialized |
    rewritten)."""
    if answered is None:
        return messages, FIRST
    k = len(answered.messages) - answered.continue_final  # a continued prefill comes back merged with its reply
    if len(messages) <= k or not _same_history(messages[:k], answered.messages[:k]):
        return messages, REWRITTEN
    reply = messages[k]
    if not same_reply(reply, answered.reply):
        return messages, REWRITTEN
    how = EXACT if _exact(reply, answered.reply) else RESERIALIZED
    return [*answered.prompt_messages[:k], answered.sampled, *messages[k + 1:]], how


def reply_message(content: str, reasoning: str | None, calls: list[tuple[str, str]]) -> Message:
    """A reply in the template's message format (what a wire adapter makes of the agent's copy of it)."""
    message: Message = {"role": "assistant", "content": content or None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
    return message
