"""Request validation and response shape of /v1/completions, without a server."""

from __future__ import annotations

import pytest

from collectors.embedded.engine import Completion
from collectors.embedded.protocol import RequestError, check_prompt, completion_response, parse_completion_request
from collectors.policy import SamplingParams

# vLLM's CompletionResponseChoice fields (vllm/entrypoints/openai/completion/protocol.py) we emit
VLLM_CHOICE_FIELDS = {"index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids", "prompt_logprobs",
                      "prompt_token_ids", "weight_versions",  # as vLLM's /inference/v1/generate choices
                      "routed_experts"}  # routed_experts: null unless a MoE model (vLLM 0.32's)


def test_defaults_are_vllms() -> None:
    job = parse_completion_request({"prompt": [1, 2, 3]})
    assert job.params == SamplingParams(max_tokens=16, temperature=1.0, top_p=1.0, top_k=0)
    assert job.return_token_ids is False and job.prompt == [1, 2, 3]
    assert parse_completion_request({"prompt": "x", "top_k": -1, "stop": "\n"}).params.stop == ("\n",)


def test_every_problem_is_reported_naming_the_first_field() -> None:
    with pytest.raises(RequestError) as err:
        parse_completion_request({"prompt": [1], "max_tokens": True, "temperature": "hot", "logprobs": 21,
                                  "seed": 2**64, "stop": [""], "return_token_ids": "yes"})
    message = err.value.message
    for fragment in ("`max_tokens` must be an integer >= 1, got True", "`temperature` must be a finite number >= 0",
                     "`logprobs` must be an integer from 0 to 20", "`seed` must be a 64-bit integer",
                     "`stop` must be", "`return_token_ids` must be true or false"):
        assert fragment in message
    assert err.value.param == "max_tokens" and err.value.status == 400


@pytest.mark.parametrize(("body", "param", "fragment"), [
    ({}, "prompt", "`prompt` is required"),
    ({"prompt": ""}, "prompt", "empty string"),
    ({"prompt": [[1, 2], [3]]}, "prompt", "one request per prompt"),
    ({"prompt": [1, -2]}, "prompt", ">= 0"),
    ({"prompt": [1], "n": 2}, "n", "one request per sample"),
    ({"prompt": [1], "stream": "yes"}, "stream", "true or false"),
    ({"prompt": [1], "echo": True}, "echo", "prompt_token_ids"),
])
def test_refusals_say_what_to_send(body: dict, param: str, fragment: str) -> None:
    with pytest.raises(RequestError) as err:
        parse_completion_request(body)
    assert err.value.param == param and fragment in err.value.message


def test_prompt_checks_against_the_model() -> None:
    params = SamplingParams(max_tokens=10)
    check_prompt([1, 2], params, vocab_size=100, max_model_len=12)
    with pytest.raises(RequestError, match="maximum context length is 12 tokens.*13 tokens \\(3 in the prompt"):
        check_prompt([1, 2, 3], params, vocab_size=100, max_model_len=12)
    with pytest.raises(RequestError, match="token id 100 is out of vocabulary"):
        check_prompt([100], params, vocab_size=100, max_model_len=50)


def test_response_has_vllms_fields_and_clamps_logprobs() -> None:
    job = parse_completion_request({"prompt": [5], "logprobs": 1, "return_token_ids": True})
    result = Completion(prompt_ids=[5], output_ids=[7, 8], logprobs=[-0.5, float("-inf")],
                        top_logprobs=[[(7, -0.5)], [(9, -0.1)]], text="ab", finish_reason="length", stop_reason=None,
                        policy_version=3)
    body = completion_response(job, result, model_name="m", decode_one=lambda t: "abcdefghij"[t - 5 if t < 15 else 0])
    choice = body["choices"][0]
    assert set(choice) == VLLM_CHOICE_FIELDS
    assert choice["token_ids"] == [7, 8] and choice["prompt_token_ids"] == [5]
    assert choice["logprobs"] == {"text_offset": [0, 1], "token_logprobs": [-0.5, -9999.0], "tokens": ["c", "d"],
                                  "top_logprobs": [{"c": -0.5}, {"d": -9999.0, "e": -0.1}]}
    assert body["usage"] == {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    assert choice["weight_versions"] == [{"version": "3", "start": 0, "end": 2}]
    assert body["object"] == "text_completion" and body["policy_version"] == 3
