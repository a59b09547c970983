"""The built-in tool-calling agent: call the model, run the tools it asks for, repeat until it answers.

    agent = tool_agent([calculator], max_parallel_calls=4, max_output_chars=2000, system="Be brief.")
    result = await agent({"prompt": "What is 17 * 23?"}, ctx)       # a ToolAgentResult

The conversation it sends (OpenAI Chat Completions messages, through `ctx.openai`, hence
captured by the proxy). This format is a contract: a supervised warm start renders the same
conversation with the chat template, and any drift from it would train on prompts the agent
never sends.

1. `{"role": "system", "content": S}` first, when `task["system"]` or else the `system`
   argument is given and the task's own messages do not already start with a system message;
2. the task: `task["messages"]` as given, or `{"role": "user", "content": task["prompt"]}`;
3. per model call, the assistant message exactly as the proxy returned it,
   `message.model_dump(exclude_none=True)`: `{"role": "assistant", "content": C}` (no
   "content" key when the reply is only tool calls; the template renders that exactly as
   `"content": None`) plus, when the model called tools, `"tool_calls": [{"id", "type":
   "function", "function": {"name", "arguments"}}]` with `arguments` the model's own JSON
   text, unchanged, and `"reasoning_content"` when it wrote a `<think>` block. Replaying it unchanged is what lets
   the proxy extend one segment over the whole episode instead of forking;
4. then one `{"role": "tool", "tool_call_id": ID, "content": OUTPUT}` per tool call, in the
   order of the calls. OUTPUT is `collectors.agents.tools.call_tool`'s text: the result (str as is,
   else JSON), cut to `max_output_chars` with a marker, or an `error: ...` line. Calls beyond
   `max_parallel_calls` in one reply are not run; their OUTPUT says so.

Every call passes `tools=[tool_schema(f) for f in tools]` (in the given order),
`max_tokens=ctx.max_tokens` and `ctx.sampling`. The loop stops when a reply calls no tool
(done), when a reply is cut by max_tokens (`ctx.truncate("max_tokens")`, its tool calls, if
any, are not run), or after `ctx.max_turns` model calls while the model still calls tools
(the last reply's calls are run, then `ctx.truncate("max_turns")`).

A tool that stands for the environment's hidden state (what the episode's task knows and the
model does not, like the forecast where the user will be) reads it with `current_task()`:
the agent sets it for the episode, and every tool call of that episode sees it (a sync tool
runs in a thread that copies the context).
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from collectors.agents.context import Agent, AgentContext
from collectors.agents.tools import Tool, ToolSchemaError, call_tool, tool_schema
from collectors.errors import CollectorError

_TASK: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("trajstore_tool_agent_task")


def current_task() -> dict[str, Any]:
    """The task of the tool-agent episode this tool call belongs to (see the module docstring)."""
    try:
        return _TASK.get()
    except LookupError:
        raise CollectorError("current_task() is for tools the tool agent calls during an episode; call the "
                             "tool from a tool_agent episode, or pass the task to the function it wraps") from None


@dataclass(frozen=True)
class ToolAgentResult:
    """What one episode of the tool agent produced; handed to the reward as `result`."""

    text: str  # the last assistant content ("" when it had none)
    messages: list[dict[str, Any]]  # the whole conversation, in the format of the module docstring
    tool_calls: list[tuple[str, str, str]]  # (name, arguments JSON text, output) of every call, in order
    turns: int  # model calls made


def tool_agent(tools: Sequence[Tool], *, max_parallel_calls: int = 4, max_output_chars: int = 2000,
               system: str | None = None) -> Agent:
    """An agent that offers `tools` to the model and runs its calls (see the module docstring)."""
    if max_parallel_calls < 1 or max_output_chars < 1:
        raise ValueError(f"max_parallel_calls ({max_parallel_calls}) and max_output_chars ({max_output_chars}) "
                         "must both be at least 1")
    schemas = [tool_schema(t) for t in tools]  # unsupported annotations fail here, before any rollout
    by_name: dict[str, Tool] = {}
    for schema, tool in zip(schemas, tools, strict=True):
        name = schema["function"]["name"]
        if name in by_name:
            raise ToolSchemaError(f"two tools are named {name!r}; the model calls tools by name, so rename one")
        by_name[name] = tool

    async def agent(task: dict[str, Any], ctx: AgentContext) -> ToolAgentResult:
        _TASK.set(task)  # this episode's own context: concurrent episodes each see their task
        messages = initial_messages(task, system)
        calls: list[tuple[str, str, str]] = []
        text = ""
        turns = 0
        while turns < ctx.max_turns:
            kwargs: dict[str, Any] = {"tools": schemas} if schemas else {}
            response = await ctx.openai.chat.completions.create(
                model=ctx.model, messages=messages, max_tokens=ctx.max_tokens, **kwargs, **ctx.sampling)
            turns += 1
            choice = response.choices[0]
            messages.append(choice.message.model_dump(exclude_none=True))
            text = choice.message.content or ""
            if choice.finish_reason == "length":
                ctx.truncate("max_tokens")
                break
            requested = choice.message.tool_calls or []
            if not requested:
                break
            outputs = await _run_calls(by_name, requested, max_parallel_calls, max_output_chars)
            for call, output in zip(requested, outputs, strict=True):
                messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
                calls.append((call.function.name, call.function.arguments, output))
            if turns == ctx.max_turns:
                ctx.truncate("max_turns")  # it still wanted to act; its answer was never given
        return ToolAgentResult(text=text, messages=messages, tool_calls=calls, turns=turns)

    return agent


def initial_messages(task: dict[str, Any], system: str | None = None) -> list[dict[str, Any]]:
    """The conversation's opening (items 1 and 2 of the module docstring)."""
    if "messages" in task:
        messages = [dict(m) for m in task["messages"]]
    elif "prompt" in task:
        messages = [{"role": "user", "content": task["prompt"]}]
    else:
        raise ValueError(f"task {task.get('id', '')!r} has neither 'prompt' nor 'messages' (its keys: "
                         f"{sorted(task)}); give the tool agent one of them")
    system = task.get("system", system)
    if system is not None and not (messages and messages[0].get("role") == "system"):
        messages.insert(0, {"role": "system", "content": system})
    return messages


async def _run_calls(by_name: dict[str, Tool], requested: Sequence[Any], limit: int, max_chars: int) -> list[str]:
    """The outputs of one reply's calls, in order; the first `limit` run concurrently, the rest are refused."""
    run = [call_tool(by_name, c.function.name, c.function.arguments, max_output_chars=max_chars)
           for c in requested[:limit]]
    refused = (f"error: not run; at most {limit} tool calls are run per reply and this was call "
               f"{i + 1} of {len(requested)}; call it again in your next reply" for i in range(limit, len(requested)))
    return [*await asyncio.gather(*run), *refused]
