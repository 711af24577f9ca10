"""Quantized linear weights for the compact forward, run by torch's own CPU kernels.

    weight = quantize_weight(linear.weight, "int8")   # or "int4", or "none" (unchanged)
    y = linear(x, weight, bias)                        # F.linear for a plain tensor

- int8: weight-only, one scale per output row (`torch.ops.aten._weight_int8pack_mm`): a quarter
  of float32's bytes, half of bfloat16's; activations stay in the model's dtype.
- int4: weight-only, asymmetric, one scale and zero per group of INT4_GROUP inputs per output row
  (`torch.ops.aten._convert_weight_to_int4pack_for_cpu`, `_weight_int4pack_mm_for_cpu`); the
  head stays int8 (HEAD_KIND).

Both are CPU kernels: quantizing a weight on another device raises ValueError. A weight whose
shape a kernel cannot take (int4: inputs not a multiple of the group) stays unquantized.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from streaming_backend.config import QUANTIZE_KINDS

# inputs per int4 scale/zero pair: 64 failed the quality gate on the default model (greedy
# agreement 67 %, perplexity +32 %), 32 passed (docs/performance.md)
INT4_GROUP = 32
# the head's format per quantization: an int4 head cost 8 points of greedy agreement (90 % vs 98 %)
HEAD_KIND = {"none": "none", "int8": "int8", "int4": "int8"}
INT4_INNER_K_TILES = 1  # the CPU packing ignores it; the op still takes it


class Int8Weight(NamedTuple):
    """An int8 weight [out, in] with one scale per output row (in the activations' dtype)."""

    weight: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out]


class Int4Weight(NamedTuple):
    """A 4-bit weight in torch's CPU packing, with per-group scales and zeros."""

    packed: torch.Tensor  # [out, in / 2] uint8
    scales_zeros: torch.Tensor  # [in / group, out, 2]: (scale, zero) in the activations' dtype
    group: int


Weight = torch.Tensor | Int8Weight | Int4Weight


def check_kind(kind: str) -> str:
    """`kind` if it is one of QUANTIZE_KINDS, else ValueError naming them."""
    if kind not in QUANTIZE_KINDS:
        raise ValueError(f"unknown quantization {kind!r}; choose {', '.join(QUANTIZE_KINDS)}")
    return kind


def quantize_weight(weight: torch.Tensor, kind: str) -> Weight:
    """A linear weight [out, in] as `kind` ("none": the tensor itself)."""
    if check_kind(kind) == "none":
        return weight
    if weight.device.type != "cpu":
        raise ValueError(f"{kind} weights use torch's CPU kernels; the model is on {weight.device}")
    if kind == "int8":
        return quantize_int8(weight)
    if weight.shape[1] % INT4_GROUP:
        return weight  # the kernel groups whole inputs
    return quantize_int4(weight, INT4_GROUP)


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Symmetric per-row int8: w ~ q * scale, q in [-127, 127]."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127  # [out]
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(q.contiguous(), scales.to(weight.dtype))


def quantize_int4(weight: torch.Tensor, group: int) -> Int4Weight:
    """Asymmetric int4 per group of `group` inputs: w ~ (q - 8) * scale + zero, q in [0, 15]."""
    out, inputs = weight.shape
    w = weight.detach().float().view(out, inputs // group, group)
    low, high = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
    scales = (high - low).clamp(min=1e-12) / 15  # [out, groups, 1]
    q = torch.round((w - low) / scales).clamp(0, 15).to(torch.int32).view(out, inputs)
    zeros = low + 8 * scales  # the kernel subtracts 8 from each q
    # [groups, out, 2]: the layout the kernel reads
    scales_zeros = torch.cat([scales, zeros], dim=-1).transpose(0, 1).contiguous()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, INT4_INNER_K_TILES)
    return Int4Weight(packed, scales_zeros.to(weight.dtype), group)


def dequantize(weight: Weight) -> torch.Tensor:
    """The float weight [out, in] a quantized one stands for (float32; tests and checks)."""
    if isinstance(weight, torch.Tensor):
        return weight.float()
    if isinstance(weight, Int8Weight):
        return weight.weight.float() * weight.scales.float()[:, None]
    # the identity matrix through the kernel: row i of the result is input i of every output
    inputs = weight.packed.shape[1] * 2
    eye = torch.eye(inputs, dtype=weight.scales_zeros.dtype)
    return linear(eye, weight).float().T.contiguous()


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a plain or quantized weight: x [..., in] -> [..., out]."""
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    # the kernels take contiguous 2-D inputs; a lone stream's [1, in] goes as it is (each
    # reshape is one more operator call in a step of a few milliseconds)
    flat = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, x.shape[-1]).contiguous()
    if isinstance(weight, Int8Weight):
        y = torch.ops.aten._weight_int8pack_mm(flat, weight.weight, weight.scales)
    else:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            flat, weight.packed, weight.group, weight.scales_zeros
        )
    if x.dim() != 2:
        y = y.view(*x.shape[:-1], y.shape[-1])
    return y if bias is None else y + bias


def weight_bytes(weight: Weight) -> int:
    """Bytes a decode step reads for this weight."""
    if isinstance(weight, torch.Tensor):
        return weight.numel() * weight.element_size()
    return sum(t.numel() * t.element_size() for t in weight if isinstance(t, torch.Tensor))
