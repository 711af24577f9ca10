"""Faster decode steps: torch.compile (inductor) on the CPU, CUDA graphs per batch bucket on a GPU.

Both are warmed up when the forward is created, so no stream waits for a compilation, and both
fall back to the eager step with a log line when they fail.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch
import torch.fx.experimental._config as fx_config

from streaming_backend.forward.buckets import (
    MIN_WINDOW,
    batch_buckets,
    batch_for,
    window_buckets,
)
from streaming_backend.forward.layers import masked_layer
from streaming_backend.forward.llama import CompactLlama, LayerCache, Rows
from streaming_backend.forward.slots import SlotCache
from streaming_backend.paths import cache_dir

log = logging.getLogger(__name__)


RowsFor = Callable[[int], Rows]  # batch size -> decode rows that touch only the scratch slot


def _cloned(rows: Rows) -> Rows:
    """Rows that own their memory (graph input buffers must not alias each other)."""
    return Rows(*(t.clone() for t in rows))


class EagerFallback:
    """Run a compiled step; on any failure log it once and run the eager step from then on."""

    def __init__(self, fast, eager: CompactLlama, what: str):
        self.fast, self.eager, self.what = fast, eager, what

    def __call__(self, k: LayerCache, v: LayerCache, rows: Rows, window: int) -> torch.Tensor:
        """The decode step: logits [B, V] fp32."""
        if self.fast is not None:
            try:
                return self.fast(k, v, rows, window)
            except Exception:  # a failed recompilation must not fail the streams
                log.exception("%s decode step failed; decoding eagerly from now on", self.what)
                self.fast = None  # the eager step rewrites the same positions: safe to redo
        return self.eager(k, v, rows, window)


def compile_decode(
    model: CompactLlama, cache: SlotCache, scratch_rows: RowsFor, backend="inductor"
):
    """torch.compile the decode step and warm it up -> (step, seconds), eager on failure.

    What is compiled is one decoder layer: every layer of the model shares its graph, so it
    compiles once (a whole-model graph took minutes longer on a 2-core CPU), and inductor's
    on-disk cache (TORCHINDUCTOR_CACHE_DIR) makes later starts faster.
    """
    # inductor's cache under ours (one folder to mount in a container), unless the user set one
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
    started = time.monotonic()
    try:
        step = CompiledStep(model, torch.compile(masked_layer, dynamic=True, backend=backend))
        with torch.inference_mode():
            for batch, window in warm_up_shapes(cache.max_len):
                step(cache.k, cache.v, scratch_rows(batch), window)
    except Exception as exc:
        log.warning("torch.compile of the decode step failed (%s); decoding eagerly", exc)
        return model, None
    seconds = time.monotonic() - started
    log.info("compiled the decode step in %.1f s", seconds)
    return EagerFallback(step, model, "compiled"), seconds


def warm_up_shapes(max_len: int) -> list[tuple[int, int]]:
    """(batch, window) pairs that produce every graph a decode step needs.

    Batch 1 and batch >= 2 are two graphs (size 1 is always specialised); a window equal to
    the cache length makes the window slice the whole dimension, which is a third case.
    """
    windows = sorted({min(MIN_WINDOW, max_len), min(2 * MIN_WINDOW, max_len), max_len})
    return [(batch, window) for batch in (1, 2) for window in windows]


class CompiledStep:
    """The model's forward with its decoder layer replaced by a compiled copy."""

    def __init__(self, model: CompactLlama, layer):
        self.model, self.layer = model, layer

    def __call__(self, k: LayerCache, v: LayerCache, rows: Rows, window: int) -> torch.Tensor:
        """The decode step: logits [B, V] fp32."""
        # Without this, sizes that happen to be equal at compile time (a window of 64 and a
        # hidden size of 64, a batch of 2 and 2 KV heads) are assumed equal forever, and every
        # later step where they differ recompiles.
        with fx_config.patch(use_duck_shape=False):
            return self.model(k, v, rows, window, layer=self.layer)


class CudaGraphDecode:
    """The decode step captured as one CUDA graph per (batch bucket, window): replay, no launches.

    UNRUN: written for CUDA, never executed (no GPU has run this code yet). Each graph reads its
    inputs from static buffers; a batch of B rows is copied into the smallest bucket that holds
    it, the remaining rows decode the scratch slot at position 0, and the first B rows of the
    graph's output are returned. All graphs share one memory pool.
    """

    def __init__(self, model: CompactLlama, cache: SlotCache, scratch_rows: RowsFor):
        self.model, self.cache = model, cache
        self.device = cache.device
        self.batches = batch_buckets(cache.slots)
        self.windows = window_buckets(cache.max_len)
        self.inputs = {b: _cloned(scratch_rows(b)) for b in self.batches}  # static buffers
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, batch: int, window: int) -> None:
        """Record the step for one bucket (after a warm-up run on a side stream, as CUDA needs)."""
        rows = self.inputs[batch]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), torch.inference_mode():
            self.model(self.cache.k, self.cache.v, rows, window)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool), torch.inference_mode():
            logits = self.model(self.cache.k, self.cache.v, rows, window)
        self.graphs[batch, window] = (graph, logits)

    def __call__(self, k: LayerCache, v: LayerCache, rows: Rows, window: int) -> torch.Tensor:
        """Copy the rows into the bucket's buffers, replay its graph -> logits [B, V] fp32."""
        if k is not self.cache.k or v is not self.cache.v:
            raise ValueError("a captured decode step only runs on the cache it was captured with")
        b = rows.tokens.shape[0]
        bucket = batch_for(b, self.batches)
        if (bucket, window) not in self.graphs:
            self.capture(bucket, window)
        static = self.inputs[bucket]
        for buffer, value in zip(static, rows):
            buffer[:b].copy_(value)
        static.write_slots[b:].fill_(self.cache.scratch)  # padding rows: scratch slot, position 0
        static.read_slots[b:].fill_(self.cache.scratch)
        static.positions[b:].zero_()
        static.tokens[b:].zero_()
        graph, logits = self.graphs[bucket, window]
        graph.replay()
        return logits[:b].clone()  # the graph overwrites its output on the next replay


def capture_all(step: CudaGraphDecode) -> float:
    """Capture every (batch bucket, window) graph now -> seconds taken. UNRUN (needs a GPU)."""
    started = time.monotonic()
    for batch in step.batches:
        for window in step.windows:
            step.capture(batch, window)
    torch.cuda.synchronize(step.device)
    seconds = time.monotonic() - started
    log.info("captured %d CUDA graphs of the decode step in %.1f s", len(step.graphs), seconds)
    return seconds


def graph_decode(model: CompactLlama, cache: SlotCache, scratch_rows: RowsFor):
    """CUDA-graphed decode step, every bucket captured now -> (step, seconds); eager on failure."""
    try:
        step = CudaGraphDecode(model, cache, scratch_rows)
        seconds = capture_all(step)
    except Exception as exc:
        log.warning("capturing the decode step as CUDA graphs failed (%s); decoding eagerly", exc)
        return model, None
    return EagerFallback(step, model, "CUDA-graphed"), seconds
