"""The exact attention kernels (csrc/attention.c): each token over exactly its own positions of a
slot KV cache, and the same from a layer's q/k/v projection with RoPE and the cache writes.

    kernel = attention.attention_kernel()   # None where the library cannot be built (reason logged)
    out = kernel(q, k_layer, v_layer, placed, window, scale)
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from streaming_backend.kernels.abi import DTYPES, STATUS, threads
from streaming_backend.kernels.build import library, per_library


class Placed(NamedTuple):
    """Where each of n tokens attends: its slot's place in the cache and its position there, as
    int64 CPU tensors [n] (the kernel reads them) and host ints (the torch path does)."""

    places: torch.Tensor
    positions: torch.Tensor
    rows: list[tuple[int, int]]  # (place, position) per token

    @classmethod
    def of(cls, rows: list[tuple[int, int]]) -> Placed:
        """The Placed of host (place, position) pairs."""
        table = torch.tensor(rows, dtype=torch.long).reshape(-1, 2)
        return cls(table[:, 0].contiguous(), table[:, 1].contiguous(), rows)


class AttentionKernel:
    """The loaded library's `ts_exact_attention`, and what it was built as."""

    def __init__(self, library: ctypes.CDLL, variant: str):
        self.variant = variant  # "avx512", "avx2" or "generic": part of the numerics (numerics.py)
        fn = library.ts_exact_attention
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int, *[ctypes.c_void_p] * 6, *[ctypes.c_int64] * 7]
        fn.argtypes += [ctypes.c_float, ctypes.c_float, ctypes.c_int]
        self._fn = fn
        rope = library.ts_rope_attention
        rope.restype = ctypes.c_int
        rope.argtypes = [ctypes.c_int, ctypes.c_int, *[ctypes.c_void_p] * 3, ctypes.c_int64]
        rope.argtypes += [*[ctypes.c_void_p] * 5, *[ctypes.c_int64] * 7]
        rope.argtypes += [ctypes.c_float, ctypes.c_float, ctypes.c_int]
        self._rope = rope

    def __call__(
        self,
        q: torch.Tensor,  # [n, kv_heads, groups, head_dim], contiguous
        # [places, kv_heads, rows, head_dim], contiguous: position p in row p mod rows
        k_layer: torch.Tensor,
        v_layer: torch.Tensor,
        placed: Placed,
        window: int,
        scale: float,
        cap: float | None = None,
    ) -> torch.Tensor:
        """Each token's attention over positions [max(0, position + 1 - window), position] of
        its place (row position mod rows: a sliding window's ring; they must fit in the rows)
        -> [n, kv_heads * groups * head_dim] in q's dtype. Scores times `scale`, then
        soft-capped at `cap` where given (cap * tanh(score / cap))."""
        n, kv_heads, groups, head_dim = q.shape
        out = torch.empty_like(q)
        status = self._fn(
            DTYPES[q.dtype],
            q.data_ptr(),
            k_layer.data_ptr(),
            v_layer.data_ptr(),
            out.data_ptr(),
            placed.places.data_ptr(),
            placed.positions.data_ptr(),
            n,
            k_layer.shape[0],
            kv_heads,
            groups,
            head_dim,
            k_layer.shape[2],
            min(window, 1 << 62),
            scale,
            cap or 0.0,
            threads(),
        )
        if status:
            raise RuntimeError(f"exact attention kernel: {STATUS.get(status, status)}")
        return out.reshape(n, -1)

    def with_rope(
        self,
        qkv: torch.Tensor,  # [n, (heads + 2 kv_heads) * head_dim], contiguous
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [positions, head_dim]
        k_layer: torch.Tensor,  # [places, kv_heads, rows, head_dim], contiguous (as __call__)
        v_layer: torch.Tensor,
        placed: Placed,
        window: int,
        groups: int,
        scale: float | None = None,
        cap: float | None = None,
    ) -> torch.Tensor:
        """From a layer's q/k/v projection: RoPE on the queries and keys, every token's key and
        value written at its place and position (row position mod rows), then each token's
        attention over exactly its own positions (as `__call__`; scores times `scale`,
        1/sqrt(head_dim) when None, and soft-capped at `cap` where given) -> [n, heads *
        head_dim] in qkv's dtype. All are written before any attends, so in a ring a call's
        tokens of one place span at most rows - window + 1 positions. The cache may have
        another dtype (float32 activations over a bfloat16 cache); the turned queries stay
        float32."""
        cos, sin = rope
        places, kv_heads, rows, head_dim = k_layer.shape
        n, heads = qkv.shape[0], kv_heads * groups
        tensors = (qkv, cos, sin, k_layer, v_layer)
        if (
            any(not t.is_contiguous() or t.dtype not in DTYPES for t in tensors)
            or cos.dtype != qkv.dtype
            or sin.dtype != qkv.dtype
            or v_layer.dtype != k_layer.dtype
            or qkv.shape[1] != (heads + 2 * kv_heads) * head_dim
            or cos.shape[1] != head_dim
        ):
            raise ValueError("rope attention: contiguous tensors, shapes and dtypes matching")
        out = qkv.new_empty(n, heads * head_dim)
        status = self._rope(
            DTYPES[qkv.dtype], DTYPES[k_layer.dtype],
            qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.shape[0],
            k_layer.data_ptr(), v_layer.data_ptr(), out.data_ptr(),
            placed.places.data_ptr(), placed.positions.data_ptr(),
            n, places, kv_heads, groups, head_dim, rows, min(window, 1 << 62),
            head_dim**-0.5 if scale is None else scale,
            cap or 0.0,
            threads(),
        )  # fmt: skip
        if status:
            raise RuntimeError(f"rope attention kernel: {STATUS.get(status, status)}")
        return out


@per_library
def attention_kernel() -> AttentionKernel | None:
    """The exact attention kernel; None where the library cannot be built."""
    loaded = library()
    return AttentionKernel(*loaded) if loaded else None
