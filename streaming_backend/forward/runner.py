"""The engine's entry points to the compact forward: prefill chunks and decode steps on slots.

    fwd = SlotForward.create(loaded, ForwardConfig(budget=CacheBudget(fraction=0.5)))
    slot = fwd.cache.allocate()
    logits = fwd.prefill([PromptChunk(slot, prompt_ids)])        # [1, V] fp32, next-token logits
    logits = fwd.decode([slot], [next_id])                  # host ids, one per slot
    fwd.cache.free(slot)

A chunk is written at its slot's next free positions, so a long prompt can be prefilled in
several chunks, and a slot whose first N positions were filled otherwise (a prefix cache:
`cache.copy_prefix(source, slot, N)`) just has `cache.lengths[slot] == N` before its first chunk.
Where the cache keeps sliding-window layers as rings, a chunk longer than the ring's spare
(`cache.chunk_limit`) is run as several calls, in order: each token's numbers are its own
whatever shares its call, so the logits are the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from streaming_backend.forward.buckets import window_for
from streaming_backend.forward.llama import CompactLlama, LayerCache, Rows, Span
from streaming_backend.forward.quant import check_kind, check_matmul
from streaming_backend.forward.slots import WINDOW_CHUNK, CacheBudget, SlotCache
from streaming_backend.model.loading import LoadedModel


@dataclass(frozen=True)
class ForwardConfig:
    """How the compact forward runs."""

    budget: CacheBudget = field(default_factory=lambda: CacheBudget(fraction=0.5))
    max_len: int | None = None  # positions per slot; None = the model's context length
    max_slots: int | None = None  # at most this many slots even when the budget holds more
    # torch.compile the decode step (eager with a log line on failure). Off by default: on the
    # shared 2-core CPU it compiled in 0.5-5 min, was slower than eager at batch 1 and only
    # sometimes faster at batch 16 (scripts/forward_bench.py); on where a measurement says so.
    compile: bool = False
    # On CUDA: capture the decode step as CUDA graphs per batch-size bucket. Off here; the engine
    # (steps/build.py) turns it on with `compile` on a GPU. No GPU has run this path yet.
    cuda_graphs: bool = False
    # The linear weights' format: "none", "int8" or "int4" (forward/quant.py;
    # scripts/quant_quality.py checks greedy agreement and perplexity).
    quantize: str = "none"
    # What runs quantized weights: "auto" (our C kernels where they build, else torch's) or
    # "aten" (torch's weight-only kernels; scripts/forward_bench.py's -aten systems compare)
    matmul: str = "auto"
    # A sliding-window layer keeps window + window_chunk - 1 positions per slot (a ring), and a
    # prefill call writes at most window_chunk per slot (forward/slots.py, WINDOW_CHUNK)
    window_chunk: int = WINDOW_CHUNK
    # The CPU weights in transparent huge pages where the kernel gives them on request
    # (forward/huge_pages.py); off only to measure what they bring (scripts/forward_bench.py)
    huge_pages: bool = True
    # The KV cache's dtype: "auto", "float32" or "bfloat16" (cache_dtype below)
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        check_kind(self.quantize)
        check_matmul(self.matmul)


class PromptChunk(NamedTuple):
    """Prompt tokens to append to a slot, at positions lengths[slot], lengths[slot] + 1, ..."""

    slot: int
    tokens: Sequence[int]


DecodeFn = Callable[[LayerCache, LayerCache, Rows, int], torch.Tensor]


def cache_positions(loaded: LoadedModel, config: ForwardConfig, model: CompactLlama) -> int:
    """Positions per slot of the model's KV cache: config.max_len, else its context."""
    return min(config.max_len or loaded.context_length, model.shape.max_positions)


KV_CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def cache_dtype(config: ForwardConfig, dtype: torch.dtype, model: CompactLlama) -> torch.dtype:
    """The KV cache's dtype for a model computing in `dtype` on `model`: config.kv_cache_dtype,
    where "auto" is bfloat16 for a float32 model whose every step reads the cache through the
    C attention kernels (native layers, no compiled step), else `dtype`. Those kernels take
    float32 or bfloat16 keys and values under float32 queries, so a bfloat16 cache halves the
    bytes a step reads (at 16 rows after 512 prompt tokens, half the step), for keys and values
    rounded once to bfloat16 as they are written, the same for every row and load. ValueError for
    another dtype than the model's where torch's attention reads the cache."""
    on_kernels = model.native and not (config.compile or config.cuda_graphs)
    if config.kv_cache_dtype == "auto":
        return torch.bfloat16 if on_kernels and dtype == torch.float32 else dtype
    if config.kv_cache_dtype not in KV_CACHE_DTYPES:
        choices = ", ".join(("auto", *KV_CACHE_DTYPES))
        raise ValueError(f"kv_cache_dtype must be one of {choices}, not {config.kv_cache_dtype!r}")
    chosen = KV_CACHE_DTYPES[config.kv_cache_dtype]
    if chosen != dtype and not on_kernels:
        raise ValueError(
            f"kv_cache_dtype {config.kv_cache_dtype}: a KV cache in another dtype than the "
            f"model's ({str(dtype).removeprefix('torch.')}) needs the C attention kernels (the "
            f"compact forward on a CPU, not compiled); here torch's attention reads the cache: "
            f"use kv_cache_dtype auto"
        )
    return chosen


class SlotForward:
    """A compact Llama forward bound to its slot cache, with a compiled or graphed decode step."""

    def __init__(self, model: CompactLlama, cache: SlotCache, device: torch.device):
        self.model = model
        self.cache = cache
        self.device = device
        self._decode_fn: DecodeFn = model  # replaced by a compiled or graphed step at setup
        self._zeros = torch.zeros(cache.slots + 1, dtype=torch.long, device=device)
        self.compile_seconds: float | None = None

    @classmethod
    def create(
        cls, loaded: LoadedModel, config: ForwardConfig, model: CompactLlama | None = None
    ) -> SlotForward:
        """Build the forward for a loaded model (UnsupportedModel if not Llama-family), or for
        its compact `model` already built (a new cache for it)."""
        model = model or CompactLlama(
            loaded.model, config.quantize, config.matmul, huge_pages=config.huge_pages
        )
        cache = SlotCache.for_budget(
            model.shape,
            cache_positions(loaded, config, model),
            cache_dtype(config, loaded.dtype, model),
            loaded.device,
            config.budget,
            config.max_slots,
            config.window_chunk,
        )
        forward = cls(model, cache, loaded.device)
        forward._set_up_decode(config)
        return forward

    def _set_up_decode(self, config: ForwardConfig) -> None:
        """Pick the fastest decode step that works here, warmed up now rather than mid-stream."""
        from streaming_backend.forward import compiled

        if self.device.type == "cuda" and config.cuda_graphs:
            self._decode_fn, self.compile_seconds = compiled.graph_decode(
                self.model, self.cache, self.scratch_rows
            )
        elif config.compile:
            self._decode_fn, self.compile_seconds = compiled.compile_decode(
                self.model, self.cache, self.scratch_rows
            )

    @torch.inference_mode()
    def prefill(self, chunks: Sequence[PromptChunk]) -> torch.Tensor:
        """Append each chunk to its slot; return the logits [N, V] (fp32) after its last token."""
        if not chunks:
            raise ValueError("prefill needs at least one chunk")
        _check_distinct([c.slot for c in chunks])
        for chunk in chunks:
            if not chunk.tokens:
                raise ValueError(f"empty prefill chunk for slot {chunk.slot}")
            self.cache.check_room(chunk.slot, len(chunk.tokens))
        limit = self.cache.chunk_limit
        if limit is None or all(len(c.tokens) <= limit for c in chunks):
            return self._prefill(chunks)
        return self._prefill_in_pieces(chunks, limit)

    def _prefill_in_pieces(self, chunks: Sequence[PromptChunk], limit: int) -> torch.Tensor:
        """`prefill` as calls of at most `limit` tokens per slot, in order (a ring's spare)."""
        logits: list[torch.Tensor] = [torch.empty(0)] * len(chunks)
        for done in range(0, max(len(c.tokens) for c in chunks), limit):
            rows = [r for r, c in enumerate(chunks) if len(c.tokens) > done]
            pieces = [
                PromptChunk(chunks[r].slot, chunks[r].tokens[done : done + limit]) for r in rows
            ]
            for row, out in zip(rows, self._prefill(pieces)):
                logits[row] = out
        return torch.stack(logits)

    def _prefill(self, chunks: Sequence[PromptChunk]) -> torch.Tensor:
        """`prefill` in one call (the chunks checked, each within the cache's chunk_limit)."""
        starts = [self.cache.lengths[c.slot] for c in chunks]
        rows = self._prefill_rows(chunks, starts)
        logits = self.model(self.cache.k, self.cache.v, rows, 0, spans=self._spans(chunks, starts))
        for start, chunk in zip(starts, chunks):
            self.cache.lengths[chunk.slot] = start + len(chunk.tokens)
        return logits

    @torch.inference_mode()
    def score(self, chunk: PromptChunk) -> torch.Tensor:
        """Prefill one chunk; return the logits [T, V] (fp32) after each of its tokens
        (teacher-forced checks: what the model would pick at every position)."""
        if not chunk.tokens:
            raise ValueError(f"empty prefill chunk for slot {chunk.slot}")
        self.cache.check_room(chunk.slot, len(chunk.tokens))
        limit = self.cache.chunk_limit or len(chunk.tokens)
        pieces = [chunk.tokens[at : at + limit] for at in range(0, len(chunk.tokens), limit)]
        return torch.cat([self._score(PromptChunk(chunk.slot, piece)) for piece in pieces])

    def _score(self, chunk: PromptChunk) -> torch.Tensor:
        """`score` in one call."""
        start = self.cache.lengths[chunk.slot]
        rows = self._prefill_rows([chunk], [start])
        spans = self._spans([chunk], [start])
        logits = self.model.score(self.cache.k, self.cache.v, rows, spans)[0]
        self.cache.lengths[chunk.slot] = start + len(chunk.tokens)
        return logits

    def _spans(self, chunks: Sequence[PromptChunk], starts: list[int]) -> list[Span]:
        """Each chunk's place in the cache and positions (host ints)."""
        return [
            Span(self.cache.physical[c.slot], start, len(c.tokens))
            for start, c in zip(starts, chunks)
        ]

    def _prefill_rows(self, chunks: Sequence[PromptChunk], starts: list[int]) -> Rows:
        """Right-padded rows [N, T]; padding tokens write to the scratch slot at position 0."""
        n, t = len(chunks), max(len(c.tokens) for c in chunks)
        tokens = torch.zeros((n, t), dtype=torch.long)
        positions = torch.zeros((n, t), dtype=torch.long)
        write_slots = torch.full((n, t), self.cache.scratch, dtype=torch.long)
        for row, (start, chunk) in enumerate(zip(starts, chunks)):
            size = len(chunk.tokens)
            tokens[row, :size] = torch.as_tensor(chunk.tokens, dtype=torch.long)
            positions[row, :size] = torch.arange(start, start + size)
            write_slots[row, :size] = self.cache.physical[chunk.slot]
        read_slots = torch.tensor([self.cache.physical[c.slot] for c in chunks], dtype=torch.long)
        last = torch.tensor([len(c.tokens) - 1 for c in chunks], dtype=torch.long)
        to = self.device
        return Rows(
            tokens.to(to), positions.to(to), write_slots.to(to), read_slots.to(to), last.to(to)
        )

    @torch.inference_mode()
    def decode(self, slots: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        """One new token per slot (host ids, one per slot); return logits [B, V] fp32."""
        if len(slots) != len(tokens):
            raise ValueError(f"{len(slots)} slots but {len(tokens)} tokens")
        _check_distinct(slots)
        lengths = [self.cache.lengths[s] for s in slots]
        for slot in slots:
            self.cache.check_room(slot, 1)
        if self._decode_fn is self.model:  # eager: each row attends over its own positions
            rows = [(self.cache.physical[s], length) for s, length in zip(slots, lengths)]
            index = torch.tensor([list(tokens), lengths], dtype=torch.long).to(self.device)
            logits = self.model.decode(self.cache.k, self.cache.v, index, rows)
        else:  # compiled or graphed (fixed shapes): each row's keys gathered, masked
            places = [self.cache.physical[s] for s in slots]
            index = self.decode_index(tokens, places, lengths)
            window = window_for(max(lengths) + 1, self.cache.max_len)
            logits = self._decode_fn(self.cache.k, self.cache.v, self.decode_rows(index), window)
        for slot in slots:
            self.cache.lengths[slot] += 1
        return logits

    @torch.inference_mode()
    def verify(self, slots: Sequence[int], tokens: Sequence[Sequence[int]]) -> torch.Tensor:
        """Append each slot's tokens (its latest token, then any drafted after it) at its next
        positions in one call; return the logits [sum of the counts, V] fp32 after every token,
        slot by slot: what decode steps of those tokens one at a time would give (each token
        attends over exactly its own positions, and a row's arithmetic does not depend on what
        shares its call). A rejected draft's keys and values are dropped by truncating the
        slot (`cache.truncate`)."""
        if len(slots) != len(tokens):
            raise ValueError(f"{len(slots)} slots but {len(tokens)} token lists")
        chunks = [PromptChunk(slot, list(t)) for slot, t in zip(slots, tokens)]
        _check_distinct(slots)
        limit = self.cache.chunk_limit
        for chunk in chunks:
            if not chunk.tokens:
                raise ValueError(f"no token to verify for slot {chunk.slot}")
            if limit is not None and len(chunk.tokens) > limit:
                raise ValueError(f"{len(chunk.tokens)} tokens exceed the rings' spare of {limit}")
            self.cache.check_room(chunk.slot, len(chunk.tokens))
        starts = [self.cache.lengths[c.slot] for c in chunks]
        rows = self._prefill_rows(chunks, starts)
        spans = self._spans(chunks, starts)
        x = self.model.hidden(self.cache.k, self.cache.v, rows, 0, spans=spans)  # [N, T, hidden]
        row_of = [r for r, c in enumerate(chunks) for _ in c.tokens]
        column = [i for c in chunks for i in range(len(c.tokens))]
        x = x[torch.tensor(row_of), torch.tensor(column)].contiguous()  # [M, hidden]
        for start, chunk in zip(starts, chunks):
            self.cache.lengths[chunk.slot] = start + len(chunk.tokens)
        return self.model.normed_logits(x)

    def decode_index(
        self, tokens: Sequence[int], slots: Sequence[int], lengths: Sequence[int]
    ) -> torch.Tensor:
        """[3, B] long on the device: tokens, slots, positions (the step's one host-to-device
        copy)."""
        return torch.tensor([list(tokens), list(slots), list(lengths)], dtype=torch.long).to(
            self.device
        )

    def decode_rows(self, index: torch.Tensor) -> Rows:
        """The Rows of a decode step from its index (also used to warm up: same strides, no
        recompilation)."""
        tokens, slots, positions = index
        last = self._zeros[: index.shape[1]]
        return Rows(tokens[:, None], positions[:, None], slots[:, None], slots, last)

    def scratch_rows(self, batch: int) -> Rows:
        """Decode rows of `batch` tokens that only touch the scratch slot (warm-up, padding)."""
        scratch = [self.cache.scratch] * batch
        return self.decode_rows(self.decode_index([0] * batch, scratch, [0] * batch))


def _check_distinct(slots: Sequence[int]) -> None:
    """A slot appears at most once per call (two rows would write the same positions)."""
    if len(set(slots)) != len(slots):
        raise ValueError(f"a slot appears twice in one step: {list(slots)}")
