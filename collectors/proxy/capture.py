"""The capture proxy's core: one agent call -> one policy sample -> one durable `turn` event.

`Capture.turn` (and `Capture.stream_turn`, which answers while the upstream samples) runs a
call through, holding its session's lock:

1. reconcile the agent's history with what the session sampled (`collectors.proxy.reconcile`)
   and render it with the chat template (`collectors.proxy.render`);
2. decide the segment (`collectors.proxy.segmenter`): continue it with the prompt delta, or fork;
3. sample from the upstream policy server with the full token ids (`PolicyClient.complete`, or
   `PolicyClient.stream` for a streamed call, whose pieces reach the agent as they are sampled,
   see `collectors.proxy.streaming`); a call waits out an outage of the server, and closing its
   rollout cancels it (`collectors.proxy.upstream`);
4. decode and parse the reply, build the protocol response;
5. append the turn event (exact prompt delta, sampled ids, logprobs, policy version, the request as
   sent, or as a delta of the session's previous call's: `collectors.proxy.request_delta`) and wait
   until it is durable; only then advance the session and answer the agent (a stream's last
   event is sent after the append). Concurrent calls' events share one append, written by a
   commit thread off the event loop (`collectors.proxy.appender`).

A failure at any step leaves the session as it was and writes nothing: no partial event. A
streamed call whose agent disconnects mid-stream closes the upstream stream (the policy server
stops sampling it) and stores nothing: the agent never received that reply, so no later call
of its can extend it; it is counted in /stats (`stream_disconnects`). An upstream failure
before the first token is an HTTP error; after it, the protocol's error event ends the stream.
`max_tokens` above the room left in the context is lowered to that room (finish `length`
says so); a prompt that leaves no room at all is refused.

The costliest work a request asks for (reconciling its history, rendering it with the chat
template, tokenizing it; `count_tokens` alike) runs on the proxy's render threads, never on
the event loop: a call carrying megabytes of conversation takes seconds there while every other
rollout, and /health, is answered meanwhile. A rollout runs at most
`collectors.proxy.sessions.RENDERS_PER_ROLLOUT` of these at once, whatever number of sessions
it opens, so one rollout cannot take every render thread; and a request whose text alone is
more tokens than the context holds is refused by its size before anything is rendered
(`ChatRenderer.check_fits`). A call over `HEAVY_BODY_BYTES` is rendered on threads of its own
at a lower CPU priority (`collectors.proxy.priority`): on busy cores the other sessions' work
goes first. What grows with a call's size after the sample (recording a turn of more than
`LONG_TURN_IDS` prompt ids into its session) runs on a render thread too. Rollout open and close write
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
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from collectors.errors import CollectorError
from collectors.policy import Chunk, PolicyClient, Sample, StreamedSample
from collectors.policy.token_ids import SLICE, TokenIds
from collectors.proxy.appender import INLINE_BODY_BYTES, BatchAppender
from collectors.proxy.chat import ChatError, ChatReply, ChatRequest, Message
from collectors.proxy.extend import Extender
from collectors.proxy.priority import heavy_pool
from collectors.proxy.reconcile import Answered, reconcile, reply_message
from collectors.proxy.render import ChatRenderer, text_ids
from collectors.proxy.request_delta import stored_request
from collectors.proxy.segmenter import Prompt, SessionState, TurnPlan, plan_turn, record_turn
from collectors.proxy.sessions import Registry, Rollout, SessionSlot
from collectors.proxy.streaming import LocalPieces
from collectors.proxy.upstream import OUTAGE_WAIT_S, Upstream
from collectors.proxy.waits import WaitHistogram
from collectors.proxy.wire import WireProtocol, stream_body
from trajstore import InvalidEventError, Reward, Status, Turn, Writer, new_id, routes
from trajstore.schema import TERMINAL_STATUSES

log = logging.getLogger(__name__)
RENDER_THREADS = 4  # prompts rendered at once; more wait their turn, off the event loop
INLINE_RETOKENIZE_CHARS = 4096  # a reply up to this long is tokenized again on the event loop (~0.3 ms at most)
HEAVY_BODY_BYTES = 1 << 20  # a call this large is rendered on threads of a lower CPU priority (`priority`)
LONG_TURN_IDS = SLICE  # a turn whose prompt holds more ids is recorded into its session off the event loop
T = TypeVar("T")


def stored_prompt_ids(plan: TurnPlan) -> Sequence[int]:
    """A turn's `prompt_ids` as the store takes them: a continued segment's delta as the little-endian int32 bytes
    it was packed into for the policy server (or is packed into here, once: `record_turn` grows the session's packed
    form by them), read by numpy, so the store checks and converts it in bulk instead of id by id."""
    full = plan.full_ids
    if isinstance(full, TokenIds) and full.tail is plan.prompt_ids and plan.prompt_ids:
        return np.frombuffer(full.tail_int32(), dtype="<i4")
    return plan.prompt_ids


def sample_routes(sample: Sample, stored_prompt: int) -> dict[str, Any]:
    """The turn's `routed_experts` columns from a sample's routes (none for a dense model): the rows of its last
    `stored_prompt` prompt tokens (the turn's `prompt_ids`) and of its output, as `trajstore.routes` aligns them."""
    if sample.routed_experts is None:
        return {}
    try:
        rows = routes.turn_rows(sample.routed_experts, len(sample.prompt_ids), len(sample.output_ids), stored_prompt)
    except ValueError as exc:  # a streamed sample's routes are checked only here, against its final length
        raise ChatError(f"the policy server's routed_experts do not fit the call: {exc}", status=502,
                        kind="upstream") from exc
    return routes.turn_columns(rows)


@dataclass
class ProxyStats:
    """Counters served at GET /stats; forks by reason reveal template drift and history rewrites."""

    requests: int = 0
    turns: int = 0
    streamed: int = 0
    stream_disconnects: int = 0  # streams whose agent left before the end (nothing stored)
    forks: Counter[str] = field(default_factory=Counter)
    history: Counter[str] = field(default_factory=Counter)  # how each turn's history was reconciled
    retokenize_mismatches: int = 0  # outputs whose text re-tokenizes to other ids (spliced, so no fork)
    upstream_failures: int = 0
    errors: Counter[int] = field(default_factory=Counter)
    rollouts_opened: int = 0
    rollouts_closed: int = 0
    upstream: Upstream | None = None  # its outage and cancellation counters
    prefix: Any = None  # the policy client's `prefix_stats`, where it has them (`EmbeddedClient`)
    durable_wait: WaitHistogram = field(default_factory=WaitHistogram)  # per turn: handed to the commit -> durable
    bodies: Counter[str] = field(default_factory=Counter)  # request bodies decoded onto the session's last, or whole

    def as_json(self, open_rollouts: int) -> dict[str, Any]:
        return {"requests": self.requests, "turns": self.turns, "streamed": self.streamed,
                "stream_disconnects": self.stream_disconnects,
                "forks": {"total": sum(self.forks.values()), **self.forks}, "history": dict(self.history),
                "retokenize_mismatches": self.retokenize_mismatches, "upstream_failures": self.upstream_failures,
                "errors": {str(k): v for k, v in sorted(self.errors.items())},
                "upstream": self.upstream.as_json() if self.upstream is not None else {},
                **({"prompt_prefix": self.prefix.as_json()} if self.prefix is not None else {}),
                "durable_wait": self.durable_wait.as_json(),
                "bodies": {"spliced": self.bodies["spliced"], "whole": self.bodies["whole"]},
                "rollouts": {"open": open_rollouts, "opened": self.rollouts_opened, "closed": self.rollouts_closed}}


def _hex_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


@dataclass(frozen=True)
class Step:
    """What a streamed call has to send after a chunk from the upstream: pieces, token logprobs, or the end."""

    version: int
    pieces: list[Any]  # collectors.proxy.streaming events
    tokens: tuple[list[str], list[float], list[dict[str, float]] | None] | None  # texts, logprobs, top, when asked
    final: ChatReply | None = None  # the stored reply: the stream ends with it


@dataclass
class Prepared:
    """A call ready to sample: its reconciled, rendered prompt and its place in the session."""

    rollout: Rollout
    session: str
    slot: SessionSlot
    req: ChatRequest
    wire: WireProtocol
    messages: list[Message]  # what was rendered (reconciled)
    history: str  # how: first | exact | reserialized | rewritten
    prompt_text: Prompt  # whole, or the session's held prompt and what is new (`collectors.proxy.segmenter`)
    plan: TurnPlan
    max_tokens: int
    reply_id: str
    created: int  # the reply's time stamp, streamed and stored alike

    def head(self, policy_version: int) -> ChatReply:
        """The reply before anything is sampled (what a stream starts with)."""
        return ChatReply(self.reply_id, self.req.model or "", self.created, "", None, (), "", None,
                         len(self.plan.full_ids), [], [], [], policy_version, self.info(policy_version))

    def info(self, policy_version: int) -> dict[str, Any]:
        return {"rollout_id": self.rollout.rollout_id, "session_id": self.session, "segment_id": self.plan.segment_id,
                "turn_index": self.plan.turn_index, "policy_version": policy_version, "fork": self.plan.fork}


class Capture:
    """Shared state of a proxy: upstream client, renderer, store writer, rollouts, counters."""

    def __init__(self, client: PolicyClient, renderer: ChatRenderer, writer: Writer, *, run: str,
                 max_model_len: int, default_max_tokens: int,
                 stored: Callable[[str], bool] = lambda rollout_id: False,
                 upstream_wait_s: float = OUTAGE_WAIT_S, whole_requests: bool = False) -> None:
        self.client, self.renderer, self.writer, self.stored = client, renderer, writer, stored
        self.whole_requests = whole_requests  # store every request whole, never as a delta (`request_delta`)
        self.run, self.max_model_len, self.default_max_tokens = run, max_model_len, default_max_tokens
        self.registry = Registry()
        self.upstream = Upstream(client.base_url, upstream_wait_s)  # outages waited out, calls cancelled on close
        self.stats = ProxyStats(upstream=self.upstream, prefix=getattr(client, "prefix_stats", None))
        self._appender = BatchAppender(writer.append, writer.stage)  # concurrent turns share one append and its fsync
        self._render_pool = ThreadPoolExecutor(RENDER_THREADS, thread_name_prefix="proxy-render")
        self._heavy_pool = heavy_pool("proxy-heavy")  # huge calls' renders, at a lower CPU priority
        self._extender = Extender(renderer)  # a call that extends its session's last renders only what is new

    def close(self) -> None:
        """Stop the render and commit threads (the app's cleanup; calls in flight have finished by then)."""
        self._render_pool.shutdown(wait=False, cancel_futures=True)
        self._heavy_pool.shutdown(wait=False, cancel_futures=True)
        self.renderer.close()
        self._appender.close()

    async def _rendered(self, rollout: Rollout, state: SessionState, req: ChatRequest, body: Any = None
                        ) -> tuple[list[Message], str, Prompt, TurnPlan]:
        """`req` (sent as `body`) reconciled with `state`, rendered and planned: on a render thread (see the
        module docstring)."""
        self.renderer.check_fits(req, self.max_model_len)
        heavy = req.body_bytes is not None and req.body_bytes > HEAVY_BODY_BYTES
        async with rollout.renders:
            return await asyncio.get_running_loop().run_in_executor(
                self._heavy_pool if heavy else self._render_pool, self._render, state, req)

    def _render(self, state: SessionState, req: ChatRequest) -> tuple[list[Message], str, Prompt, TurnPlan]:
        messages, history = reconcile(req.messages, state.answered)
        last_prompt = state.held.prompt if state.held is not None else None
        prompt_text = self._extender.prompt_text(req, messages, history, state.answered, last_prompt)
        return messages, history, prompt_text, plan_turn(state, prompt_text, self.renderer.encode, new_id)

    async def _sized(self, large: bool, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`: at once when not `large` (a hop to a thread costs more than the work), else on a render
        thread, off the event loop (work that grows with a call's size: see the module docstring)."""
        if not large:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._render_pool, fn, *args)

    async def _append(self, events: list[Any], *, small: bool = True) -> float:
        """Append `events` and wait until they are durable; returns the seconds waited for the commit. `small`:
        see `BatchAppender.append`."""
        try:
            return await self._appender.append(events, small=small)
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

    async def _prepare(self, rollout: Rollout, session: str, slot: SessionSlot, req: ChatRequest,
                       wire: WireProtocol, body: Any) -> Prepared:
        if rollout.closed:
            raise ChatError(f"rollout {rollout.rollout_id} was closed while this call waited", status=401,
                            kind="authentication")
        messages, history, prompt_text, plan = await self._rendered(rollout, slot.state, req, body)
        return Prepared(rollout, session, slot, req, wire, messages, history, prompt_text, plan,
                        self._max_tokens(req, len(plan.full_ids)), _hex_id(wire.reply_prefix), int(time.time()))

    def _failed(self, exc: Exception) -> ChatError:
        self.stats.upstream_failures += 1
        if isinstance(exc, ChatError):
            return exc
        reason = str(exc) if isinstance(exc, CollectorError) else (
            f"the policy server at {self.client.base_url} failed: {type(exc).__name__}: {exc}")
        return ChatError(reason, status=502, kind="upstream")

    def _aborted(self) -> ChatError:
        return ChatError(f"the policy server at {self.client.base_url} aborted the request (shutting down?)",
                         status=502, kind="upstream")

    async def _reply(self, prep: Prepared, sample: Sample, pieces: Any = None) -> tuple[ChatReply, dict[str, Any], str]:
        """The parsed reply, its response body (as stored), and the text it was parsed from (`pieces`: what a
        stream sent, from `_pieces`)."""
        renderer, req = self.renderer, prep.req
        body_ids = text_ids(sample)  # the output, less the stop token that ended it
        body_text = renderer.decode(body_ids)  # decoded once: the reply, the drift check and the stats read it
        reply = renderer.reply(sample, req, body_text, prompt_tokens=len(prep.plan.full_ids), model=req.model or "",
                               reply_id=prep.reply_id, call_id=lambda: _hex_id(prep.wire.call_prefix),
                               created=prep.created, trajstore=prep.info(sample.policy_version))
        return reply, prep.wire.response(reply, req.options), body_text

    async def _store(self, prep: Prepared, sample: Sample, reply: ChatReply, response: dict[str, Any],
                     body_text: str, body: Any) -> None:
        """Append the turn and wait until it is durable; then advance the session."""
        renderer, req, plan, state = self.renderer, prep.req, prep.plan, prep.slot.state
        body_ids = text_ids(sample)
        # the reply's text tokenized again (turn meta `output_retokenizes`)
        retokenizes = await self._sized(len(body_text) > INLINE_RETOKENIZE_CHARS, renderer.encode, body_text
                                        ) == body_ids
        meta = {"protocol": prep.wire.name, "stream": req.stream, "fork": plan.fork, "history": prep.history,
                "previous_segment": plan.previous_segment, "output_retokenizes": retokenizes,
                "forks_in_session": sum(state.forks.values()) + (plan.fork is not None)}
        sampling = {**req.sampling_for(prep.max_tokens).as_json(), "requested_max_tokens": req.max_tokens}
        rollout, event_id = prep.rollout, new_id()
        stored = stored_request(body, req, prep.wire.name, prep.wire.conversation, event_id, prep.slot.last_request,
                                whole=self.whole_requests)
        waited = await self._append([Turn(
            event_id=event_id, run=rollout.run, group_id=rollout.group_id, rollout_id=rollout.rollout_id,
            session_id=prep.session,
            segment_id=plan.segment_id, turn_index=plan.turn_index, policy_version=sample.policy_version,
            prompt_ids=stored_prompt_ids(plan), output_ids=list(sample.output_ids),
            output_logprobs=list(sample.output_logprobs), finish_reason=reply.finish, sampling=sampling,
            **stored.columns(), response=response, meta=meta,
            support_sizes=sample.support_sizes, support_ids=sample.support_ids, output_version_starts=sample.version_starts,
            output_version_values=sample.version_values, **sample_routes(sample, len(plan.prompt_ids)))],
            small=req.body_bytes is not None and req.body_bytes <= INLINE_BODY_BYTES)
        self.stats.durable_wait.observe(waited)
        prep.slot.last_request = stored.last
        sampled_text = body_text + renderer.decode(sample.output_ids[len(body_ids):])
        await self._sized(len(plan.prompt_ids) > LONG_TURN_IDS, record_turn, state, plan, prep.prompt_text,
                          sample.output_ids, sampled_text)  # copies and encodes the prompt ids: a long one off the loop
        prefill = (req.messages[-1].get("content") or "") if req.continue_final else ""
        answered = reply_message(prefill + reply.content, reply.reasoning, [(c.name, c.arguments)
                                                                           for c in reply.tool_calls])
        state.answered = Answered(
            messages=req.messages, prompt_messages=prep.messages, continue_final=req.continue_final, tools=req.tools,
            reply=answered, sampled=renderer.sampled_message(prefill + body_text, answered))
        rollout.tally.add(prep.session, reply.finish, len(sample.output_ids), sample.policy_version)
        stats = self.stats
        stats.turns += 1
        stats.streamed += req.stream
        stats.retokenize_mismatches += not retokenizes
        stats.history[prep.history] += 1
        if plan.fork is not None:
            stats.forks[plan.fork] += 1
            log.info("fork (%s) in rollout %s session %s: segment %s starts whole after %s", plan.fork,
                     rollout.rollout_id, prep.session, plan.segment_id, plan.previous_segment)

    def _empty(self, prep: Prepared) -> ChatReply:
        """Anthropic's cache warm-up (max_tokens 0): nothing to sample, so nothing to store."""
        return ChatReply(prep.reply_id, prep.req.model or "", prep.created, "", None, (), "length", None,
                         len(prep.plan.full_ids), [], [], [], -1, {"rollout_id": prep.rollout.rollout_id})

    async def turn(self, rollout: Rollout, session: str, req: ChatRequest, body: Any,
                   wire: WireProtocol) -> tuple[ChatReply, dict[str, Any]]:
        """Serve one call of `rollout`'s `session` and store it (see the module docstring).

        Returns the reply and its response body in `wire`'s protocol (as stored)."""
        slot = rollout.session(session)
        async with slot.lock:
            prep = await self._prepare(rollout, session, slot, req, wire, body)
            if req.max_tokens == 0:
                empty = self._empty(prep)
                return empty, wire.response(empty, req.options)
            try:
                async with self.upstream.cancellable(rollout.rollout_id):
                    sample = await self.upstream.call(lambda: self._complete(prep))
            except Exception as exc:  # noqa: BLE001 - any upstream failure becomes a 502 that names it
                raise self._failed(exc) from exc
            if sample.finish_reason == "abort":  # ids, logprobs and the echoed prompt are checked by the client
                raise self._failed(self._aborted())
            reply, response, body_text = await self._reply(prep, sample)
            await self._store(prep, sample, reply, response, body_text, body)
        return reply, response

    def _complete(self, prep: Prepared) -> Awaitable[Sample]:
        """The upstream sample of a call (a hook: `collectors.proxy.vllm_render` sends more)."""
        return self.client.complete(prep.plan.full_ids, prep.req.sampling_for(prep.max_tokens),
                                    session_id=f"{prep.rollout.rollout_id}/{prep.session}")

    def _stream_upstream(self, prep: Prepared) -> AsyncIterator[Chunk]:
        """The upstream stream of a call (a hook, as `_complete`)."""
        return self.client.stream(prep.plan.full_ids, prep.req.sampling_for(prep.max_tokens),
                                  session_id=f"{prep.rollout.rollout_id}/{prep.session}")

    def _pieces(self, prep: Prepared) -> Any:
        """What turns a stream's chunks into the reply's pieces as they are sampled: `await feed(chunk)` ->
        events, `await finish(reply)` -> the rest (a hook: `collectors.proxy.vllm_render` asks vLLM)."""
        return LocalPieces(self.renderer, prep.req)

    async def stream_turn(self, rollout: Rollout, session: str, req: ChatRequest, body: Any,
                          wire: WireProtocol) -> AsyncIterator[bytes]:
        """Serve one streamed call: yields the protocol's server-sent events as the upstream samples.

        Everything that fails before the first yield raises `ChatError` (an HTTP error); the stream ends
        with the protocol's error event after that. Closing the iterator early (the agent left) stops the
        upstream request and stores nothing."""
        slot = rollout.session(session)
        async with slot.lock:
            prep = await self._prepare(rollout, session, slot, req, wire, body)
            if req.max_tokens == 0:
                yield stream_body(wire, self._empty(prep), req.options)
                return
            writer, done = None, False
            try:
                async with aclosing(self._stream(prep, body)) as steps:
                    async for step in steps:
                        out = b""
                        if writer is None:
                            writer = wire.stream_writer(prep.head(step.version), req.options)
                            out = writer.start()
                        out += b"".join(writer.piece(e) for e in step.pieces)
                        if step.tokens is not None:
                            out += writer.tokens(*step.tokens)
                        yield out + (writer.finish(step.final) if step.final is not None else b"")
                done = True
            except ChatError as err:
                if writer is None:
                    raise
                yield writer.error(err)
                done = True
            finally:
                if not done:
                    self.stats.stream_disconnects += 1
                    log.info("the agent of rollout %s session %s left mid-stream; the upstream request was stopped "
                             "and nothing stored", rollout.rollout_id, session)

    async def _stream(self, prep: Prepared, body: Any) -> AsyncIterator[Step]:
        """The steps of a streamed call as the upstream samples; the last one after the turn is durable."""
        renderer, req = self.renderer, prep.req
        joined = StreamedSample(prep.plan.full_ids)
        pieces = self._pieces(prep)
        logprobs = bool(req.options.get("logprobs"))
        upstream = self.upstream.stream(lambda: self._stream_upstream(prep))
        try:
            async with self.upstream.cancellable(prep.rollout.rollout_id), aclosing(upstream) as chunks:
                async for chunk in chunks:
                    first = joined.policy_version is None
                    joined.add(chunk)
                    events = await pieces.feed(chunk)
                    tokens = ([renderer.decode([t]) for t in chunk.output_ids], chunk.output_logprobs,
                              chunk.top_logprobs) if logprobs and chunk.output_ids else None
                    if events or tokens or first:  # the first token starts the stream
                        yield Step(chunk.policy_version, events, tokens)
        except ChatError:
            raise
        except Exception as exc:  # noqa: BLE001 - any upstream failure becomes a 502 (or the stream's error event)
            raise self._failed(exc) from exc
        sample = joined.sample()
        if sample.finish_reason == "abort":
            raise self._failed(self._aborted())
        reply, response, body_text = await self._reply(prep, sample, pieces)
        rest = await pieces.finish(reply)
        await self._store(prep, sample, reply, response, body_text, body)
        yield Step(sample.policy_version, rest, None, reply)

    async def count_tokens(self, rollout: Rollout, session: str, req: ChatRequest) -> int:
        """The prompt tokens `req` would be sent with in `session` now (its history reconciled); samples nothing."""
        *_, plan = await self._rendered(rollout, rollout.session(session).state, req)
        return len(plan.full_ids)

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
        rollout.closed = True  # new calls are refused from here on; those waiting for the server are cancelled
        self.upstream.cancel(rollout.rollout_id)  # nobody reads their replies: the agent is done or gone
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
            slot.state.held = slot.state.answered = None  # keep the counts, free the tokens and messages
            slot.last_request = None
        rollout.last_bodies.clear()
        self.stats.rollouts_closed += 1
        return rollout.summary()
