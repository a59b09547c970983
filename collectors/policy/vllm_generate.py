"""vLLM's token-in / token-out route, `POST /inference/v1/generate`: its request body and its answers as `Sample`s.

vLLM 0.32 serves it with `--enable-scale-out` (`collectors.policy.vllm_server.render_args`). The
request is the prompt's ids and vLLM's own `SamplingParams` as JSON; the answer
(`output_mode: "text"`) holds the sampled ids, their text and, per token, the logprob of the
sampled token and its top alternatives as `{token, logprob}` lists. `VLLMClient(api="generate")`
sends its samples here instead of `/v1/completions`, stamping versions the same way.

`extra` carries fields of the request the caller got from vLLM's render route
(`collectors.proxy.vllm_render`): in `sampling_params`, the structured-output constraint vLLM
derives from a request's `tool_choice` (`required` or a named function) or its
`structured_outputs`, which the proxy's own `SamplingParams` cannot express; beside it
`reasoning_ended` and `reasoning_parser_kwargs`, which tell the engine from which token on the
constraint applies. `SamplingParams` wins for every sampling field both set.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from collectors.policy.contract import Chunk, Sample, SamplingParams
from collectors.policy.http import PolicyServerBadResponse

GENERATE_ROUTE = "/inference/v1/generate"


def generate_body(prompt_ids: list[int], sampling: SamplingParams, model: str | None,
                  extra: Mapping[str, Any] | None = None, *, stream: bool = False) -> dict[str, Any]:
    """The /inference/v1/generate request for one token-id prompt."""
    extra = dict(extra or {})
    params: dict[str, Any] = {
        **extra.pop("sampling_params", {}), "max_tokens": sampling.max_tokens, "temperature": sampling.temperature,
        "top_p": sampling.top_p, "top_k": sampling.top_k, "stop": list(sampling.stop),
        "stop_token_ids": list(sampling.stop_token_ids), "logprobs": sampling.logprobs or 0, "seed": sampling.seed,
        "ignore_eos": sampling.ignore_eos, "skip_special_tokens": sampling.skip_special_tokens,
        "include_stop_str_in_output": sampling.include_stop_str_in_output}
    body: dict[str, Any] = {**extra, "token_ids": prompt_ids, "sampling_params": params, "output_mode": "text",
                            "stream": stream}
    if model is not None:
        body["model"] = model
    return body


def _bad(url: str, problem: str) -> PolicyServerBadResponse:
    return PolicyServerBadResponse(f"vLLM at {url} {problem} on {GENERATE_ROUTE}", url=url)


def _choice(body: Any, url: str) -> dict[str, Any]:
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise _bad(url, f"returned an answer without choices: {json.dumps(body)[:200]}")
    return choices[0]


def _tokens(choice: dict[str, Any], url: str,
            top: bool) -> tuple[list[int], list[float], list[dict[str, float]] | None]:
    """The sampled ids, their logprobs and (when asked) the top alternatives of one choice, checked."""
    ids = choice.get("token_ids") or []
    if not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
        raise _bad(url, f"returned `token_ids` that are not a list of integers: {str(ids)[:200]}")
    content = (choice.get("logprobs") or {}).get("content") if isinstance(choice.get("logprobs"), dict) else None
    if ids and not isinstance(content, list):
        raise _bad(url, "returned no `logprobs.content` although the request set `logprobs`; run vLLM with "
                        "--logprobs-mode processed_logprobs")
    content = content or []
    if len(content) != len(ids) or not all(isinstance(c, dict) and isinstance(c.get("logprob"), (int, float))
                                           for c in content):
        raise _bad(url, f"returned {len(ids)} token ids but {len(content)} logprob entries; they must pair up")
    tops = [{str(t.get("token")): float(t.get("logprob")) for t in c.get("top_logprobs") or []}
            for c in content] if top else None
    return ids, [float(c["logprob"]) for c in content], tops


def parse_generate(body: Any, prompt_ids: list[int], *, policy_version: int, url: str,
                   top_logprobs: bool = False) -> Sample:
    """A `Sample` from a /inference/v1/generate answer, or `PolicyServerBadResponse` naming what is missing."""
    choice = _choice(body, url)
    ids, logprobs, tops = _tokens(choice, url, top_logprobs)
    text, finish = choice.get("text"), choice.get("finish_reason")
    if not isinstance(text, str) or not isinstance(finish, str):
        raise _bad(url, f"returned a choice without `text` or `finish_reason`: {json.dumps(choice)[:200]}")
    return Sample(prompt_ids=prompt_ids, output_ids=ids, output_logprobs=logprobs, text=text, finish_reason=finish,
                  policy_version=policy_version, stop_reason=choice.get("stop_reason"), top_logprobs=tops)


def parse_generate_chunk(event: Any, prompt_ids: list[int], *, policy_version: int, url: str,
                         top_logprobs: bool = False) -> Chunk | None:
    """A `Chunk` from one event of a streamed /inference/v1/generate answer; None for one without choices."""
    if isinstance(event, dict) and not event.get("choices"):
        return None
    choice = _choice(event, url)
    ids, logprobs, tops = _tokens(choice, url, top_logprobs)
    return Chunk(output_ids=ids, output_logprobs=logprobs, text=str(choice.get("text") or ""),
                 policy_version=policy_version, top_logprobs=tops, finish_reason=choice.get("finish_reason"),
                 stop_reason=choice.get("stop_reason"))
