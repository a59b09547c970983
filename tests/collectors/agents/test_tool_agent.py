"""The built-in tool agent through the real capture proxy, real OpenAI SDK and the real store.

The upstream is `Scripted` (a random tiny model never writes a well-formed `<tool_call>`), so
each test scripts the model's replies; the agent, the tools, the proxy, the chat template and
the store are the real ones.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from collectors.agents.context import AgentContext, RolloutInfo
from collectors.agents.tool_agent import ToolAgentResult, current_task, initial_messages, tool_agent
from collectors.agents.tools import ToolSchemaError
from collectors.errors import CollectorError
from collectors.model.toolcalls import render_call
from collectors.policy import Sample, SamplingParams
from tests.collectors.proxy_harness import MODEL, Harness, Scripted, running_proxy


@dataclass
class Cuttable:
    """`Scripted`, except that while `cut` is set each reply ends as if max_tokens stopped it."""

    inner: Scripted
    cut: bool = False
    base_url: str = "scripted://"

    async def complete(self, prompt_ids: Sequence[int], sampling: SamplingParams, *,
                       session_id: str | None = None) -> Sample:
        sample = await self.inner.complete(prompt_ids, sampling, session_id=session_id)
        if not self.cut:
            return sample
        return dataclasses.replace(sample, output_ids=sample.output_ids[:-1], finish_reason="length",
                                   output_logprobs=sample.output_logprobs[:-1])

    async def models(self) -> list[str]:
        return await self.inner.models()

    async def load_weights(self, path: str, version: int) -> None:
        await self.inner.load_weights(path, version)

    async def aclose(self) -> None:
        pass


@pytest.fixture(scope="module")
def proxy(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    upstream = Cuttable(Scripted(AutoTokenizer.from_pretrained(tiny_model)))
    with running_proxy(upstream, tmp_path_factory.mktemp("store"), tiny_model) as h:
        yield h


def script(h: Harness, *texts: str, cut: bool = False) -> None:
    h.upstream.inner.replies[:] = list(texts)
    h.upstream.cut = cut


def call_text(tool: str, **arguments: Any) -> str:
    """A tool call exactly as the chat template writes it (and a trained model samples it)."""
    return render_call(tool, arguments)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


def fail(why: str) -> str:
    """A tool that raises."""
    raise RuntimeError(why)


def play(h: Harness, agent: Any, task: dict[str, Any], tmp_path: Path, *, max_turns: int = 5,
         max_tokens: int = 64) -> tuple[ToolAgentResult, AgentContext, dict[str, Any]]:
    rollout = h.open(group_id="g", group_size=1)
    info = RolloutInfo(run="test", group_id=rollout["group_id"], rollout_id=rollout["rollout_id"], slot=0,
                       attempt=0, workdir=tmp_path, policy_version=0)
    ctx = AgentContext(info, base_urls=rollout["base_urls"], api_key=rollout["api_key"], model=MODEL,
                       max_turns=max_turns, max_tokens=max_tokens, sampling={"temperature": 1.0})

    async def episode() -> ToolAgentResult:
        try:
            return await agent(task, ctx)
        finally:
            await ctx.aclose()

    return asyncio.run(episode()), ctx, rollout


def samples(h: Harness, rollout_id: str) -> list[dict[str, Any]]:
    sql = "SELECT * FROM samples WHERE rollout_id = ? ORDER BY first_time"
    return h.store.query(sql, [rollout_id]).to_pylist()


def test_a_tool_call_runs_and_its_output_is_an_untrained_observation(proxy: Harness, tmp_path: Path) -> None:
    script(proxy, "Adding.\n" + call_text("add", a=2, b=40), "The sum is 42.")
    agent = tool_agent([add], system="Use tools.")
    result, ctx, rollout = play(proxy, agent, {"prompt": "2 + 40?"}, tmp_path)
    assert result.text == "The sum is 42." and result.turns == 2 and ctx.truncated is None
    assert result.tool_calls == [("add", '{"a": 2, "b": 40}', "42")]
    assert [m["role"] for m in result.messages] == ["system", "user", "assistant", "tool", "assistant"]
    call = result.messages[2]["tool_calls"][0]
    assert result.messages[2]["content"] == "Adding." and call["function"]["arguments"] == '{"a": 2, "b": 40}'
    assert result.messages[3] == {"role": "tool", "tool_call_id": call["id"], "content": "42"}

    # replayed exactly as returned, the episode is one segment whose only trainable tokens are the sampled ones
    (sample,) = samples(proxy, rollout["rollout_id"])
    tokens, mask = sample["tokens"], sample["loss_mask"]
    assert len(tokens) == len(mask) and sample["turns"] == 2
    tok = proxy.proxy.capture.renderer
    text = tok.decode(tokens)
    observation = "<tool_response>\n42\n</tool_response>"
    start = text.index(observation)
    stop = start + len(observation)
    ends = [len(tok.decode(tokens[:i + 1])) for i in range(len(tokens))]
    in_response = [i for i, end in enumerate(ends) if end > start and (ends[i - 1] if i else 0) < stop]
    assert in_response and all(not mask[i] for i in in_response)
    trained = tok.decode([t for t, m in zip(tokens, mask) if m])
    assert trained == "Adding.\n" + call_text("add", a=2, b=40) + "<|im_end|>The sum is 42.<|im_end|>"


def test_calls_beyond_the_parallel_limit_are_refused_and_the_rest_run_concurrently(proxy: Harness,
                                                                                    tmp_path: Path) -> None:
    arrived: list[str] = []
    both = asyncio.Event()

    async def meet(name: str) -> str:
        """Wait until two calls are running at once."""
        arrived.append(name)
        if len(arrived) == 2:
            both.set()
        await asyncio.wait_for(both.wait(), 60)  # only a sequential run would wait here
        return f"met {name}"

    script(proxy, "\n".join(call_text("meet", name=n) for n in "abc"), "Done.")
    result, _, _ = play(proxy, tool_agent([meet], max_parallel_calls=2), {"prompt": "Meet."}, tmp_path)
    assert arrived == ["a", "b"]
    outputs = [m["content"] for m in result.messages if m["role"] == "tool"]
    assert outputs[:2] == ["met a", "met b"]
    assert outputs[2].startswith("error: not run; at most 2 tool calls are run per reply")
    assert result.text == "Done."


def test_tool_errors_become_tool_results_the_model_reads(proxy: Harness, tmp_path: Path) -> None:
    script(proxy, "\n".join([call_text("fail", why="disk full"), call_text("nope"), call_text("add", a=1)]),
           "Sorry.")
    result, ctx, _ = play(proxy, tool_agent([add, fail]), {"prompt": "Try."}, tmp_path)
    assert [out for _, _, out in result.tool_calls] == [
        "error: RuntimeError: disk full",
        "error: unknown tool 'nope'; the available tools are: add, fail",
        "error: invalid arguments for 'add': 'b' is a required property"]
    assert result.text == "Sorry." and ctx.truncated is None


def test_the_turn_limit_truncates_a_model_that_keeps_calling_tools(proxy: Harness, tmp_path: Path) -> None:
    script(proxy, call_text("add", a=1, b=1), call_text("add", a=2, b=2), "never asked")
    result, ctx, _ = play(proxy, tool_agent([add]), {"prompt": "Loop."}, tmp_path, max_turns=2)
    assert result.turns == 2 and ctx.truncated == "max_turns"
    assert [out for _, _, out in result.tool_calls] == ["2", "4"]  # the last reply's call still ran
    assert result.messages[-1]["role"] == "tool"


def test_a_reply_cut_by_max_tokens_truncates_without_running_its_calls(proxy: Harness, tmp_path: Path) -> None:
    script(proxy, call_text("add", a=1, b=1), cut=True)
    result, ctx, _ = play(proxy, tool_agent([add]), {"prompt": "Cut."}, tmp_path)
    assert result.turns == 1 and ctx.truncated == "max_tokens" and result.tool_calls == []


def test_task_messages_and_system_prompt() -> None:
    assert initial_messages({"prompt": "Hi"}) == [{"role": "user", "content": "Hi"}]
    assert initial_messages({"prompt": "Hi", "system": "S"}, "default") == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    given = [{"role": "system", "content": "Own"}, {"role": "user", "content": "Hi"}]
    assert initial_messages({"messages": given}, "default") == given
    assert initial_messages({"messages": given[1:]}, "default")[0] == {"role": "system", "content": "default"}
    with pytest.raises(ValueError, match="neither 'prompt' nor 'messages'"):
        initial_messages({"id": "t1", "question": "?"})


def test_tools_are_checked_when_the_agent_is_made() -> None:
    def add(x: int) -> int:  # the same name as the module's add
        return x

    with pytest.raises(ToolSchemaError, match="two tools are named 'add'"):
        tool_agent([globals()["add"], add])
    with pytest.raises(ValueError, match="max_parallel_calls"):
        tool_agent([], max_parallel_calls=0)


def secret() -> str:
    """Read the episode's hidden state."""
    return current_task()["secret"]


def test_a_tool_reads_its_episodes_task_and_only_inside_an_episode(proxy: Harness, tmp_path: Path) -> None:
    script(proxy, call_text("secret"), "Done.")
    result, _, _ = play(proxy, tool_agent([secret]), {"prompt": "What is hidden?", "secret": "opal"}, tmp_path)
    assert result.tool_calls == [("secret", "{}", "opal")]
    with pytest.raises(CollectorError, match="tool_agent episode"):
        secret()
