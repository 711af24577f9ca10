"""The running batch: the streams stepped together and the per-row state that must stay aligned.

Row r of the batch is one stream: its KV cache row, its attention-mask row, its next position id
and its sampling parameters. Every change (rows added after a prefill, rows removed, one decode
step) goes through a method here, so the four never fall out of step.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch

from streaming_backend import kvcache, sampling
from streaming_backend.settings import SamplingSettings


class Row(Protocol):
    """What the batch needs of a stream: its sampling settings and its tokens so far."""

    settings: SamplingSettings
    output_ids: list[int]


R = TypeVar("R", bound=Row)


@dataclass(frozen=True)
class DecodeInputs:
    """The model inputs of one decode step for every row of the batch."""

    input_ids: torch.Tensor  # [B, 1] each row's latest token
    attention_mask: torch.Tensor  # [B, L + 1] the cache's mask plus the new token's column
    position_ids: torch.Tensor  # [B, 1] each row's next position


class RunningBatch(Generic[R]):
    """The live streams in row order with their cache, positions and sampling parameters."""

    def __init__(self) -> None:
        self.rows: list[R] = []
        self.cache: kvcache.BatchCache | None = None  # None while the batch is empty
        self.positions = torch.zeros(0, dtype=torch.long)  # [B] next position id per row
        self._params: sampling.BatchSampling | None = None  # built on first use after a change

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, rows: Sequence[R], cache: kvcache.BatchCache, positions: torch.Tensor) -> None:
        """Append prefilled streams: their cache rows, and positions [N] (their prompt lengths)."""
        if len(rows) != cache.rows or len(rows) != len(positions):
            sizes = (len(rows), cache.rows, len(positions))
            raise ValueError(f"rows, cache rows and positions differ: {sizes}")
        self.cache = kvcache.merge(self.cache, cache)
        self.positions = torch.cat([self.positions, positions.to(self.positions.device)])
        self.rows.extend(rows)
        self._params = None

    def remove(self, gone: Collection[R]) -> None:
        """Drop these streams' rows (compared by identity); the others keep their order."""
        ids = {id(row) for row in gone}
        keep = [r for r, row in enumerate(self.rows) if id(row) not in ids]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[r] for r in keep]
        self.positions = self.positions[keep]
        self.cache = kvcache.select(self.cache, keep) if self.cache is not None else None
        self._params = None

    def clear(self) -> list[R]:
        """Empty the batch (after a failed step); return the streams it held."""
        rows, self.rows, self.cache, self._params = self.rows, [], None, None
        self.positions = self.positions[:0]
        return rows

    def sampling_params(self, device: torch.device | str) -> sampling.BatchSampling:
        """The rows' sampling parameters as tensors, rebuilt only when the rows changed."""
        if self._params is None:
            self._params = sampling.BatchSampling.from_settings(
                [row.settings for row in self.rows], device
            )
        return self._params

    def decode_inputs(self, device: torch.device | str) -> DecodeInputs:
        """Each row's latest token at its next position; the mask grows by one real column."""
        mask = self.cache.mask
        last = torch.tensor([row.output_ids[-1] for row in self.rows], dtype=torch.long)
        return DecodeInputs(
            input_ids=last[:, None].to(device),
            attention_mask=torch.cat([mask, mask.new_ones((len(self.rows), 1))], dim=1),
            position_ids=self.positions[:, None].to(device),
        )

    def advance(self, inputs: DecodeInputs) -> None:
        """Record a decode step the model ran on `inputs` (its cache already holds the new keys)."""
        self.cache.mask = inputs.attention_mask
        self.positions = self.positions + 1
