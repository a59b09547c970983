"""The policy-server contract and its clients: token ids in, sampled ids, logprobs and version out.

`PolicyClient` (`contract`) is what every collector talks to; `EmbeddedClient` reaches the
embedded server (`trajstore serve`), `VLLMClient` a vLLM server. Both speak vLLM's
`/v1/completions` with token-id prompts (`http`) and raise the named `PolicyServerError`s.
"""

from collectors.policy.contract import (
    MAX_POLICY_VERSION,
    SAMPLING_EPS,
    SEED_MAX,
    SEED_MIN,
    TOP_K_MAX,
    Chunk,
    PolicyClient,
    PublishedLoader,
    Sample,
    SamplingParams,
    StreamedSample,
)
from collectors.policy.embedded_client import EmbeddedClient
from collectors.policy.http import (
    PolicyServerBadResponse,
    PolicyServerError,
    PolicyServerFailed,
    PolicyServerRejected,
    PolicyServerTimeout,
    PolicyServerUnreachable,
    completion_body,
    parse_chunk,
    parse_completion,
    server_message,
)
from collectors.policy.vllm_client import VLLMClient

__all__ = [
    "MAX_POLICY_VERSION", "SAMPLING_EPS", "SEED_MAX", "SEED_MIN", "TOP_K_MAX", "Chunk", "EmbeddedClient",
    "PolicyClient", "PolicyServerBadResponse", "PolicyServerError", "PolicyServerFailed", "PolicyServerRejected",
    "PolicyServerTimeout", "PolicyServerUnreachable", "PublishedLoader", "Sample", "SamplingParams", "StreamedSample",
    "VLLMClient", "completion_body", "parse_chunk", "parse_completion", "server_message",
]
