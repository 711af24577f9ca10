"""The compact forward of a Llama-family model over a per-slot KV cache: CompactLlama, which runs
its weights (forward/convert.py) through the torch layers or the C ones (forward/layers.py).

One `forward` serves prefill and decode: N rows of T tokens each (decode is T = 1). Each token's
new keys and values are written into the cache at its position first, then it attends over its
slot's positions, so a slot's earlier positions (an earlier chunk, a reused prefix) are simply
part of what it attends to. `decode` is the eager step's fewer operations for rows of one token.
Where every linear weight runs on our C kernels, every layer does (native_layer, or the whole
stack in one C call: kernels.stack.DecoderStack); else torch's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from streaming_backend.forward.convert import (
    LINEAR_WEIGHTS,
    CompactWeights,
    all_tensors,
    compact_weights,
)
from streaming_backend.forward.family import NO_WINDOW, UnsupportedModel  # noqa: F401 (steps/)
from streaming_backend.forward.huge_pages import place as place_in_huge_pages
from streaming_backend.forward.layers import (
    decoder_layer,
    masked_layer,
    native_layer,
    rms_norm,
    rows_attention,
    tokens_attention,
)
from streaming_backend.forward.quant import kernel_name, linear, native_linear
from streaming_backend.kernels import stack
from streaming_backend.kernels.abi import DTYPES
from streaming_backend.kernels.attention import AttentionKernel, Placed, attention_kernel

# UnsupportedModel's home is family.py; steps/build.py and forward_choice.py import it from here
# K or V of every layer, one tensor each [slots + 1, kv_heads, rows, head_dim] (forward/slots.py)
LayerCache = Sequence[torch.Tensor]


class Rows(NamedTuple):
    """One forward call's inputs: N rows of T tokens (decode: T = 1), all on the model's device."""

    tokens: torch.Tensor  # [N, T] long
    positions: torch.Tensor  # [N, T] long: each token's position in its slot (padding: 0)
    write_slots: torch.Tensor  # [N, T] long: the slot its K/V is written to (padding: scratch)
    read_slots: torch.Tensor  # [N] long: the slot each row attends over
    last: torch.Tensor  # [N] long: index in T of the token whose logits are returned


class Span(NamedTuple):
    """Where one row of a prefill call lives: its tokens go to `place` in the cache, at
    positions start, start + 1, ... start + count - 1 (host ints)."""

    place: int
    start: int
    count: int


class CompactLlama(nn.Module):
    """The forward pass of a loaded Llama-family model, reading and writing a slot KV cache.

    `quantize` ("none", "int8", "int4"): the linear weights quantized for our C kernels (or,
    without a C compiler, torch's CPU weight-only kernels), the head in int8 (forward/quant.py);
    the embedding and norms stay as loaded. With `huge_pages`, what a step reads is moved into
    transparent huge pages on the CPU (forward/huge_pages.py). `from_weights` builds it on
    weights derived already (a weight file's, mapped: model/weight_cache.py).
    Every call, a lone stream's step, a batch of them or a prefill chunk, runs on these same
    weights through the same kernels, whose rows do not depend on each other: a row's logits
    are the same whatever shares its call (docs/performance.md, "One model whatever the load").
    """

    # numerics.weights_digest of the model the weights came from, where the builder knows it
    # (model/weight_cache.py); "" where it does not
    weights_digest = ""

    def __init__(
        self, model: Any, quantize: str = "none", matmul: str = "auto", huge_pages: bool = True
    ):
        super().__init__()
        weights = compact_weights(model, quantize, matmul)
        # the loaded model's parameters view the same memory (tied or unquantized weights)
        self._take(weights, huge_pages, along=model.parameters())

    @classmethod
    def from_weights(cls, weights: CompactWeights, huge_pages: bool = False) -> CompactLlama:
        """The forward on weights derived already (compact_weights), where they lie: a weight
        file's mapped pages stay shared unless `huge_pages` copies them."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._take(weights, huge_pages, along=())
        return self

    def _take(self, weights: CompactWeights, huge_pages: bool, along: Iterable[torch.Tensor]):
        """Run on `weights`: pick the kernels, place them, build the C stack."""
        self.weights = weights
        self.shape, self.quantize = weights.shape, weights.quantize
        self.embed, self.head, self.final_norm = weights.embed, weights.head, weights.final_norm
        self.blocks = weights.blocks
        self.embed_scale, self.logit_cap = weights.embed_scale, weights.logit_cap
        self.layer_ropes, self.ropes = weights.layer_ropes, weights.ropes
        # exact attention: the C kernel on the CPU for the dtypes it takes, else torch per token
        on_cpu = self.embed.device.type == "cpu" and self.embed.dtype in DTYPES
        self.kernel: AttentionKernel | None = attention_kernel() if on_cpu else None
        self.attention = f"c-{self.kernel.variant}" if self.kernel else "torch"
        # what runs the linear weights: c-avx2 / c-generic, aten, dense ("+" joins several)
        linear_weights = [self.head, *(w for b in self.blocks for w in b.weights())]
        self.matmul = "+".join(sorted({kernel_name(w) for w in linear_weights}))
        # every layer in a few C calls (native_layer), decode and prefill alike: our matmuls
        # for every weight and the attention kernel
        self.native = weights.native is not None and self.kernel is not None
        self.windowed = any(w != NO_WINDOW for w in self.shape.windows)
        if self.native:
            self.native_blocks, self.native_final_norm, self.native_ropes = weights.native
        # what a step reads, in huge pages (before the stack takes their addresses), with the
        # tensors of `along` that view the same memory
        step_weights = (self.embed, self.head, self.final_norm, self.blocks)
        native_weights = (self.native_final_norm, self.native_blocks) if self.native else ()
        self.huge_page_bytes = (
            place_in_huge_pages(all_tensors(step_weights + native_weights), along=along)
            if huge_pages
            else 0
        )
        # every layer in one C call where none needs torch between its calls (stack.DecoderStack)
        self.native_stack = self._decoder_stack() if self.native else None

    def tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor of its weights (CompactWeights)."""
        return all_tensors(self.weights)

    def forward(
        self,
        k_cache: LayerCache,
        v_cache: LayerCache,
        rows: Rows,
        window: int,
        layer: Callable[..., torch.Tensor] | None = None,
        spans: Sequence[Span] | None = None,
    ) -> torch.Tensor:
        """Run N rows of T tokens; return the logits [N, V] (fp32) of each row's `last` token.

        k_cache, v_cache: per layer [slots, kv_heads, rows, head_dim] (a ring's rows: fewer than
        the positions), written in place at (write_slots, positions). With `spans` (prefill),
        each row's tokens attend one by one over exactly their own positions, as a decode
        step's (`tokens_attention`). Without (a compiled decode step of fixed shapes), `window`
        >= the largest position + 1: each row attends over positions [0, window) of its slot
        (a ring: over its rows), masked to those <= its own (and in its sliding window),
        through `layer`, a compiled copy of `masked_layer` (itself where None).
        """
        x = self.hidden(k_cache, v_cache, rows, window, layer, spans)  # [N, T, hidden]
        n = rows.tokens.shape[0]
        x = x[torch.arange(n, device=x.device), rows.last]  # [N, hidden]
        return self.normed_logits(x)  # [N, V]

    def score(
        self, k_cache: LayerCache, v_cache: LayerCache, rows: Rows, spans: Sequence[Span]
    ) -> torch.Tensor:
        """`forward`, but the logits [N, T, V] (fp32) of every token (`rows.last` unused):
        teacher-forced quality checks."""
        x = self.hidden(k_cache, v_cache, rows, 0, spans=spans)  # [N, T, hidden]
        return self.normed_logits(x.reshape(-1, x.shape[-1])).view(*x.shape[:2], -1)

    def hidden(
        self,
        k_cache: LayerCache,
        v_cache: LayerCache,
        rows: Rows,
        window: int,
        layer: Callable[..., torch.Tensor] | None = None,
        spans: Sequence[Span] | None = None,
    ) -> torch.Tensor:
        """The last decoder layer's output [N, T, hidden] for every token (see `forward`)."""
        if spans is not None and self.native:
            return self._native_hidden(k_cache, v_cache, rows.tokens, spans)
        x = self._embed(rows.tokens)  # [N, T, hidden]
        ropes = self._rope_at(rows.positions)  # [N, 1, T, head_dim] each
        dims, windows = self.shape.dims, self.shape.windows
        at = self._cache_rows(rows.positions, k_cache)  # per layer: where positions are written
        if spans is not None:
            placed = _placed_tokens(spans, x.shape[1])
            for index, block in enumerate(self.blocks):
                kv = (k_cache[index], v_cache[index])
                where = (rows.write_slots, at[index], placed, windows[index])
                cos, sin = ropes[self.layer_ropes[index]]
                x = decoder_layer(
                    x, block, dims, tokens_attention, kv, cos, sin, where, self.kernel
                )
            return x
        layer = layer or masked_layer
        masks = self._masks(rows.positions, window, k_cache)
        for index, block in enumerate(self.blocks):
            mask = masks[windows[index], k_cache[index].shape[-2]]
            cos, sin = ropes[self.layer_ropes[index]]
            kv = (k_cache[index], v_cache[index])
            x = layer(
                x,
                block,
                kv,
                cos,
                sin,
                mask,
                rows.write_slots,
                at[index],
                rows.read_slots,
                window,
                dims,
            )
        return x

    def _cache_rows(self, positions: torch.Tensor, k_cache: LayerCache) -> list[torch.Tensor]:
        """Per layer, the rows of its cache that hold `positions`: the positions themselves
        under full attention, modulo its rows in a sliding-window layer's ring."""
        if not self.windowed:
            return [positions] * len(k_cache)
        wrapped: dict[int, torch.Tensor] = {}
        at = []
        for window, k in zip(self.shape.windows, k_cache):
            rows = k.shape[-2]
            if window != NO_WINDOW and rows not in wrapped:
                wrapped[rows] = positions % rows
            at.append(positions if window == NO_WINDOW else wrapped[rows])
        return at

    def _masks(self, positions: torch.Tensor, window: int, k_cache: LayerCache) -> dict:
        """The attention masks [N, 1, groups * T, keys] of a call over each slot's first
        `window` rows, by (layer window, layer rows): True where a row holds one of the token's
        positions in its window (a ring: the row's latest position is (p - row) mod rows back)."""
        key_pos = torch.arange(window, device=positions.device)
        distance = positions[:, :, None] - key_pos[None, None, :]  # [N, T, W]
        masks = {}
        for w, k in zip(self.shape.windows, k_cache):
            rows = k.shape[-2]
            if (w, rows) in masks:
                continue
            if w == NO_WINDOW:
                masks[w, rows] = self._grouped((distance >= 0) & (distance < w))
                continue
            back = distance[:, :, :rows] % rows  # [N, T, min(W, rows)]: positions back
            masks[w, rows] = self._grouped((back <= positions[:, :, None]) & (back < w))
        return masks

    def decode(
        self,
        k_cache: LayerCache,
        v_cache: LayerCache,
        index: torch.Tensor,
        rows: Sequence[tuple[int, int]],
    ) -> torch.Tensor:
        """One new token for each of N slots -> logits [N, V] (fp32).

        index: [2, N] long on the model's device, the tokens and their positions; rows: each
        row's (place in the cache, position) on the host. The arithmetic of `forward` for N
        rows of one token, in fewer operations: the matmuls, norms and RoPE run on the N rows
        at once (no row of theirs depends on another) and each row attends over exactly its
        own positions (`exact_attention`), never over positions padded to a batch mate's length
        with a mask. So a row's logits are the same alone or among any others, and the same as
        a prefill of the same token would give.
        """
        tokens, positions = index
        dims = self.shape.dims
        x = self._embed(tokens)  # [N, hidden]
        if self.native:
            x = self._native_layers(x.float(), k_cache, v_cache, Placed.of(list(rows)))
            return self.normed_logits(x)
        ropes = self._rope_at(positions)  # [N, 1, D] each
        # the rows' places, for one indexed write of several rows' K/V (a lone row: a slice)
        placed = Placed.of(list(rows))
        places = placed.places.to(tokens.device) if len(rows) > 1 else None
        at = self._cache_rows(positions, k_cache)
        for number, block in enumerate(self.blocks):
            kv = (k_cache[number], v_cache[number])
            where = (places, at[number], placed, self.shape.windows[number])
            cos, sin = ropes[self.layer_ropes[number]]
            x = decoder_layer(x, block, dims, rows_attention, kv, cos, sin, where, self.kernel)
        x = rms_norm(x, self.final_norm, self.shape.eps)
        return self.logits(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The head: normalised hidden states [..., hidden] -> fp32 logits [..., V]."""
        return self._capped(linear(x, self.head).float())

    def normed_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm and the head: hidden states [N, hidden] -> fp32 logits [N, V] (native:
        one call, the norm as the head's prologue)."""
        if self.native:
            norm = {"prologue": "rms_norm", "norm": self.native_final_norm, "eps": self.shape.eps}
            return self._capped(native_linear(x.float().contiguous(), self.head, **norm))
        return self.logits(rms_norm(x, self.final_norm, self.shape.eps))

    def _capped(self, logits: torch.Tensor) -> torch.Tensor:
        """fp32 logits soft-capped where the family does (Family.logit_cap), else as they are."""
        if self.logit_cap is None:
            return logits
        return torch.tanh(logits / self.logit_cap) * self.logit_cap

    def _decoder_stack(self) -> stack.DecoderStack | None:
        """The native layers as one C call, where every one is plain: pre-norms, no head or
        post norms, no experts; else None (native_layer's calls from Python)."""
        plain = all(
            b.norm1 is not None and b.norm2 is not None and b.gate_up is not None
            and b.q_norm is None and b.attn_out_norm is None and b.mlp_out_norm is None
            and b.experts is None
            for b in self.native_blocks
        )  # fmt: skip
        if not plain:
            return None
        layers = [
            stack.StackSpec(
                block.norm1,
                block.norm2,
                *[(getattr(block, n), getattr(block, f"{n}_bias")) for n in LINEAR_WEIGHTS],
                self.native_ropes[self.layer_ropes[number]],
                self.shape.windows[number],
            )
            for number, block in enumerate(self.native_blocks)
        ]
        return stack.decoder_stack(layers, self.shape.hidden, self.shape.dims)

    def _native_layers(self, x, k_cache, v_cache, placed: Placed) -> torch.Tensor:
        """Every decoder layer on n tokens (x [n, hidden] float32, contiguous; placed: where
        each attends) through native_layer, or the stack of them in one call -> the last
        layer's output [n, hidden] float32."""
        if self.native_stack is not None:
            return self.native_stack(x, k_cache, v_cache, placed)
        windows, dims = self.shape.windows, self.shape.dims
        for number, block in enumerate(self.native_blocks):
            kv = (k_cache[number], v_cache[number])
            rope = self.native_ropes[self.layer_ropes[number]]
            x = native_layer(x, block, kv, (placed, windows[number]), dims, self.kernel, rope)
        return x

    def _native_hidden(self, k_cache, v_cache, tokens, spans) -> torch.Tensor:
        """`hidden` of a prefill call on the native layers: its real tokens, row by row, as one
        list (padding is skipped, its places left zero) -> [N, T, hidden]."""
        n, t = tokens.shape
        placed, index = _placed_tokens(spans, t)
        if index is None:
            x = self._embed(tokens.reshape(-1)).float()
            return self._native_layers(x, k_cache, v_cache, placed).view(n, t, -1)
        x = self._embed(tokens[index[0], index[1]]).float()
        out = x.new_zeros(n, t, x.shape[-1])
        out[index[0], index[1]] = self._native_layers(x, k_cache, v_cache, placed)
        return out

    def _rope_at(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each RoPE table's cos and sin at `positions` [...] -> [..., 1, ..., head_dim]: a
        head axis after the first."""
        return [(cos[positions][:, None], sin[positions][:, None]) for cos, sin in self.ropes]

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings (times the family's embedding multiplier)."""
        x = F.embedding(tokens, self.embed)
        return x if self.embed_scale == 1.0 else x * self.embed_scale

    def _grouped(self, mask: torch.Tensor) -> torch.Tensor:
        """[N, T, W] -> [N, 1, groups * T, W]: one mask row per (query head of a group, token)."""
        n, t, w = mask.shape
        return mask[:, None, None].expand(n, 1, self.shape.groups, t, w).reshape(n, 1, -1, w)


def _placed_tokens(spans: Sequence[Span], t: int) -> tuple[Placed, torch.Tensor | None]:
    """Where the real tokens of a prefill call's rows (T tokens each) attend, row by row, and
    their (row, column) index [2, n] in the call; None when no row is padded."""
    rows = [(place, start + i) for place, start, count in spans for i in range(count)]
    if all(count == t for _, _, count in spans):
        return Placed.of(rows), None
    index = [(row, i) for row, span in enumerate(spans) for i in range(span.count)]
    return Placed.of(rows), torch.tensor(index, dtype=torch.long).T
