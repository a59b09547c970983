"""Claude Code, unmodified (`claude -p`, the npm package pinned in tests/collectors/proxy/claude_code/), through the
capture proxy: a multi-turn tool loop, every call stored as one turn of one segment.

The policy is `Scripted` (an honest fake upstream: it samples given texts as real token ids of the tiny
model's tokenizer, streamed token by token), because a random tiny model writes no tool calls; the CLI,
the proxy, the template, the segmentation and the store are all real. `make claude-code` installs the
CLI (`make test` does it first); the CLI's own traffic besides the model calls is switched off by its
environment variables, and its base URL is the rollout's, on loopback.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from collectors.model.toolcalls import render_call
from tests.collectors.proxy_harness import MODEL, Harness, Scripted, call, running_proxy
from trajstore.requests import resolve

CLI = Path(__file__).parent / "claude_code" / "node_modules" / ".bin" / "claude"
pytestmark = pytest.mark.skipif(not CLI.exists(), reason="the Claude Code CLI is not installed: run `make claude-code` "
                                                         "(make test installs it before running the tests)")
QUIET = {"DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
         "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_NON_ESSENTIAL_MODEL_CALLS": "1"}


def claude(h: Harness, rollout: dict[str, Any], workdir: Path, prompt: str, *tools: str) -> dict[str, Any]:
    env = {"PATH": os.environ["PATH"], "HOME": str(workdir / "home"), "ANTHROPIC_BASE_URL":
           rollout["base_urls"]["anthropic"], "ANTHROPIC_API_KEY": rollout["api_key"], **QUIET}
    done = subprocess.run([str(CLI), "-p", prompt, "--model", MODEL, "--output-format", "json", "--allowedTools",
                           ",".join(tools)], cwd=workdir, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(done.stdout)


def record_bodies(h: Harness) -> list[Any]:
    """The request bodies the proxy is sent, in order, as parsed JSON (a copy of each, taken as it arrives)."""
    sent: list[Any] = []
    capture = h.proxy.capture
    streamed = capture.stream_turn

    def stream_turn(rollout: Any, session: str, req: Any, body: Any, wire: Any) -> Any:
        sent.append(json.loads(json.dumps(body)))
        return streamed(rollout, session, req, body, wire)

    capture.stream_turn = stream_turn  # type: ignore[method-assign]
    return sent


def test_claude_code_runs_a_tool_loop_stored_as_one_segment(tiny_model: Path, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    target = work / "notes.txt"
    upstream = Scripted(AutoTokenizer.from_pretrained(tiny_model))
    upstream.replies[:] = [
        "I will write the notes first.\n" + render_call("Write", {"file_path": str(target), "content": "alpha\n"}),
        "<think>\nNow check it.\n</think>\n\n" + render_call("Read", {"file_path": str(target)}),
        "The notes say alpha.",
    ]
    # Claude Code's system prompt and two dozen tools are ~20k tokens of the tiny tokenizer: the scripted
    # upstream has no context limit, so the proxy is told a large one
    with running_proxy(upstream, tmp_path / "store", tiny_model, max_model_len=500_000) as h:
        rollout = h.open(group_id="claude-code")
        bodies = record_bodies(h)
        result = claude(h, rollout, work, "Write alpha into notes.txt, then read it back.", "Write", "Read")
        assert result["result"] == "The notes say alpha." and result["num_turns"] == 3 and not result["is_error"]
        assert target.read_text() == "alpha\n"
        turns = h.turns(rollout["rollout_id"])
        metas = [json.loads(t["meta"]) for t in turns]
        assert len(turns) == len(upstream.sent) == 3 and len({t["segment_id"] for t in turns}) == 1
        assert [t["turn_index"] for t in turns] == [0, 1, 2] and [m["fork"] for m in metas] == [None] * 3
        assert [m["history"] for m in metas] == ["first", "exact", "exact"]
        assert all(m["protocol"] == "anthropic" and m["stream"] for m in metas)
        assert [t["finish_reason"] for t in turns] == ["tool_calls", "tool_calls", "stop"]
        held: list[int] = []
        for sent, t in zip(upstream.sent, turns, strict=True):  # each call extends the tokens the session holds
            assert sent == held + t["prompt_ids"]
            held = sent + t["output_ids"]
        request = json.loads(turns[0]["request"])
        assert request["max_tokens"] == 32000 and len(request["tools"]) >= 5
        # Claude Code moves its cache breakpoint to its newest message: a call shares all but the last item of the
        # one before; its ~40 kB of system prompt and tools are stored once, and every request resolves whole
        assert [t["request_base"] for t in turns] == [None, turns[0]["event_id"], turns[1]["event_id"]]
        assert [t["request_shared"] for t in turns[1:]] == [len(b["messages"]) - 1 for b in bodies[:2]]
        assert all({"system", "tools"} <= set(t["request_kept"]) for t in turns[1:])
        # (its first call sends a system message as a list of blocks, the later ones as text: the 2nd call stores it)
        assert len(turns[1]["request"]) < len(turns[0]["request"]) / 4
        assert len(turns[2]["request"]) < len(turns[0]["request"]) / 20
        full = resolve(h.store, [t["event_id"] for t in turns])
        assert [json.loads(full[t["event_id"]]) for t in turns] == bodies
        assert any(m.get("role") == "system" for m in request["messages"])  # what used to be refused
        prompt = h.proxy.capture.renderer.decode(turns[1]["prompt_ids"])
        assert prompt.startswith("\n<|im_start|>user\n<tool_response>\nFile created successfully at: " + str(target))
        assert prompt.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")  # the delta: the result only
        stats = call(h.url + "/stats").body
        assert stats["turns"] == 3 and stats["stream_disconnects"] == 0 and stats["errors"] == {}
        assert h.close(rollout).status == 200
