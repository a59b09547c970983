"""The capture proxy's core: one agent call -> one policy sample -> one durable `turn` event.

`Capture.turn` runs a call through, holding its session's lock:

1. render the conversation with the chat template (`collectors.proxy.render`);
2. decide the segment (`collectors.proxy.segmenter`): continue it with the prompt delta, or fork;
3. sample from the upstream policy server with the full token ids (`PolicyClient.complete`);
4. decode and parse the reply, build the protocol response;
5. append the turn event (exact prompt delta, sampled ids, logprobs, policy version) and wait
   until it is durable; only then advance the session and answer the agent. Concurrent
   calls' events share one append (`collectors.proxy.appender`).

A failure at any step leaves the session as it was and writes nothing: no partial event.
`max_tokens` above the room left in the context is lowered to that room (finish `length`
says so); a prompt that leaves no room at all is refused. A long prompt is tokenized on a
worker thread, so the event loop keeps serving others. Rollout open and close write
`status` (and `reward`) events; a rollout id the caller chooses is refused when the store
already holds it (opened by another proxy, or by this one before a restart): a rollout is
opened once, so nobody can overwrite another's reward or status.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from collectors.errors import CollectorError
from collectors.policy import PolicyClient, Sample
from collectors.proxy.appender import BatchAppender
from collectors.proxy.chat import ChatError, ChatReply, ChatRequest
from collectors.proxy.render import ChatRenderer, text_ids
from collectors.proxy.segmenter import plan_turn, record_turn
from collectors.proxy.sessions import Registry, Rollout
from collectors.proxy.wire import WireProtocol
from trajstore import InvalidEventError, Reward, Status, Turn, Writer, new_id
from trajstore.schema import TERMINAL_STATUSES

log = logging.getLogger(__name__)
TOKENIZE_OFF_LOOP_CHARS = 64 << 10


@dataclass
class ProxyStats:
    """Counters served at GET /stats; forks by reason reveal template drift and history rewrites."""

    requests: int = 0
    turns: int = 0
    streamed: int = 0
    forks: Counter[str] = field(default_factory=Counter)
    retokenize_mismatches: int = 0  # outputs whose text re-tokenizes to other ids (spliced, so no fork)
    upstream_failures: int = 0
    errors: Counter[int] = field(default_factory=Counter)
    rollouts_opened: int = 0
    rollouts_closed: int = 0

    def as_json(self, open_rollouts: int) -> dict[str, Any]:
        return {"requests": self.requests, "turns": self.turns, "streamed": self.streamed,
                "forks": {"total": sum(self.forks.values()), **self.forks},
                "retokenize_mismatches": self.retokenize_mismatches, "upstream_failures": self.upstream_failures,
                "errors": {str(k): v for k, v in sorted(self.errors.items())},
                "rollouts": {"open": open_rollouts, "opened": self.rollouts_opened, "closed": self.rollouts_closed}}


def _hex_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


class Capture:
    """Shared state of a proxy: upstream client, renderer, store writer, rollouts, counters."""

    def __init__(self, client: PolicyClient, renderer: ChatRenderer, writer: Writer, *, run: str,
                 max_model_len: int, default_max_tokens: int,
                 stored: Callable[[str], bool] = lambda rollout_id: False) -> None:
        self.client, self.renderer, self.writer, self.stored = client, renderer, writer, stored
        self.run, self.max_model_len, self.default_max_tokens = run, max_model_len, default_max_tokens
        self.registry = Registry()
        self.stats = ProxyStats()
        self._appender = BatchAppender(writer.append)  # concurrent turns share one append and its fsync

    async def _append(self, events: list[Any]) -> None:
        try:
            await self._appender.append(events)
        except InvalidEventError as exc:  # values the request carried that the store cannot take
            raise ChatError(f"nothing was recorded: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - the agent must hear why nothing was recorded
            log.exception("appending %d event(s) failed", len(events))
            raise ChatError(f"the trajectory store refused the event(s): {type(exc).__name__}: {exc}; nothing was "
                            "recorded, retry the call", status=500, kind="internal") from exc

    def _max_tokens(self, req: ChatRequest, prompt_len: int) -> int:
        room = self.max_model_len - prompt_len
        if room < 1:
            raise ChatError(f"the prompt is {prompt_len} tokens but the model's context holds {self.max_model_len}: "
                            "shorten or compact the conversation", param="messages")
        return min(req.max_tokens or self.default_max_tokens, room)

    async def _sample(self, ids: list[int], req: ChatRequest, max_tokens: int, session_id: str) -> Sample:
        try:
            sample = await self.client.complete(ids, req.sampling_for(max_tokens), session_id=session_id)
        except Exception as exc:  # noqa: BLE001 - any upstream failure becomes a 502 that names it
            self.stats.upstream_failures += 1
            reason = str(exc) if isinstance(exc, CollectorError) else (
                f"the policy server at {self.client.base_url} failed: {type(exc).__name__}: {exc}")
            raise ChatError(reason, status=502, kind="upstream") from exc
        if sample.finish_reason == "abort":  # ids, logprobs and the echoed prompt are checked by the client
            self.stats.upstream_failures += 1
            raise ChatError(f"the policy server at {self.client.base_url} aborted the request (shutting down?)",
                            status=502, kind="upstream")
        return sample

    async def turn(self, rollout: Rollout, session: str, req: ChatRequest, body: Any,
                   wire: WireProtocol) -> tuple[ChatReply, dict[str, Any]]:
        """Serve one call of `rollout`'s `session` and store it (see the module docstring).

        Returns the reply and its response body in `wire`'s protocol (as stored)."""
        slot = rollout.session(session)
        async with slot.lock:
            if rollout.closed:
                raise ChatError(f"rollout {rollout.rollout_id} was closed while this call waited", status=401,
                                kind="authentication")
            renderer, state = self.renderer, slot.state
            prompt_text = renderer.prompt_text(req)
            if len(prompt_text) > TOKENIZE_OFF_LOOP_CHARS:  # tokenizing megabytes would stall every other call
                plan = await asyncio.to_thread(plan_turn, state, prompt_text, renderer.encode, new_id)
            else:
                plan = plan_turn(state, prompt_text, renderer.encode, new_id)
            max_tokens = self._max_tokens(req, len(plan.full_ids))
            if req.max_tokens == 0:  # Anthropic's cache warm-up: nothing to sample, so nothing to store
                empty = ChatReply(_hex_id(wire.reply_prefix), req.model or "", int(time.time()), "", None, (),
                                  "length", None, len(plan.full_ids), [], [], [], -1, {"rollout_id": rollout.rollout_id})
                return empty, wire.response(empty)
            sample = await self._sample(plan.full_ids, req, max_tokens, f"{rollout.rollout_id}/{session}")
            info = {"rollout_id": rollout.rollout_id, "session_id": session, "segment_id": plan.segment_id,
                    "turn_index": plan.turn_index, "policy_version": sample.policy_version, "fork": plan.fork}
            body_ids = text_ids(sample)  # the output, less the stop token that ended it
            body_text = renderer.decode(body_ids)  # decoded once: the reply, the drift check and the stats read it
            sampled_text = body_text + renderer.decode(sample.output_ids[len(body_ids):])
            reply = renderer.reply(sample, req, body_text, prompt_tokens=len(plan.full_ids), model=req.model or "",
                                   reply_id=_hex_id(wire.reply_prefix), call_id=lambda: _hex_id(wire.call_prefix),
                                   created=int(time.time()), trajstore=info)
            retokenizes = renderer.encode(body_text) == body_ids
            meta = {"protocol": wire.name, "stream": req.stream, "fork": plan.fork,
                    "previous_segment": plan.previous_segment,
                    "output_retokenizes": retokenizes, "forks_in_session": sum(state.forks.values())
                    + (plan.fork is not None)}
            sampling = {**req.sampling_for(max_tokens).as_json(), "requested_max_tokens": req.max_tokens}
            response = wire.response(reply)
            await self._append([Turn(
                run=rollout.run, group_id=rollout.group_id, rollout_id=rollout.rollout_id, session_id=session,
                segment_id=plan.segment_id, turn_index=plan.turn_index, policy_version=sample.policy_version,
                prompt_ids=plan.prompt_ids, output_ids=list(sample.output_ids),
                output_logprobs=list(sample.output_logprobs), finish_reason=reply.finish, sampling=sampling,
                request=body, response=response, meta=meta)])
            record_turn(state, plan, prompt_text, sample.output_ids, sampled_text)
            rollout.tally.add(session, reply.finish, len(sample.output_ids), sample.policy_version)
            rollout.raw_arguments.update((c.id, c.arguments) for c in reply.tool_calls)
        self._count(rollout, session, plan.fork, plan.previous_segment, plan.segment_id, retokenizes, req.stream)
        return reply, response

    def _count(self, rollout: Rollout, session: str, fork: str | None, previous: str | None, segment: str,
               retokenizes: bool, streamed: bool) -> None:
        stats = self.stats
        stats.turns += 1
        stats.streamed += streamed
        stats.retokenize_mismatches += not retokenizes
        if fork is not None:
            stats.forks[fork] += 1
            log.info("fork (%s) in rollout %s session %s: segment %s starts whole after %s", fork,
                     rollout.rollout_id, session, segment, previous)

    async def open_rollout(self, *, run: str | None, group_id: str | None, rollout_id: str | None,
                           group_size: int | None, meta: dict[str, Any] | None) -> Rollout:
        if rollout_id is not None and rollout_id not in self.registry.by_id and \
                await asyncio.to_thread(self.stored, rollout_id):
            raise ChatError(f"rollout {rollout_id!r} is already in the store (opened by another proxy, or by this one "
                            "before a restart); a rollout is opened once: leave rollout_id out to get a fresh one",
                            status=409, kind="conflict", param="rollout_id")
        rollout_id = rollout_id or new_id()
        rollout = self.registry.open(run=run or self.run, group_id=group_id or rollout_id, rollout_id=rollout_id,
                                     group_size=group_size, meta=meta)
        try:
            await self._append([Status(run=rollout.run, group_id=rollout.group_id, rollout_id=rollout_id,
                                       status="started", group_size=group_size, meta=meta)])
        except ChatError:
            del self.registry.by_id[rollout_id], self.registry.by_key[rollout.key]
            raise
        self.stats.rollouts_opened += 1
        return rollout

    async def close_rollout(self, rollout: Rollout, *, status: str, rewards: dict[str, float],
                            error: str | None, meta: dict[str, Any] | None = None) -> dict[str, Any]:
        if status not in TERMINAL_STATUSES:
            raise ChatError(f"`status` must be one of {', '.join(sorted(TERMINAL_STATUSES))}, got {status!r}",
                            param="status")
        rollout.closed = True  # new calls are refused from here on; wait for the ones in flight
        for slot in list(rollout.sessions.values()):
            async with slot.lock:
                pass
        run, group_id, rollout_id = rollout.run, rollout.group_id, rollout.rollout_id
        events: list[Any] = [Reward(run=run, group_id=group_id, rollout_id=rollout_id, reward=value, reward_name=name)
                             for name, value in rewards.items()]
        events.append(Status(run=run, group_id=group_id, rollout_id=rollout_id, status=status, error=error,
                             group_size=rollout.group_size, meta=meta))
        try:
            await self._append(events)
        except ChatError:
            rollout.closed = False
            raise
        rollout.status = status
        for slot in rollout.sessions.values():
            slot.state.held = None  # keep the counts, free the tokens
        rollout.raw_arguments.clear()
        self.stats.rollouts_closed += 1
        return rollout.summary()
