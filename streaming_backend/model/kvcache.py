"""The running batch's KV cache: left-padded rows that can be merged, dropped and trimmed.

Everything that touches transformers' cache internals lives here. Rows are left-padded to one
length L; `mask` [B, L] marks real positions (1) and padding (0), so a stream's attention sees
exactly its own tokens whatever other streams share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache


@dataclass
class BatchCache:
    """A KV cache for B rows and its attention mask [B, L]."""

    cache: DynamicCache
    mask: torch.Tensor  # [B, L] long

    @property
    def rows(self) -> int:
        """Number of streams in the batch."""
        return self.mask.shape[0]


def _layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per layer, each [B, heads, L, head_dim]."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def _build(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    cache = DynamicCache()
    for index, (keys, values) in enumerate(layers):
        cache.update(keys, values, index)
    return cache


def _pad_left(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    missing = length - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def merge(a: BatchCache | None, b: BatchCache) -> BatchCache:
    """Append b's rows after a's, left-padding the shorter to the longer length."""
    if a is None or a.rows == 0:
        return b
    length = max(a.mask.shape[1], b.mask.shape[1])
    layers = [
        (
            torch.cat([_pad_left(ka, length, 2), _pad_left(kb, length, 2)]),
            torch.cat([_pad_left(va, length, 2), _pad_left(vb, length, 2)]),
        )
        for (ka, va), (kb, vb) in zip(_layers(a.cache), _layers(b.cache))
    ]
    mask = torch.cat([_pad_left(a.mask, length, 1), _pad_left(b.mask, length, 1)])
    return BatchCache(_build(layers), mask)


def select(batch: BatchCache, keep: list[int]) -> BatchCache | None:
    """Keep only the rows `keep` (in that order); drop columns that became padding everywhere."""
    if not keep:
        return None
    index = torch.tensor(keep, device=batch.mask.device)
    mask = batch.mask[index]
    real_columns = mask.any(dim=0).nonzero()
    start = int(real_columns[0]) if len(real_columns) else mask.shape[1]
    layers = [(k[index, :, start:], v[index, :, start:]) for k, v in _layers(batch.cache)]
    return BatchCache(_build(layers), mask[:, start:].contiguous())
