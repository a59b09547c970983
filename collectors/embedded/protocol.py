"""vLLM's `/v1/completions` wire format: request validation and response JSON. Pure functions.

Field names and shapes follow vLLM's own `CompletionRequest`, `CompletionResponse`,
`CompletionResponseChoice` and `CompletionLogProbs` (vllm/entrypoints/openai/completion/
protocol.py), so a collector cannot tell the embedded server from vLLM:

- request: `prompt` (a string or a list of token ids), `max_tokens` (default 16),
  `temperature` (1.0), `top_p` (1.0), `top_k` (0 or -1 = off), `seed`, `stop` (a string or a
  list), `stop_token_ids`, `ignore_eos`, `logprobs` (N <= 20), `return_token_ids`,
  `skip_special_tokens`, `include_stop_str_in_output`, `model`, `stream` with
  `stream_options.include_usage`; other fields are ignored, as vLLM ignores unknown ones.
  Two fields vLLM does not have. `prompt_token_ids_b64`, instead of `prompt`: the prompt's token
  ids as base64 (standard alphabet, `=`-padded) of their little-endian int32 bytes. An agent's
  prompt is tens of thousands of ids, sent whole on every call: as a JSON list the server parses
  and checks each number in Python (2.5 ms for 34k ids, 5 ms for 85k, before any check), packed
  it decodes and checks them in bulk with numpy. The server announces it (`/health` and the
  `/v1/models` card: `"prompt_token_ids_b64": true`), and `EmbeddedClient` sends it where
  announced; a server without it answers such a request 400 "`prompt` is required". Sent with
  `prompt`, empty, not base64, not whole int32s, or with a negative id: a 400 naming the field.
  The answer is the one the same ids sent as a JSON list get. And `return_prompt_token_ids:
  false` leaves the prompt's ids out of a `return_token_ids` answer (the caller sent them and knows them: an 80k-token prompt echoed
  back is half a megabyte of JSON per call); `usage.prompt_tokens` still counts them.
  Two more, for a session's calls (`collectors.embedded.prefix_cache`), announced as
  `"prompt_prefix": true` where the server keeps a store (`serve --prefix-cache-tokens`, 0 = off):
  `session_key` (a string of 1 to 200 characters): once the request is answered (streamed or not;
  not when it failed or was aborted), the server holds its whole prompt's ids followed by the output
  ids it sampled (those of `token_ids`) under that key, replacing what the key held.
  `prompt_prefix: {"key": str, "tokens": int, "crc32": int}`: the prompt is the first `tokens` ids
  held under `key`, followed by the ids sent (`prompt_token_ids_b64` or `prompt` as a list; with
  `tokens` >= 1 the sent part may be empty); `crc32` is zlib's crc32 of those `tokens` ids as
  little-endian int32 bytes. When the key is not held (never stored, evicted, the server restarted),
  holds fewer ids, or their crc32 differs, the answer is a 409 with `code: "prefix_not_cached"`:
  resend the prompt whole (nothing is guessed). Otherwise the answer is exactly the one the whole
  prompt sent gets (`usage.prompt_tokens`, `prompt_token_ids` and `routed_experts` cover all of it).
  `n` > 1, `echo`, `best_of`, `use_beam_search` and lists of prompts are refused with a 400
  that says what to send instead.
- response: `choices[].text`, `finish_reason` (stop | length), `stop_reason` (the stop string
  or stop token id; null for EOS), `logprobs.{tokens, token_logprobs, top_logprobs,
  text_offset}` (top_logprobs holds the sampled token plus the top N, values clamped at
  -9999.0 as vLLM does), `token_ids` and `prompt_token_ids` (with `return_token_ids`),
  `usage`, plus `policy_version`, the checkpoint version that sampled the first output token,
  `choices[].weight_versions` (vLLM's spans: `{version, start, end}`, output tokens [start, end)
  sampled by that version; more than one when a reload landed during the call), and for a
  mixture-of-experts model `routed_experts` (vLLM's, with `--enable-return-routed-experts`: base64
  `.npy` of `[prompt + output - 1, layers, top_k]` expert indices, see `collectors.embedded.routes`;
  null for a dense model).
- stream (vLLM's CompletionStreamResponse): one `data:` event per sampled token with its
  `text` delta, `token_ids`, `logprobs` and `policy_version`, the version that sampled its tokens
  (`prompt_token_ids` on the first), the last with `finish_reason` and `stop_reason` (and, for a
  MoE model, the whole completion's `routed_experts`, which vLLM 0.32 returns only unstreamed),
  a usage event with empty `choices` when
  asked, then `data: [DONE]`. Text that may still become a stop string, and a token that may be
  the stop token, are held back until the next token shows what they are.
- sampling support (trajstore's extension): a completion drawn with top_p < 1 or top_k > 0
  has `choices[].support_sizes` (each sampled token's kept-set size m) and `support_ids` (the
  kept ids of the sets of at most 512, concatenated: the turn columns of the same names); a
  stream sends both, for the whole completion, with its last event. vLLM's counterpart is the
  `sampling_mask` of its token-in/token-out route.
- errors: `{"error": {"message", "type", "param", "code"}}`, vLLM's current error body.

The logprobs are those of the processed distribution each token was drawn from, i.e. what
vLLM returns under `--logprobs-mode processed_logprobs` (see `collectors.embedded.sampling`).
"""

from __future__ import annotations

import binascii
import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from collectors.embedded import routes
from collectors.embedded.engine import Completion
from collectors.embedded.prefix_cache import MAX_KEY_CHARS, PrefixCache, PrefixMissing
from collectors.errors import CollectorError
from collectors.policy import SEED_MAX, SEED_MIN, TOP_K_MAX, SamplingParams
from collectors.policy.token_ids import (
    PACKED_FIELD,
    PREFIX_FIELD,
    PREFIX_NOT_CACHED,
    SESSION_KEY_FIELD,
    listed,
)
from collectors.policy.versions import span_list

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
REFUSED = {
    "n": (lambda v: v not in (None, 1), "n={v} is not supported: send one request per sample (with different seeds)"),
    "best_of": (lambda v: v not in (None, 1), "best_of={v} is not supported: send one request per sample"),
    "echo": (lambda v: bool(v), "echo is not supported: the prompt is in `prompt_token_ids` with return_token_ids"),
    "use_beam_search": (lambda v: bool(v), "beam search is not supported: sample instead"),
}


class RequestError(CollectorError):
    """A request the server refuses; rendered as an OpenAI-style error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "BadRequestError", code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind
        self.code = code  # the body's `code` where it is not the status (a refusal the client acts on)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.param, self.code if self.code is not None else self.status)


@dataclass(frozen=True)
class PrefixRef:
    """A request's `prompt_prefix`: the first `tokens` ids held under `key`, whose crc32 is `crc32`."""

    key: str
    tokens: int
    crc32: int


def error_body(message: str, kind: str, param: str | None, code: int | str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True)
class CompletionJob:
    """A validated request: what to tokenize, how to sample, what to return."""

    prompt: str | list[int]
    params: SamplingParams
    return_token_ids: bool
    model: str | None
    stream: bool = False
    include_usage: bool = False
    echo_prompt: bool = True  # with return_token_ids: the prompt's ids come back too (`return_prompt_token_ids`)
    prompt_max_id: int | None = None  # the largest prompt id where known already (a packed prompt's, from numpy)
    prompt_field: str = "prompt"  # the field the prompt came in, for errors about it
    session_key: str | None = None  # hold the prompt and output under it once answered (module docstring)
    prefix: PrefixRef | None = None  # `prompt` is the tail after these held ids, until `with_prefix`
    prompt_array: np.ndarray | None = None  # the prompt's ids as int32 where they came so (packed, or a prefix)
    prompt_crc: tuple[int, int] | None = None  # (n, crc32 of the first n ids of `prompt_array`): its held prefix's


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def unpack_prompt(value: Any, *, allow_empty: bool = False) -> np.ndarray:
    """A `prompt_token_ids_b64` value as int32 ids, checked in bulk (non-empty unless `allow_empty`, ids >= 0);
    RequestError naming it."""
    how = f"`{PACKED_FIELD}` is base64 of the prompt's token ids as little-endian int32"

    def refuse(problem: str) -> RequestError:
        return RequestError(f"{how}; {problem}", param=PACKED_FIELD)

    if not isinstance(value, str):
        raise refuse(f"got a JSON {type(value).__name__}, not a string")
    try:
        raw = binascii.a2b_base64(value, strict_mode=True)
    except (binascii.Error, ValueError) as exc:  # ValueError: not ASCII
        raise refuse(f"it is not base64 (standard alphabet, padded with '='): {exc}") from None
    if not raw and not allow_empty:
        raise refuse("it is empty: send at least one token id")
    if len(raw) % 4:
        raise refuse(f"it decodes to {len(raw)} bytes, not a multiple of 4 (4 bytes per id)")
    ids = np.frombuffer(raw, dtype="<i4")
    if len(ids) and (low := int(ids.min())) < 0:
        raise refuse(f"token ids must be >= 0, got {low}")
    return ids


def parse_completion_request(body: Any) -> CompletionJob:
    """Validate a decoded JSON body; every problem is reported at once, naming the first field."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, not {type(body).__name__}")
    problems: list[tuple[str, str]] = []

    def bad(param: str, message: str) -> None:
        problems.append((param, message))

    def get(name: str, check: Any, default: Any, expected: str) -> Any:
        value = body.get(name)
        if value is None:
            return default
        if not check(value):
            bad(name, f"`{name}` must be {expected}, got {value!r}")
            return default
        return value

    for name, (refused, message) in REFUSED.items():
        if refused(body.get(name)):
            bad(name, message.format(v=body.get(name)))
    session_key = body.get(SESSION_KEY_FIELD)
    if session_key is not None and not (isinstance(session_key, str) and 0 < len(session_key) <= MAX_KEY_CHARS):
        bad(SESSION_KEY_FIELD, f"`{SESSION_KEY_FIELD}` must be a string of 1 to {MAX_KEY_CHARS} characters naming "
                               f"the session, got {session_key!r:.80}")
        session_key = None
    prefix = _prefix_ref(body.get(PREFIX_FIELD), bad)
    tail_only = prefix is not None and prefix.tokens >= 1  # the ids sent may be none: the held ones are the prompt
    prompt, packed = body.get("prompt"), body.get(PACKED_FIELD)
    prompt_max_id, prompt_field, prompt_array = None, "prompt" if packed is None else PACKED_FIELD, None
    if packed is not None and prompt is not None:
        bad(PACKED_FIELD, f"send the prompt either as `prompt` or as `{PACKED_FIELD}`, not both")
    elif packed is not None:
        try:
            ids = unpack_prompt(packed, allow_empty=tail_only)
            prompt, prompt_array = listed(ids), ids  # the list: the engine's form
            prompt_max_id = int(ids.max()) if len(ids) else -1
        except RequestError as exc:
            bad(PACKED_FIELD, exc.message)
    elif prefix is not None and not isinstance(prompt, list):
        bad("prompt", f"with `{PREFIX_FIELD}` the rest of the prompt is token ids: `prompt` as a list or "
                      f"`{PACKED_FIELD}`, not {type(prompt).__name__}")
    elif tail_only and prompt == []:
        pass
    elif isinstance(prompt, str):
        if not prompt:
            bad("prompt", "`prompt` is an empty string; send text or a list of token ids")
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        if min(prompt) < 0:
            bad("prompt", f"token ids must be >= 0, got {min(prompt)}")
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        bad("prompt", f"a list of {len(prompt)} prompts was sent; the embedded server takes one prompt "
                      "per request (a string or a list of token ids): send one request per prompt")
    else:
        bad("prompt", "`prompt` is required: a non-empty string or a non-empty list of integer token ids")
    max_tokens = get("max_tokens", lambda v: _is_int(v) and v >= 1, 16, "an integer >= 1")
    temperature = get("temperature", lambda v: _is_number(v) and 0 <= v < math.inf, 1.0, "a finite number >= 0")
    top_p = get("top_p", lambda v: _is_number(v) and 0 < v <= 1, 1.0, "a number in (0, 1]")
    top_k = get("top_k", lambda v: _is_int(v) and -1 <= v <= TOP_K_MAX, 0,
                f"an integer from 1 to {TOP_K_MAX}, or 0 / -1 for no top-k")
    seed = get("seed", lambda v: _is_int(v) and SEED_MIN <= v <= SEED_MAX, None, "a 64-bit integer")
    logprobs = get("logprobs", lambda v: _is_int(v) and 0 <= v <= MAX_LOGPROBS, None,
                   f"an integer from 0 to {MAX_LOGPROBS}")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        bad("stop", f"`stop` must be a non-empty string or a list of non-empty strings, got {body.get('stop')!r}")
        stop = []
    stop_ids = get("stop_token_ids", lambda v: isinstance(v, list) and all(_is_int(t) and t >= 0 for t in v), [],
                   "a list of token ids")
    flags = {name: get(name, lambda v: isinstance(v, bool), default, "true or false")
             for name, default in (("return_token_ids", False), ("return_prompt_token_ids", True), ("ignore_eos", False),
                                   ("skip_special_tokens", True), ("include_stop_str_in_output", False))}
    model = get("model", lambda v: isinstance(v, str), None, "a string")
    stream = get("stream", lambda v: isinstance(v, bool), False, "true or false")
    options = get("stream_options", lambda v: isinstance(v, dict), {}, 'an object such as {"include_usage": true}')
    if problems:
        raise RequestError("; ".join(m for _, m in problems), param=problems[0][0])
    params = SamplingParams(
        max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p), top_k=max(top_k, 0), seed=seed,
        stop=tuple(stop), stop_token_ids=tuple(stop_ids), ignore_eos=flags["ignore_eos"], logprobs=logprobs,
        skip_special_tokens=flags["skip_special_tokens"],
        include_stop_str_in_output=flags["include_stop_str_in_output"])
    return CompletionJob(prompt=prompt, params=params, return_token_ids=flags["return_token_ids"], model=model,
                         stream=stream, include_usage=bool(options.get("include_usage")),
                         echo_prompt=flags["return_prompt_token_ids"], prompt_max_id=prompt_max_id,
                         prompt_field=prompt_field, session_key=session_key, prefix=prefix,
                         prompt_array=prompt_array)


def _prefix_ref(value: Any, bad: Any) -> PrefixRef | None:
    """A request's `prompt_prefix`, checked; a problem goes to `bad(field, message)` and gives None."""
    if value is None:
        return None
    how = (f'`{PREFIX_FIELD}` must be {{"key": a string of 1 to {MAX_KEY_CHARS} characters, '
           '"tokens": an integer >= 1, "crc32": an integer from 0 to 2^32 - 1}')
    if not isinstance(value, dict):
        bad(PREFIX_FIELD, f"{how}, got {value!r:.80}")
        return None
    key, tokens, crc = value.get("key"), value.get("tokens"), value.get("crc32")
    problem = ("key" if not (isinstance(key, str) and 0 < len(key) <= MAX_KEY_CHARS) else
               "tokens" if not (_is_int(tokens) and tokens >= 1) else
               "crc32" if not (_is_int(crc) and 0 <= crc < 1 << 32) else None)
    if problem is not None:
        bad(PREFIX_FIELD, f"{how}; its `{problem}` is {value.get(problem)!r:.80}")
        return None
    return PrefixRef(key, tokens, crc)


def with_prefix(job: CompletionJob, cache: PrefixCache | None, *, as_list: bool = True) -> CompletionJob:
    """`job` with its whole prompt: the ids `cache` holds for its `prompt_prefix`, then the ids it sent. A prefix
    not held as named is a 409 `prefix_not_cached` (module docstring); a server without a store answers it too.
    The prompt is a list of Python ints, the engine's form; `as_list=False` leaves it the int32 array (a caller
    with no engine to hand it to, the benchmarks' fake policy server: listing a long history on every call
    costs in proportion to it)."""
    ref = job.prefix
    if ref is None:
        return job
    if cache is None or not cache.budget:
        raise RequestError(f"this server keeps no session prefixes (started with --prefix-cache-tokens 0); "
                           f"resend the whole prompt without `{PREFIX_FIELD}`", param=PREFIX_FIELD, status=409,
                           kind="ConflictError", code=PREFIX_NOT_CACHED)
    try:
        held = cache.prefix(ref.key, ref.tokens, ref.crc32)
    except PrefixMissing as exc:
        raise RequestError(f"{exc}; resend the whole prompt (with `{SESSION_KEY_FIELD}` for the server to hold "
                           "it again)", param=PREFIX_FIELD, status=409, kind="ConflictError",
                           code=PREFIX_NOT_CACHED) from None
    assert isinstance(job.prompt, list)  # parse_completion_request: token ids with a prefix
    tail = job.prompt_array if job.prompt_array is not None else np.asarray(job.prompt, dtype="<i4")
    whole = np.concatenate((held, tail))  # a copy of int32s: the held ids are never converted from Python ints
    return replace(job, prompt=listed(whole) if as_list else whole, prompt_max_id=int(whole.max()),
                   prompt_array=whole, prompt_crc=(ref.tokens, ref.crc32), prefix=None)


def remember(job: CompletionJob, cache: PrefixCache | None, prompt_ids: list[int], output_ids: Sequence[int]) -> None:
    """Hold an answered request's prompt and the output ids it was answered with under its `session_key`."""
    if job.session_key is not None and cache is not None and cache.budget:
        cache.put(job.session_key, job.prompt_array if job.prompt_array is not None else prompt_ids, output_ids,
                  known=job.prompt_crc)  # set with `prompt_array` only (`with_prefix`)


def check_prompt(prompt_ids: list[int], params: SamplingParams, *, vocab_size: int, max_model_len: int,
                 max_id: int | None = None, param: str = "prompt") -> None:
    """Token ids the model has, and room in its context for the prompt plus max_tokens; `max_id` is
    `max(prompt_ids)` where the caller knows it, `param` the field the prompt came in."""
    if not prompt_ids:
        raise RequestError("the prompt encodes to zero tokens", param=param)
    if max_id is None:
        max_id = max(prompt_ids)
    if max_id >= vocab_size:
        raise RequestError(f"token id {max_id} is out of vocabulary: the model has {vocab_size} tokens "
                           f"(ids 0..{vocab_size - 1})", param=param)
    if len(prompt_ids) + params.max_tokens > max_model_len:
        raise RequestError(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                           f"{len(prompt_ids) + params.max_tokens} tokens ({len(prompt_ids)} in the prompt, "
                           f"{params.max_tokens} in the completion). Please reduce the length of the prompt or "
                           "max_tokens.", param="max_tokens")
    bad_stop = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad_stop:
        raise RequestError(f"stop_token_ids {bad_stop} are out of vocabulary (the model has {vocab_size} tokens)",
                           param="stop_token_ids")


def _clamp(logprob: float) -> float:
    return max(logprob, -9999.0)


def completion_logprobs(ids: list[int], logprobs: list[float], top_logprobs: list[list[tuple[int, float]]] | None,
                        decode_one: Any, offset: int = 0) -> dict[str, Any]:
    """vLLM's CompletionLogProbs for output tokens (text offsets from `offset`); `decode_one(id) -> str` names one."""
    tokens = [decode_one(t) for t in ids]
    offsets, at = [], offset
    for token in tokens:
        offsets.append(at)
        at += len(token)
    top: list[dict[str, float]] = []
    for i, (token, logprob) in enumerate(zip(tokens, logprobs)):
        entry = {token: _clamp(logprob)}  # the sampled token first, then the top N
        for tid, lp in (top_logprobs[i] if top_logprobs else []):
            entry.setdefault(decode_one(tid), _clamp(lp))
        top.append(entry)
    return {"text_offset": offsets, "token_logprobs": [_clamp(lp) for lp in logprobs], "tokens": tokens,
            "top_logprobs": top}


def completion_response(job: CompletionJob, result: Completion, *, model_name: str, decode_one: Any) -> dict[str, Any]:
    choice = {
        "index": 0,
        "text": result.text,
        "logprobs": completion_logprobs(result.output_ids, result.logprobs, result.top_logprobs, decode_one)
        if job.params.logprobs is not None else None,
        "finish_reason": result.finish_reason,
        "stop_reason": result.stop_reason,
        "token_ids": result.output_ids if job.return_token_ids else None,
        "prompt_logprobs": None,
        "prompt_token_ids": result.prompt_ids if job.return_token_ids and job.echo_prompt else None,
        "weight_versions": span_list(*result.spans(), len(result.output_ids)),
        "routed_experts": routes.encode(result.routed_experts) if result.routed_experts is not None else None,
    }
    if result.support_sizes is not None:  # truncated draws: each token's kept set (see the module docstring)
        choice["support_sizes"], choice["support_ids"] = result.support_sizes, result.support_ids
    n_prompt, n_out = len(result.prompt_ids), len(result.output_ids)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [choice],
        "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out},
        "policy_version": result.policy_version,
    }


def stream_event(job: CompletionJob, request_id: str, created: int, model_name: str, version: int, text: str,
                 ids: list[int], logprobs: dict[str, Any] | None, *, prompt_ids: list[int] | None = None,
                 finish_reason: str | None = None, stop_reason: str | int | None = None,
                 final: Completion | None = None) -> dict[str, Any]:
    """One event of a streamed completion (vLLM's CompletionStreamResponse with one choice). The last one
    (`final`) also carries the completion's `routed_experts` for a MoE model, and its kept sets
    (`support_sizes`, `support_ids`) when its draws were truncated."""
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                              "stop_reason": stop_reason}
    if final is not None and final.routed_experts is not None:
        choice["routed_experts"] = routes.encode(final.routed_experts)
    if final is not None and final.support_sizes is not None:
        choice["support_sizes"], choice["support_ids"] = final.support_sizes, final.support_ids
    if job.return_token_ids:
        choice["token_ids"] = ids
        if prompt_ids is not None and job.echo_prompt:
            choice["prompt_token_ids"] = prompt_ids
    return {"id": request_id, "object": "text_completion", "created": created, "model": model_name,
            "choices": [choice], "policy_version": version}


def usage_event(request_id: str, created: int, model_name: str, n_prompt: int, n_out: int) -> dict[str, Any]:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model_name, "choices": [],
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}}
