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

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

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


class _Step(NamedTuple):
    """Per-layer context of one forward call."""

    layer: int
    cos: torch.Tensor  # [N, 1, T, head_dim]
    sin: torch.Tensor
    mask: torch.Tensor  # [N, 1, groups * T, W] bool, True = attend
    k_cache: torch.Tensor
    v_cache: torch.Tensor


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


def model_shape(model: Any) -> LlamaShape:
    """Read a Hugging Face model's sizes, or raise UnsupportedModel saying why."""
    config = model.config
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED_TYPES:
        raise UnsupportedModel(
            f"the compact forward supports {', '.join(SUPPORTED_TYPES)}, not {kind!r}"
        )
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
    """The forward pass of a loaded Llama-family model, reading and writing a slot KV cache."""

    def __init__(self, model: Any):
        super().__init__()
        self.shape = shape = model_shape(model)
        inner = model.model
        self.embed = inner.embed_tokens.weight.detach()  # [V, hidden]
        self.head = model.lm_head.weight.detach()  # [V, hidden]; tied models share the tensor
        self.final_norm = inner.norm.weight.detach()
        self.blocks = [self._block(layer) for layer in inner.layers]
        self.cos, self.sin = self._rope_tables(inner.rotary_emb, self.embed.dtype)
        self.q_size = shape.heads * shape.head_dim
        self.kv_size = shape.kv_heads * shape.head_dim

    @staticmethod
    def _block(layer: Any) -> dict[str, torch.Tensor | None]:
        attn, mlp = layer.self_attn, layer.mlp
        qkv, qkv_bias = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        gate_up, gate_up_bias = _fuse([mlp.gate_proj, mlp.up_proj])
        return {
            "norm1": layer.input_layernorm.weight.detach(),
            "qkv": qkv,  # [(heads + 2 * kv_heads) * head_dim, hidden]
            "qkv_bias": qkv_bias,
            "o": attn.o_proj.weight.detach(),
            "o_bias": _param(attn.o_proj.bias),
            "norm2": layer.post_attention_layernorm.weight.detach(),
            "gate_up": gate_up,  # [2 * intermediate, hidden]
            "gate_up_bias": gate_up_bias,
            "down": mlp.down_proj.weight.detach(),
            "down_bias": _param(mlp.down_proj.bias),
        }

    def _rope_tables(self, rotary: Any, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [max_positions, head_dim], computed as Hugging Face does (fp32, then cast)."""
        inv_freq = rotary.inv_freq.float()  # [head_dim / 2]
        positions = torch.arange(self.shape.max_positions, device=inv_freq.device).float()
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = rotary.attention_scaling
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)

    def forward(self, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: Rows, window: int):
        """Run N rows of T tokens; return the logits [N, V] (fp32) of each row's `last` token.

        k_cache, v_cache: [layers, slots, kv_heads, max_len, head_dim], written in place at
        (write_slots, positions). `window` >= the largest position + 1: each row attends over
        positions [0, window) of its slot, masked to those <= its own (and in its sliding window).
        """
        n = rows.tokens.shape[0]
        device = rows.tokens.device
        x = F.embedding(rows.tokens, self.embed)  # [N, T, hidden]
        cos = self.cos[rows.positions][:, None]  # [N, 1, T, head_dim]
        sin = self.sin[rows.positions][:, None]
        key_pos = torch.arange(window, device=device)
        distance = rows.positions[:, :, None] - key_pos[None, None, :]  # [N, T, W]
        masks = {
            w: self._grouped((distance >= 0) & (distance < w)) for w in set(self.shape.windows)
        }
        for index, block in enumerate(self.blocks):
            step = _Step(index, cos, sin, masks[self.shape.windows[index]], k_cache, v_cache)
            h = self._rms_norm(x, block["norm1"])
            x = x + self._attention(block, h, rows, step, window)
            h = self._rms_norm(x, block["norm2"])
            x = x + self._mlp(block, h)
        x = x[torch.arange(n, device=device), rows.last]  # [N, hidden]
        x = self._rms_norm(x, self.final_norm)
        return F.linear(x, self.head).float()  # [N, V]

    def _grouped(self, mask: torch.Tensor) -> torch.Tensor:
        """[N, T, W] -> [N, 1, groups * T, W]: one mask row per (query head of a group, token)."""
        n, t, w = mask.shape
        return mask[:, None, None].expand(n, 1, self.shape.groups, t, w).reshape(n, 1, -1, w)

    def _attention(self, block, h: torch.Tensor, rows: Rows, step: _Step, window: int):
        """Self-attention of one layer; writes this step's K/V into the cache, then reads it."""
        s = self.shape
        n, t, _ = h.shape
        qkv = F.linear(h, block["qkv"], block["qkv_bias"])  # [N, T, (H + 2 Hkv) D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, t, s.heads, s.head_dim).transpose(1, 2)  # [N, H, T, D]
        k = k.view(n, t, s.kv_heads, s.head_dim).transpose(1, 2)  # [N, Hkv, T, D]
        q = q * step.cos + _rotate_half(q) * step.sin
        k = (k * step.cos + _rotate_half(k) * step.sin).transpose(1, 2)  # [N, T, Hkv, D]
        v = v.view(n, t, s.kv_heads, s.head_dim)  # [N, T, Hkv, D]
        # write first (padding tokens go to the scratch slot), then read the slot's window
        k_layer, v_layer = step.k_cache[step.layer], step.v_cache[step.layer]
        k_layer[rows.write_slots, :, rows.positions] = k  # indexed view: [N, T, Hkv, D]
        v_layer[rows.write_slots, :, rows.positions] = v
        keys = k_layer[rows.read_slots, :, :window]  # [N, Hkv, W, D]
        values = v_layer[rows.read_slots, :, :window]
        # grouped-query attention without repeating K/V: the `groups` query heads that share a
        # key/value head are stacked along the query axis -> [N, Hkv, groups * T, D]
        q = q.reshape(n, s.kv_heads, s.groups * t, s.head_dim)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=step.mask)
        out = out.reshape(n, s.heads, t, s.head_dim).transpose(1, 2).reshape(n, t, self.q_size)
        return F.linear(out, block["o"], block["o_bias"])

    @staticmethod
    def _mlp(block, h: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(h, block["gate_up"], block["gate_up_bias"]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, block["down"], block["down_bias"])

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Hugging Face's Llama RMSNorm: normalise in fp32, cast back, then scale."""
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.shape.eps)
        return weight * y.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
