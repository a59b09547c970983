"""Ground truth for "which weights sampled this": logprobs recomputed with transformers on a checkpoint.

vLLM's `--logprobs-mode processed_logprobs` reports the logprob of each sampled token under the
distribution it was drawn from: the logits divided by the temperature, then top-k applied and
renormalized. `recompute` does the same with transformers on the same float32 weights; on the
tiny models of the tests the two agree to 1e-6 (see tests/collectors/policy/test_vllm_real.py
for the measurement), so `MATCH` (1e-4) separates "these weights drew it" from "other weights
did" whenever the checkpoints differ by more than `DIFFER` per token on average.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path

import torch

from collectors.policy import Sample
from trajstore.versions import compact, expand

MATCH = 1e-4  # max |vLLM - transformers| per token for "these weights sampled it"
DIFFER = 5e-3  # mean |difference| per token that tells two checkpoints apart


def fresh_model(path: str | Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


@cache
def cached_model(path: str) -> torch.nn.Module:
    """One evaluation copy per checkpoint for the whole session (never trained)."""
    return fresh_model(path).eval()


def recompute(model: torch.nn.Module, sample: Sample, temperature: float = 1.0, top_k: int = 0) -> list[float]:
    """Logprobs of the sampled ids under `model`, processed as vLLM's sampler does (temperature, then top-k)."""
    return recompute_all(model, [sample], temperature, top_k)[0]


def recompute_all(model: torch.nn.Module, samples: Sequence[Sample], temperature: float = 1.0,
                  top_k: int = 0) -> list[list[float]]:
    """`recompute` for many samples, one forward pass per group of equally long ones."""
    out: dict[int, list[float]] = {}
    by_length: dict[tuple[int, int], list[int]] = {}
    for i, s in enumerate(samples):
        by_length.setdefault((len(s.prompt_ids), len(s.output_ids)), []).append(i)
    for (prompt_len, _), members in by_length.items():
        ids = torch.tensor([samples[i].prompt_ids + samples[i].output_ids for i in members])  # (B, L)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, prompt_len - 1:-1].float() / temperature  # (B, T, V)
        if top_k:
            kth = logits.topk(top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        targets = ids[:, prompt_len:, None]  # (B, T, 1)
        chosen = torch.log_softmax(logits, dim=-1).gather(2, targets)[..., 0]  # (B, T)
        out.update({i: row.tolist() for i, row in zip(members, chosen, strict=True)})
    return [out[i] for i in range(len(samples))]


def recompute_spans(models: Mapping[int, torch.nn.Module], sample: Sample, temperature: float = 1.0,
                    top_k: int = 0) -> list[float]:
    """Logprobs of the sampled ids, each under the version stamped on it, over the cache as the server kept it.

    A server that loads new weights between decode steps keeps the keys and values it already computed
    (vLLM's keep-mode pause; the embedded server). The position that predicts output token j is fed in
    the step that samples token j, under token j's version; the prompt is fed at once under the first
    token's version. So this feeds each version's positions in turn over one growing cache."""
    from transformers import DynamicCache

    versions = expand(sample.version_starts, sample.version_values, len(sample.output_ids), sample.policy_version)
    starts, values = compact(versions)
    ids = torch.tensor([sample.prompt_ids + sample.output_ids])  # (1, L)
    n_prompt, pieces = len(sample.prompt_ids), []
    cache = DynamicCache(config=models[values[0]].config)
    for k, (start, version) in enumerate(zip(starts, values)):
        end = starts[k + 1] if k + 1 < len(starts) else len(sample.output_ids)
        lo = 0 if start == 0 else n_prompt + start - 1  # positions fed under this version: [lo, hi)
        hi = n_prompt + end - 1
        positions = torch.arange(lo, hi).unsqueeze(0)
        with torch.no_grad():
            out = models[version](input_ids=ids[:, lo:hi], position_ids=positions, cache=cache, use_cache=True)
        cache = out.cache
        pieces.append(out.logits[0, (n_prompt - 1 if start == 0 else 0):])
    logits = torch.cat(pieces).float() / temperature  # (T, V): the logits that predicted each output token
    if top_k:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    targets = torch.tensor(sample.output_ids).unsqueeze(1)
    return torch.log_softmax(logits, dim=-1).gather(1, targets)[:, 0].tolist()


def max_diff(a: Sequence[float], b: Sequence[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


