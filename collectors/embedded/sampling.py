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
- a random draw is an exact categorical draw from that distribution, with its randomness
  taken from the row's own `torch.Generator`: a request's tokens depend on its seed and its
  logits only, not on what else shares the batch. vLLM races the probabilities against
  Exp(1) noise, which needs one random number per vocabulary entry; here one uniform number
  per row is located in the row's cumulative distribution (inverse CDF), the same
  distribution at a fraction of the cost (on CPU the noise took longer than the model's
  forward pass). The cumulative sums are float64, so tokens down to ~1e-16 of the mass
  keep their chance, as with float64 noise.
"""

from __future__ import annotations

import torch

from collectors.policy.contract import SAMPLING_EPS


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


def kept_sets(logprobs: torch.Tensor, cap: int) -> list[tuple[int, list[int]]]:
    """Each row's kept set as (size, ids): the ids top-k / top-p left in the processed logprobs (B, V),
    ascending, or [] when the set holds more than `cap` ids (then it is the `size` most likely ones)."""
    kept = torch.isfinite(logprobs)
    counts = kept.sum(dim=-1).tolist()
    return [(m, kept[r].nonzero().squeeze(1).tolist() if m <= cap else []) for r, m in enumerate(counts)]


def sample(logprobs: torch.Tensor, greedy: list[bool], generators: list[torch.Generator | None]) -> torch.Tensor:
    """Draw one token per row of processed logprobs (B, V); returns ids (B,) long.

    Greedy rows take the argmax; the others draw by inverse CDF with one uniform number from
    their own generator.
    """
    ids = logprobs.argmax(dim=-1)
    random_rows = [i for i, g in enumerate(greedy) if not g]
    if random_rows:
        every = len(random_rows) == len(greedy)
        rows = None if every else torch.tensor(random_rows, device=logprobs.device)
        probs = (logprobs if rows is None else logprobs[rows]).exp()  # (R, V), 0 on excluded tokens
        cdf = probs.double().cumsum_(dim=-1)
        u = torch.empty((len(random_rows), 1), device=logprobs.device, dtype=torch.float64)
        for j, row in enumerate(random_rows):
            u[j].uniform_(generator=generators[row])
        # the first token whose cumulative mass exceeds u * total: never a zero-mass token, whose sum
        # equals its predecessor's; past the end only if u * total rounds up to the total itself
        drawn = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
        over = drawn == probs.shape[-1]
        if bool(over.any()):  # then take the last token with mass
            drawn[over] = probs.shape[-1] - 1 - (probs[over].flip(-1) > 0).to(torch.int8).argmax(dim=-1)
        if rows is None:
            return drawn
        ids[rows] = drawn
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
