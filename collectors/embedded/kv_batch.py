"""The running batch's KV cache as plain tensors: merge prefilled rows in, drop finished rows.

Every row is left-padded to one width T: per layer, keys and values (B, H, T, D); an
attention mask (B, T) with 0 on padding. A row's real tokens are right-aligned, so its next
position id is `mask.sum(-1)` and a decode step appends one column for everyone. Padding
keys and values are zero: a fully masked query row (a padding slot during prefill) can make
attention produce NaN there, and 0 * NaN would leak into real rows through the value matmul.

Pure tensor functions; the engine wraps the layers in transformers' `DynamicCache` for the
forward passes.
"""

from __future__ import annotations

import torch

Layers = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values (B, H, T, D)


def clean_prefill(layers: Layers, mask: torch.Tensor) -> Layers:
    """Zero the keys and values of padding slots (mask (B, T) == 0)."""
    pad = (mask == 0)[:, None, :, None]
    return [(k.masked_fill(pad, 0.0), v.masked_fill(pad, 0.0)) for k, v in layers]


def left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """Zero-pad `t` on the left of `dim` up to `width`."""
    missing = width - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([torch.zeros(shape, dtype=t.dtype, device=t.device), t], dim=dim)


def merge(a: Layers, a_mask: torch.Tensor, b: Layers, b_mask: torch.Tensor) -> tuple[Layers, torch.Tensor]:
    """Rows of `a` then rows of `b`, the narrower side left-padded to the wider one."""
    width = max(a_mask.shape[1], b_mask.shape[1])
    layers = [(torch.cat([left_pad(ak, width, 2), left_pad(bk, width, 2)]),
               torch.cat([left_pad(av, width, 2), left_pad(bv, width, 2)])) for (ak, av), (bk, bv) in zip(a, b)]
    return layers, torch.cat([left_pad(a_mask, width, 1), left_pad(b_mask, width, 1)])


def select(layers: Layers, mask: torch.Tensor, keep: list[int]) -> tuple[Layers, torch.Tensor]:
    """Only the rows `keep`, without the leading columns that are padding in all of them."""
    index = torch.tensor(keep, device=mask.device)
    mask = mask[index]
    start = int((mask.sum(dim=0) == 0).long().cumprod(0).sum())
    return [(k[index, :, start:], v[index, :, start:]) for k, v in layers], mask[:, start:]


def cache_layout(config: object) -> tuple[object, ...]:
    """What a model's cache looks like (layers, key/value heads, head size, layer types): two models with the
    same layout can continue each other's cache, as a hot reload between decode steps does."""
    text = getattr(config, "get_text_config", lambda: config)()
    heads = getattr(text, "num_attention_heads", None)
    head_dim = getattr(text, "head_dim", None) or (getattr(text, "hidden_size", 0) // (heads or 1))
    return (getattr(text, "num_hidden_layers", None), getattr(text, "num_key_value_heads", heads), head_dim,
            tuple(getattr(text, "layer_types", None) or ()), getattr(text, "sliding_window", None))
