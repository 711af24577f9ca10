"""A compact forward pass for the Llama family over a per-slot KV cache.

Supported: `llama` (Llama 2/3, SmolLM, SmolLM2, TinyLlama), `mistral` (sliding window as a mask)
and `qwen2` (q/k/v biases, per-layer sliding window). Anything else raises UnsupportedModel and
the caller keeps the Hugging Face forward. The weights are the Hugging Face model's own tensors
(q/k/v and gate/up fused into one matmul each; the model's parameters are re-pointed at views of
the fused tensors, so the weights are held once).

One `forward` serves prefill and decode: N rows of T tokens each (decode is T = 1). Each row's
new keys and values are written into the cache at their positions first, then every row attends
over its slot's first `window` positions with a mask, so a slot's earlier positions (an earlier
chunk, a reused prefix) are simply part of what it attends to.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from streaming_backend.forward.quant import HEAD_KIND, Weight, check_kind, linear, quantize_weight

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")
# RoPE variants whose inverse frequencies are fixed at load (no position-dependent rescaling).
STATIC_ROPE_TYPES = ("default", "linear", "llama3")
NO_WINDOW = 1 << 62  # "sliding window" of a full-attention layer


class Rows(NamedTuple):
    """One forward call's inputs: N rows of T tokens (decode: T = 1), all on the model's device."""

    tokens: torch.Tensor  # [N, T] long
    positions: torch.Tensor  # [N, T] long: each token's position in its slot (padding: 0)
    write_slots: torch.Tensor  # [N, T] long: the slot its K/V is written to (padding: scratch)
    read_slots: torch.Tensor  # [N] long: the slot each row attends over
    last: torch.Tensor  # [N] long: index in T of the token whose logits are returned


class Block(NamedTuple):
    """One decoder layer's weights (q/k/v and gate/up fused); biases are None when absent."""

    norm1: torch.Tensor  # [hidden]
    qkv: Weight  # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None
    o: Weight  # [hidden, heads * head_dim]
    o_bias: torch.Tensor | None
    norm2: torch.Tensor  # [hidden]
    gate_up: Weight  # [2 * intermediate, hidden]
    gate_up_bias: torch.Tensor | None
    down: Weight  # [hidden, intermediate]
    down_bias: torch.Tensor | None

    def quantized(self, kind: str) -> Block:
        """This block with its four linear weights quantized as `kind` (forward/quant.py)."""
        return self._replace(
            **{name: quantize_weight(getattr(self, name), kind) for name in LINEAR_WEIGHTS}
        )


LINEAR_WEIGHTS = ("qkv", "o", "gate_up", "down")  # the Block fields a quantization replaces


class Dims(NamedTuple):
    """The sizes one layer needs (plain ints: a compiled layer specialises on them)."""

    heads: int
    kv_heads: int
    head_dim: int
    eps: float


class UnsupportedModel(ValueError):
    """The model is not one this forward implements; use the Hugging Face forward."""


@dataclass(frozen=True)
class LlamaShape:
    """The sizes the forward and the slot cache need."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_positions: int
    eps: float
    windows: tuple[int, ...]  # per layer: sliding window length, NO_WINDOW for full attention

    @property
    def groups(self) -> int:
        """Query heads per key/value head."""
        return self.heads // self.kv_heads

    @property
    def dims(self) -> Dims:
        """What `decoder_layer` needs to know."""
        return Dims(self.heads, self.kv_heads, self.head_dim, self.eps)


def model_shape(model: Any) -> LlamaShape:
    """Read a Hugging Face model's sizes, or raise UnsupportedModel saying why."""
    config = model.config
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED_TYPES:
        raise UnsupportedModel(
            f"the compact forward supports {', '.join(SUPPORTED_TYPES)}, not {kind!r}"
        )
    hooked = [name for name, m in model.named_modules() if m._forward_hooks or m._forward_pre_hooks]
    if hooked:
        raise UnsupportedModel(f"forward hooks on {hooked[:3]} would be skipped")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"activation {config.hidden_act!r} is not silu")
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") not in STATIC_ROPE_TYPES:
        raise UnsupportedModel(f"RoPE type {rope.get('rope_type')!r} is not supported")
    heads = config.num_attention_heads
    return LlamaShape(
        layers=config.num_hidden_layers,
        hidden=config.hidden_size,
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        vocab=config.vocab_size,
        max_positions=config.max_position_embeddings,
        eps=config.rms_norm_eps,
        windows=_layer_windows(config),
    )


def _layer_windows(config: Any) -> tuple[int, ...]:
    """Sliding window per layer as the Hugging Face masks apply it (None -> full attention)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if config.model_type == "mistral" or layer_types is None:
        return (window or NO_WINDOW,) * config.num_hidden_layers
    return tuple(
        (window or NO_WINDOW) if kind == "sliding_attention" else NO_WINDOW for kind in layer_types
    )


def _fuse(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight [sum(out), in] (and bias) for several linears; theirs become views of it."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    has_bias = [lin.bias is not None for lin in linears]
    if any(has_bias) and not all(has_bias):
        raise UnsupportedModel("a fused projection mixes biased and unbiased linears")
    bias = torch.cat([lin.bias.detach() for lin in linears]) if all(has_bias) else None
    start = 0
    for lin in linears:  # hold the weights once: the Hugging Face modules read the same memory
        end = start + lin.weight.shape[0]
        lin.weight.data = weight[start:end]
        if bias is not None:
            lin.bias.data = bias[start:end]
        start = end
    return weight, bias


def _param(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()


class CompactLlama(nn.Module):
    """The forward pass of a loaded Llama-family model, reading and writing a slot KV cache.

    `quantize` ("none", "int8", "int4"): the linear weights as torch's CPU weight-only kernels
    take them, the head in int8 (forward/quant.py); the embedding and norms stay as loaded.
    A quantized weight is a copy: the Hugging Face model keeps its own, which calls of many
    rows (prefill) use from `full_blocks_from` rows on, where its matmul measured faster than
    the quantized kernel (`calibrate`). Keeping them costs nothing: they are the model's.
    """

    def __init__(self, model: Any, quantize: str = "none"):
        super().__init__()
        self.shape = model_shape(model)
        self.quantize = check_kind(quantize)
        inner = model.model
        self.embed = inner.embed_tokens.weight.detach()  # [V, hidden]
        # [V, hidden]; tied models share the tensor (unless quantized)
        self.full_head = model.lm_head.weight.detach()  # as loaded: the model holds it anyway
        self.head: Weight = quantize_weight(self.full_head, HEAD_KIND[quantize])
        # A quantized head reads fewer bytes, which wins for a few rows; for many rows the
        # loaded one's matmul wins. From this many rows on the loaded one is used (None: never);
        # `calibrate_head` measures where, on this machine.
        self.full_head_from: int | None = None
        self.final_norm = inner.norm.weight.detach()
        # the loaded weights (views of the Hugging Face model's own), and the quantized ones
        self.full_blocks = [_block(layer) for layer in inner.layers]
        self.blocks = [block.quantized(quantize) for block in self.full_blocks]
        # From this many rows (tokens) in one call on, the loaded weights run the layers (None:
        # never); `calibrate` measures where, on this machine.
        self.full_blocks_from: int | None = None
        self.cos, self.sin = _rope_tables(inner.rotary_emb, self.shape, self.embed.dtype)

    def forward(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        rows: Rows,
        window: int,
        layer: Callable[..., torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Run N rows of T tokens; return the logits [N, V] (fp32) of each row's `last` token.

        k_cache, v_cache: [layers, slots, kv_heads, max_len, head_dim], written in place at
        (write_slots, positions). `window` >= the largest position + 1: each row attends over
        positions [0, window) of its slot, masked to those <= its own (and in its sliding window).
        `layer` replaces `decoder_layer` (a compiled copy of it).
        """
        x = self.hidden(k_cache, v_cache, rows, window, layer)  # [N, T, hidden]
        n = rows.tokens.shape[0]
        x = x[torch.arange(n, device=x.device), rows.last]  # [N, hidden]
        x = rms_norm(x, self.final_norm, self.shape.eps)
        return self.logits(x)  # [N, V]

    def score(self, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: Rows, window: int):
        """`forward`, but the logits [N, T, V] (fp32) of every token (`rows.last` unused):
        teacher-forced quality checks."""
        x = self.hidden(k_cache, v_cache, rows, window, blocks=self.blocks)
        # the quantized weights and head always (the less exact): quality checks measure the
        # worst case
        return linear(rms_norm(x, self.final_norm, self.shape.eps), self.head).float()

    def blocks_for(self, rows: int) -> list[Block]:
        """The layers' weights for a call of `rows` rows (tokens): quantized, or the loaded ones
        from `full_blocks_from` rows on."""
        if self.full_blocks_from is not None and rows >= self.full_blocks_from:
            return self.full_blocks
        return self.blocks

    def hidden(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        rows: Rows,
        window: int,
        layer: Callable[..., torch.Tensor] | None = None,
        blocks: list[Block] | None = None,
    ) -> torch.Tensor:
        """The last decoder layer's output [N, T, hidden] for every token (see `forward`);
        `blocks`: the weights to use (default: `blocks_for` the call's tokens)."""
        layer = layer or decoder_layer
        if blocks is None:
            blocks = self.blocks_for(rows.tokens.numel())
        device = rows.tokens.device
        x = F.embedding(rows.tokens, self.embed)  # [N, T, hidden]
        cos = self.cos[rows.positions][:, None]  # [N, 1, T, head_dim]
        sin = self.sin[rows.positions][:, None]
        key_pos = torch.arange(window, device=device)
        distance = rows.positions[:, :, None] - key_pos[None, None, :]  # [N, T, W]
        windows = self.shape.windows
        masks = {w: self._grouped((distance >= 0) & (distance < w)) for w in set(windows)}
        dims = self.shape.dims
        for index, block in enumerate(blocks):
            mask = masks[windows[index]]
            kv = (k_cache[index], v_cache[index])
            x = layer(
                x,
                block,
                kv,
                cos,
                sin,
                mask,
                rows.write_slots,
                rows.positions,
                rows.read_slots,
                window,
                dims,
            )
        return x

    def decode_one(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        token: torch.Tensor,
        slot: int,
        position: int,
    ) -> torch.Tensor:
        """One new token of one slot at `position` -> its logits [1, V] (fp32).

        The arithmetic of `forward` for a single row of one token, in fewer operations: with
        the slot and position known on the host, each layer's keys and values are a view of the
        slot (no gather), every viewed position is attended (no mask), and RoPE turns q and k
        at once. token: [1] long on the model's device.
        """
        x = F.embedding(token, self.embed)  # [1, hidden]
        cos, sin = self.cos[position], self.sin[position]  # [head_dim]
        dims = self.shape.dims
        for index, block in enumerate(self.blocks_for(1)):
            start = max(0, position + 1 - self.shape.windows[index])  # the sliding window
            kv = (k_cache[index, slot], v_cache[index, slot])  # [kv_heads, max_len, head_dim]
            h = rms_norm(x, block.norm1, dims.eps)
            x = x + one_row_attention(h, block, kv, cos, sin, (position, start), dims)
            x = mlp(x, block, dims)
        x = rms_norm(x, self.final_norm, self.shape.eps)
        return self.logits(x)

    def decode_front(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, index: torch.Tensor, window: int
    ) -> torch.Tensor:
        """One new token for each of the cache's first N places -> logits [N, V] (fp32).

        index: [2, N] long on the model's device, the tokens and their positions; row r is the
        slot at place r (SlotCache.gather_front put them there). The arithmetic of `forward` for
        N rows of one token, but every layer attends over one view of places [0, N) and
        positions [0, window) instead of a copy of each row's keys, with one [N, 1, 1, window]
        mask per sliding-window length broadcast over the heads.
        """
        tokens, positions = index
        n = tokens.shape[0]
        dims = self.shape.dims
        x = F.embedding(tokens, self.embed)  # [N, hidden]
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # [N, 1, D]
        places = torch.arange(n, device=tokens.device)
        distance = positions[:, None] - torch.arange(window, device=tokens.device)[None]
        windows = self.shape.windows
        masks = {w: ((distance >= 0) & (distance < w))[:, None, None] for w in set(windows)}
        for number, block in enumerate(self.blocks_for(n)):
            kv = (k_cache[number], v_cache[number])
            h = rms_norm(x, block.norm1, dims.eps)
            where = (places, positions, window, masks[windows[number]])
            x = x + front_attention(h, block, kv, cos, sin, where, dims)
            x = mlp(x, block, dims)
        x = rms_norm(x, self.final_norm, self.shape.eps)
        return self.logits(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The head: normalised hidden states [..., hidden] -> fp32 logits [..., V]."""
        rows = x.numel() // x.shape[-1]
        if self.full_head_from is not None and rows >= self.full_head_from:
            return linear(x, self.full_head).float()
        return linear(x, self.head).float()

    def calibrate_head(self, max_rows: int, repeats: int = 3) -> None:
        """With a quantized head: time it against the loaded one at 1, 2, 4, ... max_rows rows
        and set `full_head_from` to the fewest rows from which the loaded one was faster at every
        size measured (None if it never was). A few milliseconds per size."""
        self.full_head_from = None
        if self.head is self.full_head:
            return

        def race_at(rows: int) -> tuple[float, float]:
            x = self.embed.new_zeros(rows, self.shape.hidden)
            return _race(linear, (x, self.head), (x, self.full_head), repeats)

        self.full_head_from = _loaded_from(race_at, max_rows)

    def calibrate_blocks(self, max_rows: int, repeats: int = 2) -> None:
        """With quantized layers: time every layer's linears, quantized against loaded, at 1, 2,
        4, ... max_rows rows (stopping once the loaded ones won twice running) and set
        `full_blocks_from` to the fewest rows from which the loaded ones were faster at every
        size measured (None if they never were). Every layer, not one: a step streams them all
        from memory, which is what the quantized ones save. On a 2-core EPYC with the default
        model: about 0.5 s in bfloat16 (split at 16-32 rows); 2.3-4.4 s in float32 capped to AVX2,
        where the split comes later (64-128 rows) and each size costs more."""
        self.full_blocks_from = None
        if self.blocks[0].gate_up is self.full_blocks[0].gate_up:
            return
        first = self.full_blocks[0]
        widths = [getattr(first, name).shape[1] for name in LINEAR_WEIGHTS]

        def race_at(rows: int) -> tuple[float, float]:
            inputs = [self.embed.new_zeros(rows, width) for width in widths]
            # one warm-up each, at the first size: later sizes' first calls are not slower, and
            # the large sizes are most of the time this takes
            blocks = ((inputs, self.blocks), (inputs, self.full_blocks))
            return _race(_block_linears, *blocks, repeats, warm_up=rows == 1)

        self.full_blocks_from = _loaded_from(race_at, max_rows, stop_after=2)

    def _grouped(self, mask: torch.Tensor) -> torch.Tensor:
        """[N, T, W] -> [N, 1, groups * T, W]: one mask row per (query head of a group, token)."""
        n, t, w = mask.shape
        return mask[:, None, None].expand(n, 1, self.shape.groups, t, w).reshape(n, 1, -1, w)


def _race(
    call: Callable[..., Any], first: tuple, second: tuple, repeats: int, warm_up: bool = True
) -> tuple[float, float]:
    """The fastest of `repeats` timed calls with each argument tuple, in seconds, the two taking
    turns (after one warm-up each unless told not): a burst of the machine's other load then
    slows both rather than one, which alone would decide the race."""
    if warm_up:
        call(*first)
        call(*second)
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for index, args in enumerate((first, second)):
            start = time.perf_counter()
            call(*args)
            best[index] = min(best[index], time.perf_counter() - start)
    return best[0], best[1]


def _loaded_from(
    race_at: Callable[[int], tuple[float, float]], max_rows: int, stop_after: int | None = None
) -> int | None:
    """Race (quantized, loaded) seconds at 1, 2, 4, ... max_rows rows; the fewest rows from
    which the loaded weights were faster at every size measured, None if they lost the last.
    stop_after: stop once they have won that many sizes running."""
    wins: list[int] = []  # the sizes measured since the last one the loaded weights lost at
    rows = 1
    while True:
        quantized, loaded = race_at(rows)
        wins = [*wins, rows] if loaded < quantized else []
        if rows >= max_rows or (stop_after is not None and len(wins) == stop_after):
            return wins[0] if wins else None
        rows = min(2 * rows, max_rows)


def _block_linears(inputs: list[torch.Tensor], blocks: list[Block]) -> None:
    """Every layer's four matmuls (LINEAR_WEIGHTS order) on `inputs`, one per weight, of its
    input width (calibration: the cost only)."""
    for block in blocks:
        for name, x in zip(LINEAR_WEIGHTS, inputs):
            linear(x, getattr(block, name))


def _block(layer: Any) -> Block:
    """A Hugging Face decoder layer's weights, q/k/v and gate/up fused."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv, qkv_bias = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
    gate_up, gate_up_bias = _fuse([mlp.gate_proj, mlp.up_proj])
    return Block(
        norm1=layer.input_layernorm.weight.detach(),
        qkv=qkv,
        qkv_bias=qkv_bias,
        o=attn.o_proj.weight.detach(),
        o_bias=_param(attn.o_proj.bias),
        norm2=layer.post_attention_layernorm.weight.detach(),
        gate_up=gate_up,
        gate_up_bias=gate_up_bias,
        down=mlp.down_proj.weight.detach(),
        down_bias=_param(mlp.down_proj.bias),
    )


def _rope_tables(rotary: Any, shape: LlamaShape, dtype: torch.dtype):
    """cos, sin [max_positions, head_dim], computed as Hugging Face does (fp32, then cast)."""
    inv_freq = rotary.inv_freq.float()  # [head_dim / 2]
    positions = torch.arange(shape.max_positions, device=inv_freq.device).float()
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    scale = rotary.attention_scaling
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def decoder_layer(
    x: torch.Tensor,  # [N, T, hidden]
    block: Block,
    kv: tuple[torch.Tensor, torch.Tensor],  # this layer's K, V [slots, kv_heads, max_len, D]
    cos: torch.Tensor,  # [N, 1, T, head_dim]
    sin: torch.Tensor,
    mask: torch.Tensor,  # [N, 1, groups * T, W] bool, True = attend
    write_slots: torch.Tensor,  # [N, T]: see Rows
    positions: torch.Tensor,  # [N, T]
    read_slots: torch.Tensor,  # [N]
    window: int,
    dims: Dims,
) -> torch.Tensor:
    """One decoder layer (the unit torch.compile compiles once and reuses for every layer)."""
    h = rms_norm(x, block.norm1, dims.eps)
    where = (write_slots, positions, read_slots, window)
    x = x + attention(h, block, kv, cos, sin, mask, where, dims)
    return mlp(x, block, dims)


def mlp(x: torch.Tensor, block: Block, dims: Dims) -> torch.Tensor:
    """The second half of a decoder layer: x plus the MLP of its normalised self."""
    h = rms_norm(x, block.norm2, dims.eps)
    gate, up = linear(h, block.gate_up, block.gate_up_bias).chunk(2, dim=-1)
    return x + linear(F.silu(gate) * up, block.down, block.down_bias)


def attention(h, block: Block, kv, cos, sin, mask, where, dims: Dims) -> torch.Tensor:
    """Self-attention of one layer: write this step's K/V into the cache, then attend over it."""
    n, t, _ = h.shape
    k_layer, v_layer = kv
    write_slots, positions, read_slots, window = where
    q_size, kv_size = dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim
    qkv = linear(h, block.qkv, block.qkv_bias)  # [N, T, (H + 2 Hkv) D]
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(n, t, dims.heads, dims.head_dim).transpose(1, 2)  # [N, H, T, D]
    k = k.view(n, t, dims.kv_heads, dims.head_dim).transpose(1, 2)  # [N, Hkv, T, D]
    q = q * cos + _rotate_half(q) * sin
    k = (k * cos + _rotate_half(k) * sin).transpose(1, 2)  # [N, T, Hkv, D]
    v = v.view(n, t, dims.kv_heads, dims.head_dim)  # [N, T, Hkv, D]
    # write first (padding tokens go to the scratch slot), then read the slots' windows
    k_layer[write_slots, :, positions] = k  # the indexed view is [N, T, Hkv, D]
    v_layer[write_slots, :, positions] = v
    keys = k_layer[read_slots, :, :window]  # [N, Hkv, W, D]
    values = v_layer[read_slots, :, :window]
    # grouped-query attention without repeating K/V: the query heads that share a key/value
    # head are stacked along the query axis -> [N, Hkv, groups * T, D]
    groups = dims.heads // dims.kv_heads
    q = q.reshape(n, dims.kv_heads, groups * t, dims.head_dim)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    out = out.reshape(n, dims.heads, t, dims.head_dim).transpose(1, 2).reshape(n, t, q_size)
    return linear(out, block.o, block.o_bias)


def one_row_attention(h, block: Block, kv, cos, sin, span: tuple[int, int], dims: Dims):
    """`attention` for one row of one token (h [1, hidden]) at a host-known position.

    kv: this layer's K, V of the row's slot [kv_heads, max_len, head_dim]; span: (position,
    first attended position). Writes the token's K/V at `position`, attends over
    [first, position] and returns [1, hidden].
    """
    position, first = span
    k_slot, v_slot = kv
    q_size, kv_size = dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim
    qkv = linear(h, block.qkv, block.qkv_bias)[0]  # [(H + 2 Hkv) D]
    qk = qkv[: q_size + kv_size].view(dims.heads + dims.kv_heads, dims.head_dim)
    qk = qk * cos + _rotate_half(qk) * sin  # q's heads, then k's
    k_slot[:, position] = qk[dims.heads :]
    v_slot[:, position] = qkv[q_size + kv_size :].view(dims.kv_heads, dims.head_dim)
    keys = k_slot[None, :, first : position + 1]  # [1, Hkv, L, D]: a view, every position valid
    values = v_slot[None, :, first : position + 1]
    # the query heads sharing a key/value head stacked along the query axis, as in `attention`
    q = qk[: dims.heads].view(1, dims.kv_heads, dims.heads // dims.kv_heads, dims.head_dim)
    out = F.scaled_dot_product_attention(q, keys, values)  # [1, Hkv, groups, D]
    return linear(out.reshape(1, q_size), block.o, block.o_bias)


def front_attention(h, block: Block, kv, cos, sin, where, dims: Dims) -> torch.Tensor:
    """`attention` for N rows of one token (h [N, hidden]) in the cache's first N places.

    where: (places [N] = 0..N-1, positions [N], window, mask [N, 1, 1, window]). Writes each
    row's K/V at its place and position, then attends over the view kv[:N, :, :window].
    """
    places, positions, window, mask = where
    n = h.shape[0]
    k_layer, v_layer = kv
    q_size, kv_size = dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim
    qkv = linear(h, block.qkv, block.qkv_bias)  # [N, (H + 2 Hkv) D]
    qk = qkv[:, : q_size + kv_size].view(n, dims.heads + dims.kv_heads, dims.head_dim)
    qk = qk * cos + _rotate_half(qk) * sin  # q's heads, then k's
    k_layer[places, :, positions] = qk[:, dims.heads :]  # [N, Hkv, D]
    v_layer[places, :, positions] = qkv[:, q_size + kv_size :].view(n, dims.kv_heads, -1)
    # the query heads sharing a key/value head stacked along the query axis, as in `attention`
    q = qk[:, : dims.heads].reshape(n, dims.kv_heads, dims.heads // dims.kv_heads, -1)
    keys, values = k_layer[:n, :, :window], v_layer[:n, :, :window]  # views: nothing copied
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)  # [N, Hkv, groups, D]
    return linear(out.reshape(n, q_size), block.o, block.o_bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's Llama RMSNorm: normalise in fp32, cast back, then scale."""
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
