"""The fake policy server of `benchmarks/proxy_agents.py` (and `proxy_profile.py`), in its own process.

It answers at once or after a fixed delay (POST /bench/delay sets it):

- POST /v1/completions   what the proxy calls: vLLM's completions from token ids, the request read
                         as the embedded server reads it (`read_json`, then its own parser, so every
                         option it takes is honoured, the packed prompt `prompt_token_ids_b64` too:
                         /health announces it as the embedded server does, so `EmbeddedClient` sends it;
                         BENCH_UPSTREAM_PACKED=0 in the environment leaves it unannounced, for the
                         JSON-list form to be measured against it), and a session's held prefix
                         (`session_key` / `prompt_prefix`, kept in the embedded server's own
                         `PrefixCache`): announced as `"prompt_prefix": true` unless
                         BENCH_UPSTREAM_PREFIX=0, so the proxy's per-call cost is measured both ways)
                         and answered in its JSON, streamed too; the reply is always the same text
                         and tool call, the one the next request's history holds;
- POST /v1/chat/completions  what the direct rounds call with the very same bodies: the body is
                         decoded the same way, as any server would, and the same reply is answered.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import socket
from multiprocessing.connection import Connection
from typing import Any

MODEL = "bench"
MAX_BODY = 256 << 20  # the huge-body table's 2M-token prompt included
SAID = "I will read the next file."
CALL = {"name": "read_file", "arguments": {"path": "src/app.py"}}
REPLY = f"{SAID}\n<tool_call>\n{json.dumps(CALL)}\n</tool_call>"  # what the fake policy always samples


def upstream_app(model_dir: str) -> Any:
    from aiohttp import web
    from transformers import AutoTokenizer

    from collectors.embedded.engine import Completion
    from collectors.embedded.prefix_cache import PrefixCache
    from collectors.embedded.protocol import (
        PACKED_FIELD,
        PREFIX_FIELD,
        RequestError,
        completion_response,
        parse_completion_request,
        remember,
        stream_event,
        with_prefix,
    )
    from collectors.serving import read_json

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok.encode(REPLY, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    logprobs = [-0.5 - 0.01 * i for i in range(len(ids))]
    texts = {t: tok.decode([t], skip_special_tokens=False) for t in ids}
    delay = {"s": 0.0, "first_token_s": 0.01, "token_s": 0.0005}
    chat_answer = {"object": "chat.completion", "model": MODEL, "created": 0, "choices": [{
        "index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": SAID, "tool_calls": [{
            "id": "call_x", "type": "function",
            "function": {"name": CALL["name"], "arguments": json.dumps(CALL["arguments"])}}]}}],
        "usage": {"prompt_tokens": 0, "completion_tokens": len(ids), "total_tokens": len(ids)}}

    prefixes = PrefixCache(0 if os.environ.get("BENCH_UPSTREAM_PREFIX") == "0" else 1 << 24)

    async def completions(request: web.Request) -> web.StreamResponse:
        try:
            job = with_prefix(parse_completion_request(await read_json(request, MAX_BODY)), prefixes, as_list=False)
        except RequestError as exc:
            return web.json_response(exc.body(), status=exc.status)
        # a held prefix's prompt stays the int32 array, never a list of Python ints made per call: this process
        # shares the measured proxy's two cores, and listing an 80k-id history on every call slowed the proxy
        # through the shared caches (table 1b at 80k: 0.5-0.9 ms a turn), as a policy server on its own machine
        # would not
        prompt = tok.encode(job.prompt) if isinstance(job.prompt, str) else job.prompt
        if job.return_token_ids and job.echo_prompt and not isinstance(prompt, list):
            prompt = prompt.tolist()  # echoed back in the JSON
        remember(job, prefixes, prompt, ids)  # the reply is always `ids`, answered whole (the stream too)
        if job.stream:
            return await stream(request, job, prompt)
        await asyncio.sleep(delay["s"])
        result = Completion(prompt_ids=prompt, output_ids=ids, logprobs=logprobs, top_logprobs=None,
                            text=REPLY, finish_reason="stop", stop_reason=None, policy_version=0)
        return web.json_response(completion_response(job, result, model_name=MODEL, decode_one=texts.__getitem__),
                                 headers={"X-Policy-Version": "0"})

    async def stream(request: web.Request, job: Any, prompt: list[int]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Policy-Version": "0"})
        await resp.prepare(request)
        await asyncio.sleep(delay["first_token_s"])
        for i, token in enumerate(ids):
            if i:
                await asyncio.sleep(delay["token_s"])
            last = i == len(ids) - 1
            lp = {"token_logprobs": [logprobs[i]], "tokens": [texts[token]], "text_offset": [0],
                  "top_logprobs": [{texts[token]: logprobs[i]}]} if job.params.logprobs is not None else None
            event = stream_event(job, "cmpl-bench", 0, MODEL, 0, "" if last else texts[token], [token], lp,
                                 prompt_ids=prompt if i == 0 else None, finish_reason="stop" if last else None)
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def chat(request: web.Request) -> web.Response:
        await read_json(request, MAX_BODY)  # what any server does with the body
        await asyncio.sleep(delay["s"])
        return web.json_response(chat_answer)

    async def delay_route(request: web.Request) -> web.Response:
        delay.update(await request.json())
        return web.json_response(delay)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    app = web.Application(client_max_size=MAX_BODY)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/bench/delay", delay_route)
    app.router.add_get("/v1/models", models)
    health = {"status": "ok", "policy_version": 0, PACKED_FIELD: os.environ.get("BENCH_UPSTREAM_PACKED") != "0",
              PREFIX_FIELD: bool(prefixes.budget)}
    app.router.add_get("/health", lambda r: web.json_response(health))
    return app


def serve_upstream(model_dir: str, conn: Connection) -> None:
    from aiohttp import web

    async def main() -> None:
        runner = web.AppRunner(upstream_app(model_dir), access_log=None)
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(runner, sock, backlog=2048).start()
        conn.send(f"http://127.0.0.1:{sock.getsockname()[1]}")
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # until told to stop
        await runner.cleanup()

    asyncio.run(main())


def start_upstream(model_dir: str) -> tuple[mp.Process, Connection, str]:
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=serve_upstream, args=(model_dir, child), daemon=True)
    proc.start()
    if not parent.poll(120):
        raise RuntimeError("the fake policy server did not start within 120 s")
    return proc, parent, parent.recv()
