"""The decoder stack kernel (csrc/stack.c): every decoder layer of a model on n tokens in one C
call, the same calls in the same order as llama.native_layer's, so the same bits.

    stack = stack.decoder_stack(layers, hidden, dims)   # None where the library cannot be built
    x = stack(x, k_cache, v_cache, placed)
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from streaming_backend.kernels.abi import DTYPES, STATUS, ptr, threads
from streaming_backend.kernels.attention import Placed
from streaming_backend.kernels.build import library
from streaming_backend.kernels.matmul import MatmulKernel


class _StackLinear(ctypes.Structure):
    """csrc/stack.c's StackLinear: a quantized weight [n, k] and its float32 bias."""

    _fields_ = [
        *[(name, ctypes.c_int64) for name in ("kind", "n", "k")],
        *[(name, ctypes.c_void_p) for name in ("w", "steps", "lows", "scales", "bias")],
    ]


class _StackLayer(ctypes.Structure):
    """csrc/stack.c's StackLayer: one decoder layer's weights, norms and RoPE tables."""

    _fields_ = [
        *[(name, ctypes.c_void_p) for name in ("norm1", "norm2", "cos", "sin")],
        ("table_positions", ctypes.c_int64),
        ("window", ctypes.c_int64),
        *[(name, _StackLinear) for name in ("qkv", "o", "gate_up", "down")],
    ]


class StackSpec(NamedTuple):
    """One layer of a DecoderStack: what llama.native_layer takes of a block with nothing
    between its calls. Each linear is (weight, bias): a quant.NativeInt4Weight (packed, steps,
    lows) or NativeInt8Weight (weight, scales), and a float32 bias or None; norms and the RoPE
    tables float32."""

    norm1: torch.Tensor
    norm2: torch.Tensor
    qkv: tuple[NamedTuple, torch.Tensor | None]
    o: tuple[NamedTuple, torch.Tensor | None]
    gate_up: tuple[NamedTuple, torch.Tensor | None]
    down: tuple[NamedTuple, torch.Tensor | None]
    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin [positions, head_dim]
    window: int


class DecoderStack:
    """Every decoder layer of a model on n tokens in one C call (`ts_decoder_stack`): the five
    calls of llama.native_layer per layer, run by the same functions in the same order, so the
    same bits, without the Python and ctypes between them. For layers with no head norms, post
    norms or experts, whose weights are all ours (int4 or int8)."""

    Q8, Q4 = 0, 1  # the kernel's weight kinds (csrc/matmul.h)

    def __init__(self, library: ctypes.CDLL, layers: list[StackSpec], hidden: int, dims):
        """dims: the layers' llama.Dims (heads, kv_heads, head_dim, eps, scale, activation,
        cap)."""
        self.hidden, self.dims = hidden, dims
        self.activation = MatmulKernel.PROLOGUES[f"{dims.activation}_mul"]
        self._keep = layers  # the tensors the structures point into
        self._layers = (_StackLayer * len(layers))(*[self._layer(spec) for spec in layers])
        fn = library.ts_decoder_stack
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, *[ctypes.c_int64] * 5]
        fn.argtypes += [ctypes.c_int, *[ctypes.c_float] * 3, ctypes.c_int, *[ctypes.c_void_p] * 3]
        fn.argtypes += [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        self._fn = fn
        # the caches last checked and their arguments (`_cache_arguments`)
        self._caches: tuple | None = None

    def _layer(self, spec: StackSpec) -> _StackLayer:
        cos, sin = spec.rope
        floats = (*spec.rope, spec.norm1, spec.norm2)
        if any(t.dtype != torch.float32 or not t.is_contiguous() for t in floats):
            raise ValueError("decoder stack: float32 contiguous norms and RoPE tables")
        linears = [self._linear(*getattr(spec, name)) for name in ("qkv", "o", "gate_up", "down")]
        return _StackLayer(
            spec.norm1.data_ptr(), spec.norm2.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            cos.shape[0], min(spec.window, 1 << 62), *linears,
        )  # fmt: skip

    def _linear(self, weight: NamedTuple, bias: torch.Tensor | None) -> _StackLinear:
        n = weight.out
        if hasattr(weight, "packed"):  # int4: two inputs a byte
            k = weight.packed.shape[1] * 2
            parts = (self.Q4, weight.packed, weight.steps, weight.lows, None)
        else:
            k = weight.weight.shape[1]
            parts = (self.Q8, weight.weight, None, None, weight.scales)
        if bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,)):
            raise ValueError(f"decoder stack: bias must be float32 ({n},)")
        kind, *tensors = parts
        return _StackLinear(kind, n, k, *[ptr(t) for t in tensors], ptr(bias))

    def __call__(self, x: torch.Tensor, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor],
                 placed: Placed) -> torch.Tensor:  # fmt: skip
        """x [n, hidden] float32, contiguous, through every layer, written into x; k_cache,
        v_cache: each layer's [places, kv_heads, rows, head_dim] (llama.native_layer's)."""
        if (
            x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.hidden
            or not x.is_contiguous()
        ):  # fmt: skip
            raise ValueError(f"decoder stack: x {tuple(x.shape)} {x.dtype}")
        caches = self._caches
        if caches is None or caches[0] is not k_cache or caches[1] is not v_cache:
            caches = (k_cache, v_cache, *self._cache_arguments(k_cache, v_cache))
            # kept for tuples alone: a list could be changed in place between calls
            self._caches = (
                caches if isinstance(k_cache, tuple) and isinstance(v_cache, tuple) else None
            )
        status = self._fn(
            ctypes.addressof(self._layers), len(self._keep), x.data_ptr(), x.shape[0],
            self.hidden, self.dims.heads, self.dims.kv_heads, self.dims.head_dim, self.activation,
            self.dims.eps, self.dims.scale, self.dims.cap, *caches[2:],
            placed.places.data_ptr(), placed.positions.data_ptr(), threads(),
        )  # fmt: skip
        if status:
            raise RuntimeError(f"decoder stack kernel: {STATUS.get(status, status)}")
        return x

    def _cache_arguments(self, k_cache, v_cache) -> tuple:
        """The kernel's arguments for these caches, checked: (dtype code, K pointers, V
        pointers, rows per layer, places). Kept while the same tuples of caches come (a model's
        cache holds one tuple of tensors per K and V for its life; caches no longer used are let
        go at the next call with others): checking 2 x 30 tensors and building the arrays took
        about 55 of the 67 us of Python around a default-model step's call, run with the
        caches cold."""
        count = len(self._keep)
        if len(k_cache) != count or len(v_cache) != count:
            raise ValueError(f"decoder stack: {count} layers' caches needed")
        first = k_cache[0]
        places, dtype = first.shape[0], first.dtype
        for k, v in zip(k_cache, v_cache):
            if (
                k.dtype != dtype or v.dtype != dtype or k.shape != v.shape or k.shape[0] != places
                or k.shape[1] != self.dims.kv_heads or k.shape[3] != self.dims.head_dim
                or not k.is_contiguous() or not v.is_contiguous()
            ):  # fmt: skip
                raise ValueError("decoder stack: caches of [places, kv_heads, rows, head_dim]")
        if dtype not in DTYPES:
            raise ValueError(f"decoder stack: a {dtype} cache")
        return (
            DTYPES[dtype],
            (ctypes.c_void_p * count)(*[k.data_ptr() for k in k_cache]),
            (ctypes.c_void_p * count)(*[v.data_ptr() for v in v_cache]),
            (ctypes.c_int64 * count)(*[k.shape[2] for k in k_cache]),
            places,
        )


def decoder_stack(layers: list[StackSpec], hidden: int, dims) -> DecoderStack | None:
    """DecoderStack over `layers` (dims: their llama.Dims); None where the library cannot be
    built."""
    loaded = library()
    return DecoderStack(loaded[0], layers, hidden, dims) if loaded else None
