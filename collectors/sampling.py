"""Per-row sampling for the embedded server: processed logprobs, seeded draws, stop checks.

Pure tensor and string functions, no model and no I/O, so each is tested on its own.

Why not transformers' `generate` / logits processors: they apply one configuration to a whole
batch, while every row of a server batch has its own temperature, top-k, top-p and seed, and
RL needs the log-probability of the distribution each token was actually drawn from
(vLLM's `--logprobs-mode processed_logprobs`), which `generate` does not return.

Semantics follow vLLM's sampler so that a collector sees the same numbers from either server:
- logits are divided by the temperature, then top-k, then top-p (nucleus) mask the rest to
  -inf; the processed log-probabilities are the log-softmax of the result;
- temperature 0 means greedy: the argmax of the processed distribution, computed with
  temperature 1 (as vLLM does), and the reported logprob is that distribution's;
- top_k 0 (or vLLM's -1) and top_p 1 switch those filters off; top-k keeps ties at the k-th
  value; top-p keeps the smallest set of tokens whose mass reaches p, at least one token;
- a random draw is an exponential race (argmax of p / Exp(1) noise), the same categorical
  draw vLLM makes, with the noise taken from the row's own `torch.Generator`: a request's
  tokens depend on its seed and its logits only, not on what else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the sampler; validated by the HTTP layer."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # how many top alternatives to report per token (the sampled one always is)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


def processed_logprobs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                       top_p: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of the distribution each row samples from.

    logits (B, V) float32; temperature (B,) float; top_k (B,) long, 0 = off; top_p (B,) float.
    Returns (B, V) float32 with -inf on tokens that top-k / top-p exclude.
    """
    vocab = logits.shape[-1]
    temperature = torch.where(temperature < SAMPLING_EPS, torch.ones_like(temperature), temperature)
    x = logits.float() / temperature.unsqueeze(1)
    use_k, use_p = bool((top_k > 0).any()), bool((top_p < 1.0).any())
    if use_k or use_p:
        ordered, order = x.sort(dim=-1, descending=False)  # (B, V) ascending
        if use_k:
            k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
            kth = ordered.gather(1, (vocab - k).unsqueeze(1))  # the k-th largest value of each row
            ordered = ordered.masked_fill(ordered < kth, float("-inf"))
        if use_p:
            cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
            drop = cumulative <= (1.0 - top_p).unsqueeze(1)
            drop[:, -1] = False  # the most likely token always stays
            ordered = ordered.masked_fill(drop, float("-inf"))
        x = torch.empty_like(x).scatter_(1, order, ordered)
    return torch.log_softmax(x, dim=-1)


def sample(logprobs: torch.Tensor, greedy: list[bool], generators: list[torch.Generator | None]) -> torch.Tensor:
    """Draw one token per row of processed logprobs (B, V); returns ids (B,) long.

    Greedy rows take the argmax; the others race Exp(1) noise drawn from their own generator.
    """
    ids = logprobs.argmax(dim=-1)
    random_rows = [i for i, g in enumerate(greedy) if not g]
    if random_rows:
        noise = torch.empty((len(random_rows), logprobs.shape[-1]), device=logprobs.device, dtype=torch.float32)
        for j, row in enumerate(random_rows):
            noise[j].exponential_(generator=generators[row])
        rows = torch.tensor(random_rows, device=logprobs.device)
        # argmax p/q == argmax (log p - log q); q is clamped so an exact 0 draw cannot give inf - inf
        race = logprobs[rows] - noise.clamp_(min=1e-30).log()
        ids[rows] = race.argmax(dim=-1)
    return ids


def make_generator(seed: int | None, device: torch.device, fallback: int) -> torch.Generator:
    """The row's private random stream: its seed, or `fallback` (fresh per unseeded request)."""
    generator = torch.Generator(device=device)
    generator.manual_seed((seed if seed is not None else fallback) & 0xFFFF_FFFF_FFFF_FFFF)
    return generator


def find_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest stop string in `text` as (index, stop), or None."""
    found = [(i, s) for s in stops if (i := text.find(s)) >= 0]
    return min(found, key=lambda f: (f[0], -len(f[1]))) if found else None
