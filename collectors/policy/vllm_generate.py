"""vLLM's token-in / token-out route, `POST /inference/v1/generate`: request body, and its answers read as completions.

`VLLMClient` samples through this route when it (or another collector) reloads full weights,
because only this route returns `weight_versions`: per choice, the spans of output tokens each
weight-version label sampled (vllm/entrypoints/scale_out/token_in_token_out/protocol.py,
`GenerateRequest`, `GenerateTextChoice`, `GenerateTextStreamChoice`; vLLM 0.32). The server must
be started with `--enable-scale-out` (else the route answers 403, which `SCALE_OUT_HINT` explains).

The request carries the prompt as `token_ids` and vLLM's own `SamplingParams` as `sampling_params`
(the fields `completion_body` sends, same names); `output_mode: "text"` makes the answer carry the
detokenized text beside `token_ids`, with logprobs in the chat shape (`logprobs.content[i].logprob`,
`top_logprobs` a list of {token, logprob}). `as_completion_choice` rewrites one such choice into the
`/v1/completions` choice `collectors.policy.http` parses, so both routes are checked by one parser.
`cache_salt` keys vLLM's prefix cache by the policy version the client knows: after a reload, a new
request never reuses keys and values computed by older weights (a reset of the prefix cache cannot
run while the requests kept across the reload hold their blocks).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from collectors.policy.contract import SamplingParams
from collectors.policy.http import completion_body

ROUTE = "/inference/v1/generate"
SCALE_OUT_HINT = ("vLLM serves POST /inference/v1/generate (the route that returns each token's weight version) "
                  "only when started with --enable-scale-out; `collectors.policy.vllm_server.start_vllm` does")


def generate_body(prompt_ids: Sequence[int], sampling: SamplingParams, model: str | None, version: int,
                  stream: bool = False, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The generate request for one token-id prompt, its prefix cache keyed by `version`.

    `extra` carries fields of the request the caller got from vLLM's render route
    (`collectors.proxy.vllm_render`): in `sampling_params`, the structured-output constraint vLLM
    derives from a request's `tool_choice` (`required` or a named function) or its
    `structured_outputs`, which `SamplingParams` cannot express; beside it `reasoning_ended` and
    `reasoning_parser_kwargs`, which tell the engine from which token on the constraint applies.
    `SamplingParams` wins for every sampling field both set."""
    extra = dict(extra or {})
    params = {**extra.pop("sampling_params", {}), **completion_body(prompt_ids, sampling, None)}
    for name in ("prompt", "return_token_ids"):
        params.pop(name)
    body: dict[str, Any] = {**extra, "token_ids": prompt_ids, "sampling_params": params, "output_mode": "text",
                            "return_token_ids": True, "cache_salt": f"trajstore-policy-v{version}",
                            "stream": stream}
    if model is not None:
        body["model"] = model
    return body


def as_completion_choice(choice: Any) -> Any:
    """A generate choice (text mode) as the `/v1/completions` choice it stands for; anything else unchanged."""
    if not isinstance(choice, dict):
        return choice
    out = dict(choice)
    lp = choice.get("logprobs")
    content = lp.get("content") if isinstance(lp, dict) else None
    if isinstance(content, list) and all(isinstance(c, dict) for c in content):
        out["logprobs"] = {
            "token_logprobs": [c.get("logprob") for c in content],
            # as /v1/completions has them: the sampled token, then the top alternatives
            "top_logprobs": [{str(c.get("token")): c.get("logprob"),
                              **{str(t.get("token")): t.get("logprob") for t in c.get("top_logprobs") or []
                                 if isinstance(t, dict)}} for c in content]}
    return out


def as_completion(body: Any) -> Any:
    """A generate answer (or stream event) with its choices as completion choices."""
    if not isinstance(body, dict) or not isinstance(body.get("choices"), list):
        return body
    choices = [as_completion_choice(c) for c in body["choices"]]
    echoed = body.get("prompt_token_ids")  # the generate route echoes the prompt beside the choices
    if echoed is not None and choices and isinstance(choices[0], dict):
        choices[0] = {**choices[0], "prompt_token_ids": echoed}
    return {**body, "choices": choices}
