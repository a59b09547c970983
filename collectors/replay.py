"""Replay: one stored rollout rebuilt as the model saw it, for `trajstore replay` and notebooks.

`load_episode(store, rollout_id, decode=...)` reads the rollout's turns, rewards and status
events and hands them to `build_episode`, a pure function: per segment (in the order they
began) and turn (by turn_index) it keeps the exact prompt-delta ids, sampled ids, behaviour
logprobs and trainable mask, splits the tokens into spans (prompt / tool-observation tokens,
sampled trainable tokens, sampled masked tokens), decodes them when given a `decode`
function (a tokenizer's; otherwise ids are all there is), and pulls tool calls and tool
results out of the stored request/response JSON: OpenAI chat (`tool_calls`, `tool`
messages), Anthropic messages (`tool_use`, `tool_result` blocks), or, failing those, the
`<tool_call>` JSON the model wrote (read by `collectors.model.replies` and
`collectors.model.toolcalls`). `Episode.as_json()` is the machine form.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from collectors.errors import CollectorError
from collectors.model.replies import response_calls
from collectors.model.toolcalls import ToolCall, parse_output
from trajstore import Snapshot, Store
from trajstore.requests import full_requests

Decode = Callable[[list[int]], str]
SpanKind = Literal["prompt", "sampled", "sampled_masked"]
_FIND_IDS = 'trajstore query --store {loc} "SELECT rollout_id, status, reward FROM rollouts ORDER BY started DESC"'


class RolloutNotFound(CollectorError):
    """No event of the store carries this rollout_id."""


@dataclass(frozen=True)
class Span:
    """Consecutive tokens of one kind: prompt/observation (never trained), sampled, sampled but masked."""

    kind: SpanKind
    ids: list[int]
    text: str | None  # None without a tokenizer
    logprobs: list[float] | None = None  # sampled spans only


@dataclass(frozen=True)
class ToolResult:
    content: str
    name: str | None = None
    call_id: str | None = None


@dataclass(frozen=True)
class ReplayTurn:
    turn_index: int
    policy_version: int
    finish_reason: str | None
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_mask: list[bool]  # resolved: a stored null means every sampled token is trainable
    spans: list[Span]
    tool_calls: list[ToolCall]
    tool_results: list[ToolResult]
    sampling: Any = None
    time: str | None = None
    meta: Any = None  # the capture proxy's: protocol, fork reason (template_drift, retry, history_rewrite), ...
    event_id: str | None = None
    request: Any = None  # what the agent sent, whole (a request stored as a delta is resolved: trajstore.requests)


@dataclass(frozen=True)
class ReplaySegment:
    segment_id: str
    session_id: str | None
    turns: list[ReplayTurn]
    reward: float | None = None  # segment-level reward components, summed


@dataclass(frozen=True)
class Episode:
    rollout_id: str
    run: str | None
    group_id: str | None
    status: str | None
    error: str | None
    rewards: dict[str, float]  # latest value of each rollout-level component
    segments: list[ReplaySegment]
    decoded: bool
    policy_versions: list[int] = field(default_factory=list)

    @property
    def reward(self) -> float | None:
        return sum(self.rewards.values()) if self.rewards else None

    def as_json(self) -> dict[str, Any]:
        """The episode as JSON values, less each turn's `request`: a 40-call session resending 80k tokens would
        carry megabytes of history the viewer and `replay --json` never show (`ReplayTurn.request` keeps it)."""
        out = {**asdict(self), "reward": self.reward}
        for segment in out["segments"]:
            for turn in segment["turns"]:
                del turn["request"]
        return out


def tokenizer_decode(model_dir: str | Path) -> Decode:
    """Decode with the checkpoint's tokenizer, special tokens kept: the template is part of what the model saw."""
    from transformers import AutoTokenizer  # heavy: loaded only when asked to decode

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return lambda ids: str(tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))


def load_episode(store: Store, rollout_id: str, *, decode: Decode | None = None,
                 version: int | None = None) -> Episode:
    """Read `rollout_id` from `store` (turns, rewards, statuses; at table `version`, latest by default)
    and build its `Episode`. Only the sealed files whose statistics can hold the rollout are read."""
    with store.snapshot(version) as snap:
        turns, others = episode_rows(snap, rollout_id)
    if not turns and not others:
        near = store.query("SELECT DISTINCT rollout_id FROM events WHERE starts_with(rollout_id, ?) ORDER BY 1 "
                           "LIMIT 5", [rollout_id[:4]], version=version).column("rollout_id").to_pylist()
        hint = f" Similar ids: {', '.join(near)}." if near else ""
        raise RolloutNotFound(f"no rollout {rollout_id!r} in the store at {store.location.uri}.{hint} List "
                              f"rollout ids with: {_FIND_IDS.format(loc=store.location.uri)}")
    return build_episode(rollout_id, turns, others, decode=decode)


def episode_rows(snap: Snapshot, rollout_id: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rollout's rows of the `turns` view and its reward and status events, oldest first; the
    snapshot is narrowed to the rollout's events (see `Snapshot.narrow`). Each turn's `request` is whole: one
    stored as a delta of an earlier turn's is resolved (every base lies in the rollout)."""
    snap.narrow("rollout_id", [rollout_id])
    turns = snap.query(
        "SELECT event_id, run, group_id, session_id, segment_id, turn_index, policy_version, prompt_ids, output_ids, "
        "output_logprobs, output_mask, finish_reason, sampling, request, response, meta, time::VARCHAR AS time, "
        "request_base, request_shared, request_kept FROM turns WHERE rollout_id = ? ORDER BY time, turn_index",
        [rollout_id]).to_pylist()
    if any(t["request_base"] is not None for t in turns):
        full = full_requests(turns)
        for t in turns:
            t["request"] = full[t["event_id"]]
    others = snap.query(
        "SELECT kind, run, group_id, reward, reward_name, segment_id, status, error, meta, time::VARCHAR AS time "
        "FROM events WHERE rollout_id = ? AND kind IN ('reward', 'status') ORDER BY time, writer, writer_seq",
        [rollout_id]).to_pylist()
    return turns, others


def build_episode(rollout_id: str, turns: Sequence[dict[str, Any]], others: Sequence[dict[str, Any]], *,
                  decode: Decode | None = None) -> Episode:
    """The pure part of `load_episode`: rows of the `turns` view and reward/status events, oldest first."""
    by_segment: dict[str, list[dict[str, Any]]] = {}
    for row in turns:  # oldest first, so segments keep the order they began in
        by_segment.setdefault(row["segment_id"], []).append(row)
    rewards: dict[str, float] = {}
    segment_rewards: dict[str, dict[str, float]] = {}
    status = error = None
    for ev in others:  # oldest first: the latest value of each component and the latest status win
        if ev["kind"] == "reward" and ev["segment_id"] is None:
            rewards[ev["reward_name"]] = ev["reward"]
        elif ev["kind"] == "reward":
            segment_rewards.setdefault(ev["segment_id"], {})[ev["reward_name"]] = ev["reward"]
        elif ev["kind"] == "status":
            status, error = ev["status"], ev["error"]
    segments = [ReplaySegment(segment_id=sid, session_id=rows[0]["session_id"],
                              turns=[_turn(r, decode) for r in sorted(rows, key=lambda r: r["turn_index"])],
                              reward=sum(segment_rewards[sid].values()) if sid in segment_rewards else None)
                for sid, rows in by_segment.items()]
    first = turns[0] if turns else (others[0] if others else {})
    versions = sorted({t.policy_version for s in segments for t in s.turns})
    return Episode(rollout_id=rollout_id, run=first.get("run"), group_id=first.get("group_id"), status=status,
                   error=error, rewards=rewards, segments=segments, decoded=decode is not None,
                   policy_versions=versions)


def _turn(row: dict[str, Any], decode: Decode | None) -> ReplayTurn:
    prompt, output = list(row["prompt_ids"] or []), list(row["output_ids"] or [])
    logprobs = [float(x) for x in row["output_logprobs"] or []]
    mask = list(row["output_mask"]) if row["output_mask"] is not None else [True] * len(output)
    request, response = _json(row["request"]), _json(row["response"])
    output_text = decode(output) if decode else None
    calls = response_calls(response)
    if not calls and output_text:
        calls = list(parse_output(output_text).tool_calls)
    return ReplayTurn(turn_index=row["turn_index"], policy_version=row["policy_version"],
                      finish_reason=row["finish_reason"], prompt_ids=prompt, output_ids=output,
                      output_logprobs=logprobs, output_mask=mask, spans=spans(prompt, output, logprobs, mask, decode),
                      tool_calls=calls, tool_results=tool_results(request), sampling=_json(row["sampling"]),
                      time=row.get("time"), meta=_json(row.get("meta")), event_id=row.get("event_id"), request=request)


def spans(prompt: list[int], output: list[int], logprobs: list[float], mask: list[bool],
          decode: Decode | None) -> list[Span]:
    """The prompt delta as one span, then the output cut wherever the trainable mask flips."""
    out = [Span("prompt", prompt, decode(prompt) if decode else None)] if prompt else []
    start = 0
    for i in range(1, len(output) + 1):
        if i == len(output) or mask[i] != mask[start]:
            ids = output[start:i]
            kind: SpanKind = "sampled" if mask[start] else "sampled_masked"
            out.append(Span(kind, ids, decode(ids) if decode else None, logprobs[start:i]))
            start = i
    return out


def _json(text: Any) -> Any:
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return json.dumps(content)


def tool_results(request: Any) -> list[ToolResult]:
    """Tool results the request added since the model last spoke: trailing OpenAI `tool` messages,
    or `tool_result` blocks of the last Anthropic user message."""
    messages = request.get("messages") if isinstance(request, dict) else None
    if not isinstance(messages, list):
        return []
    results: list[ToolResult] = []
    for message in reversed(messages):
        if not isinstance(message, dict) or message.get("role") == "assistant":
            break
        if message.get("role") == "tool":
            results.append(ToolResult(_text(message.get("content")), message.get("name"),
                                      message.get("tool_call_id")))
        elif isinstance(message.get("content"), list):
            results += [ToolResult(_text(b.get("content")), None, b.get("tool_use_id"))
                        for b in reversed(message["content"]) if isinstance(b, dict) and b.get("type") == "tool_result"]
    return results[::-1]


def token_rows(turn: ReplayTurn, decode: Decode | None) -> list[dict[str, Any]]:
    """One row per token of a turn, prompt delta first: id, text (each token decoded alone), kind, logprob."""
    rows: list[dict[str, Any]] = [{"id": t, "text": decode([t]) if decode else None, "kind": "prompt",
                                   "logprob": None} for t in turn.prompt_ids]
    rows += [{"id": t, "text": decode([t]) if decode else None, "kind": "sampled" if m else "sampled_masked",
              "logprob": lp} for t, lp, m in zip(turn.output_ids, turn.output_logprobs, turn.output_mask, strict=True)]
    return rows
