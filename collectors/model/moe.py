"""The mixture-of-experts variant of `trajstore init-model --moe`: a tiny Qwen3-MoE causal LM.

Every decoder layer is sparse (`decoder_sparse_step` 1, no dense layers), so the routes of a
token are one row of `experts_per_token` expert indices per layer, the `[layers, top_k]` that
vLLM's `routed_experts` and the embedded server's report per token. Qwen3-MoE is chosen because
transformers 5 and vLLM both implement it (`Qwen3MoeForCausalLM`), its router is a module of its
own (`Qwen3MoeTopKRouter`: softmax over the experts, top-k, renormalized), which is what the
embedded server records and the learner replays, and its attention takes an explicit head size
(vLLM's CPU attention needs 32 and up, as for the dense model).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel, Qwen3MoeConfig, Qwen3MoeForCausalLM


def moe_model(shape: dict[str, Any], experts: int, experts_per_token: int) -> PreTrainedModel:
    """A random-init Qwen3-MoE of `shape` (the dense model's config keys), float32, in eval mode.

    Each expert is as wide as the dense model's MLP (`intermediate_size`): a token's compute is
    `experts_per_token` times the dense model's, which a tiny model can afford."""
    config = Qwen3MoeConfig(**shape, head_dim=shape["hidden_size"] // shape["num_attention_heads"],
                            num_experts=experts, num_experts_per_tok=experts_per_token,
                            moe_intermediate_size=shape["intermediate_size"], decoder_sparse_step=1,
                            mlp_only_layers=[], norm_topk_prob=True, output_router_logits=False)
    return Qwen3MoeForCausalLM(config).to(torch.float32).eval()
