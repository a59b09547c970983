"""The capture proxy's vLLM-rendered path (`trajstore proxy --render vllm`): vLLM renders, samples and parses.

With the proxy's own renderer (`collectors.proxy.render`) the chat template is applied with
transformers and replies are parsed by the project's Hermes parser. On this path every
model-family-specific step is vLLM's own, so any family vLLM serves is captured with the
template and the tool-call and reasoning parsers vLLM ships for it (`--tool-call-parser`,
`--reasoning-parser`, as vLLM names them):

1. render: `POST /v1/chat/completions/render` turns the call (reconciled, see below) into the
   exact prompt token ids with the model's template; vLLM's sampling fields that go with them
   (the structured-output constraint it derives from `tool_choice: required` or a named
   function, or from a request's `structured_outputs`) are kept for step 2. Every wire
   protocol is rendered through this one route: the proxy translates Anthropic Messages and
   Responses to chat messages itself, as vLLM's `/v1/messages/render` does internally before
   calling the same chat renderer, and only chat messages can carry the sampled text that
   reconciliation puts in place of the agent's copy of a reply;
2. generate: `POST /inference/v1/generate`, token ids in, sampled ids and logprobs out
   (`VLLMClient`, which samples there, versions stamped by vLLM's `weight_versions`);
3. derender: `POST /v1/chat/completions/derender` turns the sampled ids (less the stop token
   that ended them) back into content, reasoning and tool calls with vLLM's parsers; a
   streamed call sends each chunk to its streaming form (the parser state travels in
   `stream_state`) and streams the content and reasoning deltas as they come, the tool calls
   whole at the end, and stores exactly what it streamed.

What the proxy keeps doing itself, unchanged: reconciliation of the agent's re-serialized
history (`collectors.proxy.reconcile`), the segment decision on rendered text
(`collectors.proxy.segmenter`; the text is the decoded rendered ids, special tokens kept, so
the local tokenizer of `--model` must be the served one) with the exact sampled ids spliced
in, fork reasons, the three wire protocols, storage. The prompt delta of a continued segment is
vLLM's own rendered ids after the held text when a token boundary falls there (a template
writes a control token right after a reply, so it does), else the local tokenization of the
rest, as on the proxy's own path (`plan_rendered`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from collectors.errors import CollectorError
from collectors.model.toolcalls import ToolCall
from collectors.policy import (
    Chunk,
    PolicyClient,
    PolicyServerError,
    PolicyServerRejected,
    PolicyServerUnreachable,
    Sample,
    VLLMClient,
)
from collectors.policy.http import Http
from collectors.proxy.capture import Capture, Prepared
from collectors.proxy.chat import ChatError, ChatReply, ChatRequest, Message
from collectors.proxy.reconcile import reconcile
from collectors.proxy.render import text_ids
from collectors.proxy.segmenter import SessionState, TurnPlan
from collectors.proxy.sessions import Rollout
from collectors.proxy.streaming import Event, ReplyStream
from trajstore import new_id

log = logging.getLogger(__name__)
RENDER, DERENDER = "/v1/chat/completions/render", "/v1/chat/completions/derender"
PROMPT_TAIL = 64  # prompt ids sent with a derender: vLLM reads only the last few (detokenization seed, parsers)


class RenderUnavailable(CollectorError):
    """The policy server cannot serve the render path: not vLLM, an old vLLM, or one started without its routes."""


def routes_problem(url: str, status: int | None, said: str) -> str | None:
    """What is wrong with a vLLM whose render route answered `status` / `said`, with the fix; None if nothing."""
    if status == 403 and "scale-out" in said.lower():
        return (f"vLLM at {url} serves the render, generate and derender routes only when started with "
                "--enable-scale-out (trajstore starts it so with start_vllm(render=True) or `trajstore proxy "
                "--render vllm` without --upstream)")
    if status in (404, 405):
        return (f"the policy server at {url} has no POST {RENDER}: `--render vllm` needs vLLM 0.32 or later "
                "started with --enable-scale-out (use --render local for `trajstore serve` or an older vLLM)")
    return None


@dataclasses.dataclass(frozen=True)
class RenderedPlan(TurnPlan):
    """A `TurnPlan` plus what vLLM's render added for sampling and derendering."""

    sampling_extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    chat_request: dict[str, Any] = dataclasses.field(default_factory=dict)  # what derender parses with


def tool_choice(protocol: str, body: Any) -> Any:
    """The call's `tool_choice` in OpenAI chat terms (what vLLM's chat render reads), from any wire's body."""
    choice = body.get("tool_choice") if isinstance(body, dict) else None
    if protocol == "anthropic" and isinstance(choice, dict):
        kind = choice.get("type")
        return {"any": "required", "tool": {"type": "function", "function": {"name": choice.get("name")}},
                "none": "none"}.get(kind, "auto")
    if protocol == "responses" and isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice if choice in ("auto", "required", "none") or isinstance(choice, dict) else None


def chat_body(req: ChatRequest, messages: list[Message], body: Any, model: str | None) -> dict[str, Any]:
    """The /v1/chat/completions request vLLM renders for a call (its messages reconciled)."""
    out: dict[str, Any] = {"messages": [_vllm_message(m) for m in messages],
                           "add_generation_prompt": not req.continue_final,
                           "continue_final_message": req.continue_final}
    if model is not None:
        out["model"] = model
    if req.tools:
        out["tools"] = req.tools
        choice = tool_choice(req.protocol, body)
        if choice is not None:
            out["tool_choice"] = choice
    extra = body.get("structured_outputs") if isinstance(body, dict) else None
    if isinstance(extra, dict):  # vLLM's own constraint field, passed through as vLLM reads it
        out["structured_outputs"] = extra
    return out


def _vllm_message(message: Message) -> Message:
    """A template message as vLLM's chat request takes it: a tool call needs an id there."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    return {**message, "tool_calls": [{"id": c.get("id") or f"call_{i}", **c} for i, c in enumerate(calls)]}


def token_boundary(ids: Sequence[int], text: str, decode: Callable[[list[int]], str]) -> int | None:
    """The k with decode(ids[:k]) == text, if a token boundary falls at the end of `text` (binary search on the
    decoded length, which never shrinks as tokens are added)."""
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(list(ids[:mid]))) < len(text):
            lo = mid + 1
        else:
            hi = mid
    return lo if decode(list(ids[:lo])) == text else None


def plan_rendered(state: SessionState, prompt_text: str, ids: list[int], decode: Callable[[list[int]], str],
                  encode: Callable[[str], list[int]], new_segment_id: Callable[[], str], **extra: Any) -> RenderedPlan:
    """`collectors.proxy.segmenter.plan_turn` for a prompt vLLM rendered to `ids` (whose text is `prompt_text`):
    a new segment starts with vLLM's ids, a continued one sends the held ids and vLLM's ids after the held text."""
    held = state.held
    fork: str | None = None
    if held is not None and state.segment_id is not None:
        rest = held.rest(prompt_text)
        if rest is not None:
            k = token_boundary(ids, held.text, decode)
            delta = list(ids[k:]) if k is not None else encode(rest)
            return RenderedPlan(state.segment_id, state.next_turn, delta, held.ids.view(delta), None, None, **extra)
        fork = held.fork_reason(prompt_text)
    return RenderedPlan(new_segment_id(), 0, list(ids), list(ids), fork, state.segment_id, **extra)


class VLLMRoutes:
    """vLLM's render and derender routes, their failures as `ChatError`s that say what to do."""

    def __init__(self, http: Http, model: str | None) -> None:
        self.base_url, self.model, self._http = http.base_url, model, http

    async def post(self, route: str, body: dict[str, Any]) -> Any:
        try:
            reply = await self._http.call("POST", route, body=body, idempotent=True, retry_unavailable=True)
        except PolicyServerUnreachable:
            raise  # the proxy waits an outage out (collectors.proxy.upstream)
        except PolicyServerRejected as exc:
            problem = routes_problem(self.base_url, exc.status, exc.server_message or "")
            if problem:
                raise ChatError(problem, status=502, kind="upstream") from exc
            raise ChatError(f"vLLM refused to {'render' if route == RENDER else 'parse'} this call: "
                            f"{exc.server_message}", status=400) from exc
        except PolicyServerError as exc:
            raise ChatError(str(exc), status=502, kind="upstream") from exc
        return self._http.json(reply, route)

    async def check(self) -> None:
        """RenderUnavailable unless the server answers the render route (called once at the proxy's start)."""
        try:
            await self._http.call("POST", RENDER, body={"messages": [{"role": "user", "content": "hi"}],
                                                        **({"model": self.model} if self.model else {})},
                                  idempotent=True)
        except PolicyServerRejected as exc:
            problem = routes_problem(self.base_url, exc.status, exc.server_message or "")
            if problem:
                raise RenderUnavailable(problem) from exc
        except PolicyServerError as exc:
            raise RenderUnavailable(f"cannot reach vLLM's render route: {exc}") from exc


def _calls(message: dict[str, Any]) -> list[tuple[str, str]]:
    out = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        arguments = fn.get("arguments")
        out.append((str(fn.get("name")), arguments if isinstance(arguments, str) else json.dumps(arguments)))
    return out


def _tool_call(name: str, arguments: str, call_id: str) -> ToolCall:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        value = None
    return ToolCall(name=name, arguments=arguments, input=value if isinstance(value, dict) else {}, id=call_id)


class DerenderPieces:
    """A stream's pieces from vLLM's streaming derender: content and reasoning deltas as vLLM's parsers release
    them, tool calls gathered and sent whole at the end. The newest token waits for the next chunk while it may
    be the stop token that ends the reply (never derendered, as on the non-streamed path)."""

    def __init__(self, post: Callable[[str, dict[str, Any]], Awaitable[Any]], model: str | None, plan: RenderedPlan,
                 special_ids: set[int]) -> None:
        self.post, self.model, self.plan, self.special = post, model, plan, special_ids
        self.state: dict[str, Any] | None = None
        self.pending: list[int] = []
        self.sent = ReplyStream(parse_tools=False)  # what was sent: its `finish` sends the rest of a reply
        self.calls: dict[int, list[str]] = {}  # index -> [name, arguments so far]

    async def _derender(self, ids: list[int], finish: str | None) -> list[Event]:
        body = {"stream": True, "model": self.model, "chat_request": self.plan.chat_request,
                "prompt_token_ids": self.plan.full_ids[-PROMPT_TAIL:], "stream_state": self.state,
                "generate_chunk": {"choices": [{"index": 0, "token_ids": ids, "finish_reason": finish}]}}
        answer = await self.post(DERENDER, {k: v for k, v in body.items() if v is not None})
        self.state = answer.get("stream_state")
        events: list[Event] = []
        for choice in (answer.get("chunk") or {}).get("choices") or []:
            delta = choice.get("delta") or {}
            for kind, key in (("reasoning", "reasoning"), ("content", "content")):
                if delta.get(key):
                    events.append((kind, delta[key]))
                    self.sent.sent[kind] += delta[key]
            for call in delta.get("tool_calls") or []:
                got = self.calls.setdefault(int(call.get("index", 0)), ["", ""])
                fn = call.get("function") or {}
                got[0] += fn.get("name") or ""
                got[1] += fn.get("arguments") or ""
        return events

    async def feed(self, chunk: Chunk) -> list[Event]:
        ids = self.pending + list(chunk.output_ids)
        if chunk.finish_reason is not None:
            ended_by_token = chunk.finish_reason == "stop" and not isinstance(chunk.stop_reason, str)
            self.pending = []
            body = ids[:-1] if ended_by_token and ids else ids
            return await self._derender(body, chunk.finish_reason) if body or self.state else []
        self.pending = ids[-1:] if ids and ids[-1] in self.special else []
        body = ids[:len(ids) - len(self.pending)]
        return await self._derender(body, None) if body else []

    def streamed(self) -> tuple[str, str | None, list[tuple[str, str]]]:
        """Content, reasoning and tool calls as streamed: the stored reply."""
        return (self.sent.sent["content"], self.sent.sent["reasoning"] or None,
                [(name, arguments) for _, (name, arguments) in sorted(self.calls.items())])

    async def finish(self, reply: ChatReply) -> list[Event]:
        return self.sent.finish(reply)


class VLLMCapture(Capture):
    """`Capture` whose render, sampling and parsing are vLLM's (see the module docstring)."""

    def __init__(self, *args: Any, routes: VLLMRoutes, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.routes = routes

    async def _post(self, route: str, body: dict[str, Any]) -> Any:
        """POST to vLLM's render or derender route, waiting out an outage as sampling does; a failure is a 502
        that names it (a call vLLM refuses, a 400 that says why)."""
        try:
            return await self.upstream.call(lambda: self.routes.post(route, body))
        except ChatError:
            raise
        except Exception as exc:  # noqa: BLE001 - an unreachable or failing vLLM is a 502 that names it
            raise self._failed(exc) from exc

    async def _rendered(self, rollout: Rollout, state: SessionState, req: ChatRequest, body: Any = None
                        ) -> tuple[list[Message], str, str, TurnPlan]:
        self.renderer.check_fits(req, self.max_model_len)
        # reconciling, decoding and planning a long conversation take long: the render threads do them, as on the
        # proxy's own path; vLLM renders meanwhile
        loop = asyncio.get_running_loop()
        async with rollout.renders:
            messages, history = await loop.run_in_executor(self._render_pool, reconcile, req.messages, state.answered)
            request = chat_body(req, messages, body, self.routes.model)
            rendered = await self._post(RENDER, request)
            ids = rendered.get("token_ids") if isinstance(rendered, dict) else None
            if not isinstance(ids, list) or not ids:
                raise ChatError(f"vLLM at {self.routes.base_url} rendered no token ids: {str(rendered)[:200]}",
                                status=502, kind="upstream")
            prompt_text, plan = await loop.run_in_executor(self._render_pool, self._plan, state, request, rendered,
                                                           ids)
        return messages, history, prompt_text, plan

    def _plan(self, state: SessionState, request: dict[str, Any], rendered: dict[str, Any],
              ids: list[int]) -> tuple[str, RenderedPlan]:
        params = rendered.get("sampling_params") or {}
        extra = {k: rendered[k] for k in ("reasoning_ended", "reasoning_parser_kwargs") if rendered.get(k) is not None}
        if params.get("structured_outputs"):
            extra["sampling_params"] = {"structured_outputs": params["structured_outputs"]}
        # derender parses with the call's tools and tool choice; the conversation itself it does not read
        parse_with = {k: v for k, v in request.items() if k in ("model", "tools", "tool_choice")}
        parse_with["messages"] = [{"role": "user", "content": ""}]
        prompt_text = self.renderer.decode(ids)
        return prompt_text, plan_rendered(state, prompt_text, ids, self.renderer.decode, self.renderer.encode, new_id,
                                          sampling_extra=extra, chat_request=parse_with)

    def _extra(self, prep: Prepared) -> dict[str, Any]:
        return prep.plan.sampling_extra if isinstance(prep.plan, RenderedPlan) else {}

    def _complete(self, prep: Prepared) -> Any:
        return self.client.complete(prep.plan.full_ids, prep.req.sampling_for(prep.max_tokens),  # type: ignore[call-arg]
                                    session_id=f"{prep.rollout.rollout_id}/{prep.session}",
                                    sampling_extra=self._extra(prep))

    def _stream_upstream(self, prep: Prepared) -> AsyncIterator[Chunk]:
        return self.client.stream(prep.plan.full_ids, prep.req.sampling_for(prep.max_tokens),  # type: ignore[call-arg]
                                  session_id=f"{prep.rollout.rollout_id}/{prep.session}",
                                  sampling_extra=self._extra(prep))

    def _pieces(self, prep: Prepared) -> DerenderPieces:
        assert isinstance(prep.plan, RenderedPlan)
        return DerenderPieces(self._post, self.routes.model, prep.plan, self.renderer.special_ids)

    async def _derendered(self, prep: Prepared, ids: list[int], sample: Sample) -> tuple[str, str | None,
                                                                                          list[tuple[str, str]]]:
        assert isinstance(prep.plan, RenderedPlan)
        if not ids:  # the reply is its stop token alone: nothing to parse (vLLM refuses empty outputs)
            return "", None, []
        answer = await self._post(DERENDER, {
            "model": self.routes.model, "chat_request": prep.plan.chat_request,
            "prompt_token_ids": prep.plan.full_ids[-PROMPT_TAIL:], "prompt_tokens": len(prep.plan.full_ids),
            "generate_response": {"choices": [{"index": 0, "token_ids": ids, "finish_reason": sample.finish_reason,
                                               "stop_reason": sample.stop_reason}]}})
        message = ((answer.get("choices") or [{}])[0].get("message") or {}) if isinstance(answer, dict) else {}
        return message.get("content") or "", message.get("reasoning") or None, _calls(message)

    async def _reply(self, prep: Prepared, sample: Sample, pieces: Any = None) -> tuple[ChatReply, dict[str, Any], str]:
        req = prep.req
        body_ids = text_ids(sample)
        body_text = self.renderer.decode(body_ids)
        if isinstance(pieces, DerenderPieces):  # stored as streamed
            content, reasoning, calls = pieces.streamed()
        else:
            content, reasoning, calls = await self._derendered(prep, body_ids, sample)
        stop_string = sample.stop_reason if isinstance(sample.stop_reason, str) else None
        if stop_string is not None and pieces is None and stop_string in content:  # as the engine cut its text
            content = content[:content.index(stop_string)]
        if not (req.parse_tools and req.tools):
            calls = []
        tool_calls = tuple(_tool_call(name, arguments, f"{prep.wire.call_prefix}{new_id()[:24]}")
                           for name, arguments in calls)
        finish = "tool_calls" if tool_calls and sample.finish_reason == "stop" else sample.finish_reason
        ids = list(sample.output_ids)
        texts = [self.renderer.decode([t]) for t in ids] if req.options.get("logprobs") else []
        reply = ChatReply(id=prep.reply_id, model=req.model or "", created=prep.created, content=content,
                          reasoning=reasoning, tool_calls=tool_calls, finish=finish, stop_sequence=stop_string,
                          prompt_tokens=len(prep.plan.full_ids), output_ids=ids,
                          output_logprobs=list(sample.output_logprobs), token_texts=texts,
                          policy_version=sample.policy_version, trajstore=prep.info(sample.policy_version),
                          top_logprobs=sample.top_logprobs, top_n=int(req.options.get("top_logprobs") or 0))
        return reply, prep.wire.response(reply, req.options), body_text


async def vllm_capture(client: PolicyClient) -> Callable[..., VLLMCapture]:
    """The `Capture` class of a proxy with `render="vllm"` over `client`: `RenderUnavailable` unless `client` is a
    a `VLLMClient` whose server serves the render routes (a server not up yet is only logged:
    the proxy may start before it, and each call waits for it as for any outage)."""
    if not isinstance(client, VLLMClient):
        raise RenderUnavailable("--render vllm samples through vLLM's /inference/v1/generate: use --upstream-kind "
                                "vllm (a VLLMClient) with it")
    routes = VLLMRoutes(client.http, client.model)
    try:
        await routes.check()
    except RenderUnavailable as exc:
        if not isinstance(exc.__cause__, PolicyServerUnreachable):
            raise
        log.warning("%s; calls wait for it", exc)
    return functools.partial(VLLMCapture, routes=routes)
