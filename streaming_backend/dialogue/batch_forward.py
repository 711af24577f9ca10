"""The forwards a batch of the dialogue model runs on: its prompts prefilled into per-row model
state (a `batch.RowState`) that then steps one token per row and forks rows for beam search.

`CompactBatchForward`: the compact Llama-family forward on a slot cache sized to the batch (one
slot per row; a beam with two children is a copied slot). `HfBatchForward`: Hugging Face's
forward on a left-padded DynamicCache, any causal LM. `build_batch_forward` picks one as the
chat model's engine does (`forward` auto, compact or hf).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from streaming_backend.batch import CacheRows, Prefill, RowState, SlotRows
from streaming_backend.forward_choice import fall_back
from streaming_backend.model.loading import LoadedModel, resolve_quantize
from streaming_backend.steps.hf import HfForward


class BatchForward(Protocol):
    """Prefills a batch of prompts; the state it returns steps the rows from there."""

    name: str

    def prefill(
        self, prompts: Sequence[Sequence[int]], rows: int, length: int
    ) -> tuple[RowState, torch.Tensor]:
        """State of one row per prompt (room for `rows` rows of `length` positions) and the
        next-token logits [N, V] fp32."""
        ...


class HfBatchForward:
    """Hugging Face's forward: left-padded prompts in one DynamicCache."""

    name = "hf"

    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.model = HfForward(loaded)  # the chat model's Hugging Face step too

    def prefill(self, prompts, rows, length):
        cache, logits, positions = self.model.prefill(prompts)
        state = CacheRows(self.model.step)
        state.extend(Prefill(cache, positions))
        return state, logits


class CompactBatchForward:
    """The compact forward on a slot cache grown to the largest batch seen (rows x positions)."""

    name = "compact"

    def __init__(self, loaded: LoadedModel, quantize: str = "none"):
        from streaming_backend.forward.llama import CompactLlama

        self.loaded = loaded
        # UnsupportedModel if not Llama-family
        self.model = CompactLlama(loaded.model, quantize)
        self._cache = None

    def prefill(self, prompts, rows, length):
        from streaming_backend.forward.runner import PromptChunk, SlotForward

        forward = SlotForward(self.model, self._cache_for(rows, length), self.loaded.device)
        slots = [forward.cache.allocate() for _ in prompts]
        try:
            logits = forward.prefill([PromptChunk(s, list(p)) for s, p in zip(slots, prompts)])
        except BaseException:
            for slot in slots:
                forward.cache.free(slot)
            raise
        state = SlotRows(forward, owns_slots=True)
        state.extend(slots)
        return state, logits

    def _cache_for(self, rows: int, length: int):
        """An empty slot cache of at least `rows` slots of `length` positions; reused while big
        enough (stale keys stay finite and are masked)."""
        from streaming_backend.forward.slots import SlotCache

        cache = self._cache
        if cache is None or cache.slots < rows or cache.max_len < length:
            slots = max(rows, cache.slots if cache else 0)
            positions = max(length, cache.max_len if cache else 0)
            self._cache = None  # the old one's memory goes before the new one is allocated
            cache = SlotCache(
                self.model.shape, slots, positions, self.loaded.dtype, self.loaded.device
            )
            self._cache = cache
        else:
            cache.reset()  # a failed batch may have left slots held
        return cache


def build_batch_forward(
    loaded: LoadedModel, forward: str = "auto", quantize: str = "none"
) -> BatchForward:
    """The compact forward when asked for or possible ("auto"), else Hugging Face's (which
    takes no quantization)."""
    if forward == "hf":
        return HfBatchForward(loaded)
    from streaming_backend.forward.llama import UnsupportedModel

    try:
        return CompactBatchForward(loaded, resolve_quantize(quantize, loaded))
    except UnsupportedModel as exc:
        fall_back(exc, forward)  # raises for forward compact
        return HfBatchForward(loaded)
