"""Merging and selecting rows of a left-padded KV batch keeps every row's tensors intact."""

from __future__ import annotations

import torch

from collectors.embedded import kv_batch


def rows(lengths: list[int], width: int, seed: int) -> tuple[kv_batch.Layers, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for r, n in enumerate(lengths):
        mask[r, width - n:] = 1
    layers = [(torch.randn(len(lengths), 2, width, 4, generator=g), torch.randn(len(lengths), 2, width, 4, generator=g))
              for _ in range(2)]
    return kv_batch.clean_prefill(layers, mask), mask


def real(layers: kv_batch.Layers, mask: torch.Tensor, r: int) -> list[torch.Tensor]:
    """Row r's keys and values at its real positions."""
    keep = mask[r].bool()
    return [t[r][:, keep] for pair in layers for t in pair]


def test_padding_is_zeroed_even_if_it_was_nan() -> None:
    mask = torch.tensor([[0, 1, 1]])
    nan = torch.full((1, 1, 3, 2), float("nan"))
    (k, v), = kv_batch.clean_prefill([(nan.clone(), nan.clone())], mask)
    assert (k[0, 0, 0] == 0).all() and torch.isnan(k[0, 0, 1:]).all()


def test_merge_then_select_keeps_rows_and_cuts_shared_padding() -> None:
    a, a_mask = rows([5, 2], width=5, seed=0)
    b, b_mask = rows([8, 1, 3], width=8, seed=1)
    merged, mask = kv_batch.merge(a, a_mask, b, b_mask)
    assert mask.shape == (5, 8) and mask.sum(1).tolist() == [5, 2, 8, 1, 3]
    for r in range(2):
        assert all(torch.equal(x, y) for x, y in zip(real(merged, mask, r), real(a, a_mask, r)))
    for r in range(3):
        assert all(torch.equal(x, y) for x, y in zip(real(merged, mask, r + 2), real(b, b_mask, r)))
    kept, kept_mask = kv_batch.select(merged, mask, [1, 4])  # the 8-long row leaves: width shrinks to 3
    assert kept_mask.shape == (2, 3) and kept_mask.sum(1).tolist() == [2, 3]
    assert kept[0][0].shape == (2, 2, 3, 4)
    assert all(torch.equal(x, y) for x, y in zip(real(kept, kept_mask, 1), real(b, b_mask, 2)))
