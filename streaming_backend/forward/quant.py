"""Quantized linear weights for the compact forward, run by our C kernels or torch's.

    weight = quantize_weight(linear.weight, "int8")   # or "int4", or "none" (unchanged)
    y = linear(x, weight, bias)                        # F.linear for a plain tensor

- int8: weight-only, symmetric, one scale per output row: a quarter of float32's bytes, half
  of bfloat16's.
- int4: weight-only, asymmetric, one step and low per group of INT4_GROUP inputs per output
  row; the head stays int8 (HEAD_KIND).

Where the C kernels build (kernels/matmul.py, kernels/csrc/matmul.c) the weights are laid out for
them (NativeInt4Weight, NativeInt8Weight): they quantize each activation row in blocks of 32
inputs with a step per block and multiply with integer dot products, streaming the weights at
close to memory speed for one row. Elsewhere (no C compiler, a weight whose inputs do not fill
whole blocks) torch's weight-only kernels run them (Int4Weight, Int8Weight): their fast paths
take 16-bit activations, so a float32 model's go through bfloat16 at each quantized matmul and
come back as float32 (COMPUTE_DTYPE). `kernel_name` says which a weight runs on.

Both are CPU kernels: quantizing a weight on another device raises ValueError. A weight whose
shape no kernel can take (int4: inputs not a multiple of the group) stays unquantized.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from streaming_backend.configuration.models import QUANTIZE_KINDS
from streaming_backend.heap import trim_heap
from streaming_backend.kernels.abi import DTYPES
from streaming_backend.kernels.matmul import MatmulKernel, matmul_kernel

# inputs per int4 scale/zero pair: 64 failed the quality gate on the default model (greedy
# agreement 67 %, perplexity +32 %), 32 passed (docs/design.md, the quality gate)
INT4_GROUP = 32
# the head's format per quantization: an int4 head cost 8 points of greedy agreement (90 % vs 98 %)
HEAD_KIND = {"none": "none", "int8": "int8", "int4": "int8"}
LAYOUT_VERSION = 2  # of what quantize_weight produces: raise it when that changes (weight_cache)
TILE = MatmulKernel.TILE  # weight rows the C kernels take together: their layout's tiles
ROWS_AT_ONCE = 256 * TILE  # rows of a weight quantize_weight quantizes at a time (_by_rows)
INT4_INNER_K_TILES = 1  # the CPU packing ignores it; the op still takes it
# The activations' dtype at a quantized matmul, by the model's: neither kernel has a fast float32
# path (16 rows: int4 [576 -> 3072] 23 ms with float32 activations against 0.3-0.5 ms through
# bfloat16; the int8 head [576 -> 49152] 167 ms against 4-10 ms; with or without AVX-512)
COMPUTE_DTYPE = {torch.float32: torch.bfloat16}


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a quantized matmul computes in for a model in `dtype` (COMPUTE_DTYPE)."""
    return COMPUTE_DTYPE.get(dtype, dtype)


class Int8Weight(NamedTuple):
    """An int8 weight [out, in] with one scale per output row (in the dtype the kernel computes
    in: compute_dtype)."""

    weight: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out]


class Int4Weight(NamedTuple):
    """A 4-bit weight in torch's CPU packing, with per-group scales and zeros."""

    packed: torch.Tensor  # [out, in / 2] uint8
    # [in / group, out, 2]: (scale, zero) in the dtype the kernel computes in (compute_dtype)
    scales_zeros: torch.Tensor
    group: int


class NativeInt8Weight(NamedTuple):
    """An int8 weight [out, in] with one float32 scale per output row, for the C kernel."""

    # [out, in] int8 in tiles of TILE rows: block b of tile t at (t * blocks + b) * 512, byte
    # 64 u + 4 c + j input 4u + j of the tile's row c (native_int8_levels: in row order)
    weight: torch.Tensor
    scales: torch.Tensor  # [out] float32
    out: int  # output rows; weight's and scales' rows are padded with zeros to whole tiles


class NativeInt4Weight(NamedTuple):
    """A 4-bit weight in the C kernel's layout: w = l * step + low per group of INT4_GROUP inputs,
    l in [0, 15]; in tiles of TILE output rows (kernels/csrc/matmul.c), which the shapes below
    only size (native_int4_values gives the values in row order)."""

    # [out, in / 2] uint8: group g of tile t at (t * groups + g) * 256; byte 64 p + 4 c + j holds
    # input 4p + j of the tile's row c (low nibble) and input 16 + 4p + j (high nibble)
    packed: torch.Tensor
    steps: torch.Tensor  # [out, in / group] float16: tile t's group g at (t * groups + g) * 16
    lows: torch.Tensor  # [out, in / group] float16, likewise
    out: int  # output rows; the tensors' rows are padded with zeros to whole tiles


Weight = torch.Tensor | Int8Weight | Int4Weight | NativeInt8Weight | NativeInt4Weight
NATIVE_WEIGHTS = (NativeInt8Weight, NativeInt4Weight)


MATMULS = ("auto", "aten")  # what runs quantized weights: ours where they build, or torch's


def check_matmul(matmul: str) -> str:
    """`matmul` if it is one of MATMULS, else ValueError naming them."""
    if matmul not in MATMULS:
        raise ValueError(f"unknown matmul {matmul!r}; choose {', '.join(MATMULS)}")
    return matmul


def check_kind(kind: str) -> str:
    """`kind` if it is one of QUANTIZE_KINDS, else ValueError naming them."""
    if kind not in QUANTIZE_KINDS:
        raise ValueError(f"unknown quantization {kind!r}; choose {', '.join(QUANTIZE_KINDS)}")
    return kind


def quantize_weight(weight: torch.Tensor, kind: str, matmul: str = "auto") -> Weight:
    """A linear weight [out, in] as `kind` ("none": the tensor itself), for our C kernels where
    they build and take its shape, else (or with matmul "aten") for torch's."""
    if check_kind(kind) == "none":
        return weight
    if weight.device.type != "cpu":
        raise ValueError(f"{kind} weights use torch's CPU kernels; the model is on {weight.device}")
    # the C kernel quantizes activations in whole blocks of its inputs (MatmulKernel)
    fits = weight.shape[1] % MatmulKernel.BLOCK == 0
    on_native = check_matmul(matmul) == "auto" and fits and matmul_kernel() is not None
    if kind == "int8":
        return _by_rows(quantize_int8_native if on_native else quantize_int8, weight)
    if weight.shape[1] % INT4_GROUP:
        return weight  # the kernels group whole inputs
    if on_native:
        return _by_rows(quantize_int4_native, weight)
    return quantize_int4(weight, INT4_GROUP)  # torch's packing: whole


def _by_rows(quantize, weight: torch.Tensor) -> Weight:
    """quantize(weight) for a format whose tensors hold its rows, in whole tiles, along their
    first dimension (every one but Int4Weight): ROWS_AT_ONCE rows quantized at a time, their
    parts joined. The same values (a row, a tile, is quantized alone), with the float32 copies
    of ROWS_AT_ONCE rows at a time, not of the whole weight (a head's is 4 bytes a parameter)."""
    if weight.shape[0] <= ROWS_AT_ONCE:
        return quantize(weight)
    parts = []
    for rows in weight.split(ROWS_AT_ONCE):
        parts.append(quantize(rows))
        trim_heap()  # a part's float32 temporaries freed back, not kept under the parts (heap.py)
    joined = {
        name: torch.cat([getattr(part, name) for part in parts])
        for name, value in parts[0]._asdict().items()
        if isinstance(value, torch.Tensor)
    }
    if "out" in parts[0]._fields:
        joined["out"] = weight.shape[0]
    return parts[0]._replace(**joined)


def kernel_name(weight: Weight) -> str:
    """What runs a weight's matmuls: c-VARIANT (our C kernels as built for this CPU, VARIANT
    being kernels.build.variant()'s), aten (torch's weight-only kernels), dense-c-VARIANT (a plain
    tensor on our C kernel) or dense (on torch's)."""
    if isinstance(weight, NATIVE_WEIGHTS):
        return f"c-{matmul_kernel().variant}"
    if not isinstance(weight, torch.Tensor):
        return "aten"
    on_native = _dense_on_native(torch.empty(0, dtype=weight.dtype), weight)
    return f"dense-c-{matmul_kernel().variant}" if on_native else "dense"


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Symmetric per-row int8: w ~ q * scale, q in [-127, 127]."""
    w = weight.detach().float()
    # the scales as stored (in the kernel's dtype), each q the nearest level for them: rounding
    # a float32 scale to bfloat16 after would move q = 127 by up to half a step
    scales = (w.abs().amax(dim=1).clamp(min=1e-12) / 127).to(compute_dtype(weight.dtype))  # [out]
    q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(q.contiguous(), scales)


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
    return Int4Weight(packed, scales_zeros.to(compute_dtype(weight.dtype)), group)


def quantize_int8_native(weight: torch.Tensor) -> NativeInt8Weight:
    """Symmetric per-row int8 for the C kernel: w ~ q * scale, q in [-127, 127], scale float32;
    q in tiles of TILE rows (native_int8_levels reads it back)."""
    w = _whole_tiles(weight.detach().float())
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127  # [out]
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    scales[weight.shape[0] :] = 0
    out, inputs = q.shape
    # [tiles, TILE, blocks, units, 4] -> [tiles, blocks, units, TILE, 4]: 4 inputs of 16 rows a line
    tiled = q.view(out // TILE, TILE, inputs // INT4_GROUP, INT4_GROUP // 4, 4).permute(
        0, 2, 3, 1, 4
    )
    levels = tiled.reshape(out, inputs).contiguous()
    return NativeInt8Weight(levels, scales.contiguous(), weight.shape[0])


def native_int8_levels(weight: NativeInt8Weight) -> torch.Tensor:
    """The int8 levels [out, in] of a NativeInt8Weight, in row order (its tiles undone)."""
    out, inputs = weight.weight.shape
    tiled = weight.weight.view(out // TILE, inputs // INT4_GROUP, INT4_GROUP // 4, TILE, 4)
    return tiled.permute(0, 3, 1, 2, 4).reshape(out, inputs)[: weight.out]


def quantize_int4_native(weight: torch.Tensor) -> NativeInt4Weight:
    """Asymmetric int4 per group of INT4_GROUP inputs for the C kernel: w ~ l * step + low, l in
    [0, 15], step and low as float16 (each l the nearest level for them as stored)."""
    w = _whole_tiles(weight.detach().float())
    out, inputs = w.shape
    w = w.view(out, inputs // INT4_GROUP, INT4_GROUP)
    low = w.amin(dim=-1).to(torch.float16)  # [out, groups]
    step = ((w.amax(dim=-1) - low.float()) / 15).to(torch.float16)
    levels = torch.round((w - low.float()[..., None]) / step.float().clamp(min=1e-30)[..., None])
    levels = levels.clamp(0, 15).to(torch.uint8)  # [out, groups, group]
    groups, tiles = inputs // INT4_GROUP, out // TILE
    # [tiles, TILE, groups, (low, high), p, j] -> [tiles, groups, p, TILE, j, (low, high)]: byte
    # 64 p + 4 c + j of a tile's group holds input 4p + j of its row c and input 16 + 4p + j
    pairs = levels.view(tiles, TILE, groups, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)
    packed = pairs[..., 0] | (pairs[..., 1] << 4)
    step, low = (t.view(tiles, TILE, groups).transpose(1, 2) for t in (step, low))
    return NativeInt4Weight(
        packed.reshape(out, inputs // 2).contiguous(),
        step.reshape(out, groups).contiguous(),
        low.reshape(out, groups).contiguous(),
        weight.shape[0],
    )


def _whole_tiles(w: torch.Tensor) -> torch.Tensor:
    """w [out, in] with zero rows after it up to a multiple of TILE rows."""
    missing = -w.shape[0] % TILE
    return torch.cat([w, w.new_zeros(missing, w.shape[1])]) if missing else w


def native_int4_values(weight: NativeInt4Weight) -> tuple[torch.Tensor, ...]:
    """The levels [out, in] (uint8, 0..15), steps and lows [out, in / INT4_GROUP] (float16) of a
    NativeInt4Weight, in row order (its tiles undone)."""
    out, groups = weight.steps.shape
    tiles = out // TILE
    pairs = weight.packed.view(tiles, groups, 4, TILE, 4)
    levels = torch.stack([pairs & 0x0F, pairs >> 4], dim=-1)  # [tiles, groups, p, TILE, j, 2]
    levels = levels.permute(0, 3, 1, 5, 2, 4).reshape(out, groups * INT4_GROUP)
    step, low = (t.view(tiles, groups, TILE).transpose(1, 2).reshape(out, groups)
                 for t in (weight.steps, weight.lows))  # fmt: skip
    return levels[: weight.out], step[: weight.out], low[: weight.out]


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a plain or quantized weight: x [..., in] -> [..., out]. A row's result does
    not depend on the other rows of the call (`dense`; the quantized kernels are so already)."""
    if isinstance(weight, torch.Tensor):
        return dense(x, weight, bias)
    # the kernels take contiguous 2-D inputs; a lone stream's [1, in] goes as it is (each
    # reshape is one more operator call in a step of a few milliseconds)
    flat = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, x.shape[-1]).contiguous()
    if isinstance(weight, NATIVE_WEIGHTS):
        y = _native_linear(flat, weight)
        if x.dim() != 2:
            y = y.view(*x.shape[:-1], y.shape[-1])
        return y if bias is None else y + bias
    int8 = isinstance(weight, Int8Weight)
    compute = (weight.scales if int8 else weight.scales_zeros).dtype  # compute_dtype
    if flat.dtype != compute:
        flat = flat.to(compute)
    if int8:
        y = torch.ops.aten._weight_int8pack_mm(flat, weight.weight, weight.scales)
    else:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            flat, weight.packed, weight.group, weight.scales_zeros
        )
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    if x.dim() != 2:
        y = y.view(*x.shape[:-1], y.shape[-1])
    return y if bias is None else y + bias


def native_linear(
    x: torch.Tensor, weight: NativeInt8Weight | NativeInt4Weight, **around
) -> torch.Tensor:
    """x [m, in] (float32 or bfloat16, contiguous) . W^T through the C kernel, with what
    MatmulKernel takes around it (an RMS norm or silu(gate) * up before, bias and a
    residual after) -> [m, out] in x's dtype."""
    kernel = matmul_kernel()
    if isinstance(weight, NativeInt4Weight):
        return kernel.q4(x, *weight, **around)
    return kernel.q8(x, *weight, **around)


def _native_linear(flat: torch.Tensor, weight: NativeInt8Weight | NativeInt4Weight) -> torch.Tensor:
    """flat [m, in] . W^T through the C kernel, in flat's dtype (float16 through float32)."""
    if torch.compiler.is_compiling():  # ctypes is opaque to dynamo: this call runs eagerly
        torch._dynamo.graph_break()  # (imported only when compiling: 1.2 s at every start)
    y = native_linear(flat if flat.dtype in DTYPES else flat.float(), weight)
    return y if y.dtype == flat.dtype else y.to(flat.dtype)


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, on a CPU through our C kernel (MatmulKernel.dense) where it builds.

    torch's CPU matmuls pick their kernel and blocking by the call's row count and a row's
    place in the call, so a row's float32 or bfloat16 result differs in the last bits with its
    batch mates, which flips a sampled token now and then. Padding a call to whole 4-row panels
    was enough on a Zen 5 CPU; on an Intel Xeon with AMX neither padding nor calls of one fixed
    size were, natively and under the AVX2 caps (MKL computed the rows at some places in a call
    one way and the rest another). Our kernel sums each row in an order fixed by its input count
    alone (docs/design.md, "One model whatever the load"). Without it (no C compiler, a
    GPU), torch's.
    """
    if not _dense_on_native(x, weight):
        return F.linear(x, weight, bias)
    flat = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, x.shape[-1]).contiguous()
    around = {"bias": bias} if bias is not None and bias.dtype == x.dtype else {}
    y = matmul_kernel().dense(flat, weight, **around)
    if bias is not None and not around:
        y = y + bias
    return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])


def _dense_on_native(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `dense` runs this call on our C kernel."""
    if torch.compiler.is_compiling():  # ctypes is opaque to dynamo: torch's inside a graph
        return False
    return (
        weight.device.type == "cpu"
        and x.dtype in DTYPES
        and weight.dtype in DTYPES
        and weight.is_contiguous()
        and matmul_kernel() is not None
    )


def weight_bytes(weight: Weight) -> int:
    """Bytes a decode step reads for this weight."""
    if isinstance(weight, torch.Tensor):
        return weight.numel() * weight.element_size()
    return sum(t.numel() * t.element_size() for t in weight if isinstance(t, torch.Tensor))
