"""The matmul kernels (csrc/matmul.c): quantized (int4, int8) and dense weights, with a prologue
on x (RMS norm, or act(gate) * up) and bias and residual after.

    matmul = matmul.matmul_kernel()         # None where the library cannot be built
    y = matmul.q4(x, packed, steps, lows, out)
"""

from __future__ import annotations

import ctypes
import os

import torch

from streaming_backend.kernels.abi import DTYPES, STATUS, ptr, threads
from streaming_backend.kernels.build import AMX_VARIABLE, library, per_library


class MatmulKernel:
    """The loaded library's matmuls (csrc/matmul.c): activations quantized in
    blocks of BLOCK inputs, integer dot products, float32 sums in an order fixed by k; a
    prologue on x (RMS norm, or silu(gate) * up) and bias and residual after, so a decoder layer
    is a few calls."""

    BLOCK = 32  # inputs per block (QK in the source): k must be a multiple
    TILE = 16  # quantized weight rows a tile takes together (TILE in the source)
    # an activation block's largest |v| (V_MAX in the source): its values rounded to the levels
    # max|block| / LEVELS apart, v = 16 q + r in two int8 halves (about 12 bits)
    LEVELS = 127 * 16
    # how the quantized matmuls sum a value (csrc/matmul.c's top comment), named in the numerics:
    # activations at LEVELS per block, each block's exact integer dot product, then the blocks in
    # float32 in the order of k
    SUMS = f"levels-{LEVELS}-block-dots-in-order"
    PROLOGUES = {None: 0, "rms_norm": 1, "silu_mul": 2, "gelu_tanh_mul": 3}
    GATED = ("silu_mul", "gelu_tanh_mul")  # prologues of an MLP's [gate, up]: x is [m, 2k]

    def __init__(self, library: ctypes.CDLL, variant: str):
        self.variant = variant
        head = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, *[ctypes.c_int64] * 3]
        tail = [ctypes.c_int, ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p]
        self._q4 = library.ts_q4_matmul
        self._q4.argtypes = [*head, *[ctypes.c_void_p] * 3, *tail, ctypes.c_int]
        self._q8 = library.ts_q8_matmul
        self._q8.argtypes = [*head, *[ctypes.c_void_p] * 2, *tail, ctypes.c_int]
        self._dense = library.ts_dense_matmul
        self._dense.argtypes = [*head, ctypes.c_void_p, ctypes.c_int, *tail, ctypes.c_int]
        for fn in (self._q4, self._q8, self._dense):
            fn.restype = ctypes.c_int
        self._amx = library.ts_amx
        self._amx.restype = ctypes.c_int
        self._amx.argtypes = [ctypes.c_int]
        if os.environ.get(AMX_VARIABLE, "") == "0":
            self._amx(0)

    @property
    def amx(self) -> bool:
        """Whether the quantized matmuls' block dots run on AMX (a Xeon's tile multiplies):
        the same bits as without; TOKENSTREAM_AMX=0 keeps them off."""
        return bool(self._amx(-1))

    @amx.setter
    def amx(self, on: bool) -> None:
        self._amx(1 if on else 0)

    def q4(self, x: torch.Tensor, packed, steps, lows, out: int, **around) -> torch.Tensor:
        """x . W^T [m, out] for the int4 W (packed [n, k / 2] uint8, steps and lows [n, k / 32]
        float16, n >= out rows in whole tiles: quant.NativeInt4Weight); `around` as `_run`
        takes it."""
        self._check_tiles(packed, out)
        ptrs = (packed.data_ptr(), steps.data_ptr(), lows.data_ptr())
        return self._run(self._q4, x, out, packed.shape[1] * 2, ptrs, **around)

    def q8(self, x: torch.Tensor, weight, scales, out: int, **around) -> torch.Tensor:
        """x . W^T [m, out] for W = weight [n, k] int8 * scales [n] float32, n >= out rows in
        whole tiles (quant.NativeInt8Weight); `around` as `_run` takes it."""
        self._check_tiles(weight, out)
        ptrs = (weight.data_ptr(), scales.data_ptr())
        return self._run(self._q8, x, out, weight.shape[1], ptrs, **around)

    def _check_tiles(self, weight: torch.Tensor, out: int) -> None:
        if weight.shape[0] != -(-out // self.TILE) * self.TILE:
            raise ValueError(f"quantized matmul: {weight.shape[0]} weight rows for {out} outputs")

    def dense(self, x: torch.Tensor, weight: torch.Tensor, **around) -> torch.Tensor:
        """x . W^T [m, n] for an unquantized W [n, k] (float32 or bfloat16, contiguous), each
        row in an order fixed by k; `around` as `_run` takes it."""
        if weight.dtype not in DTYPES or not weight.is_contiguous() or weight.dim() != 2:
            raise ValueError(f"dense matmul: weight {tuple(weight.shape)} {weight.dtype}")
        ptrs = (weight.data_ptr(), DTYPES[weight.dtype])
        n, k = weight.shape
        return self._run(self._dense, x, n, k, ptrs, **around)

    def _run(
        self,
        fn,
        x: torch.Tensor,  # [m, k] (GATED: [m, 2k]) float32 or bfloat16, contiguous
        n: int,
        k: int,
        ptrs: tuple[int, ...],
        # "rms_norm" (with norm [k], eps), "silu_mul" or "gelu_tanh_mul" (act(gate) * up)
        prologue: str | None = None,
        norm: torch.Tensor | None = None,
        eps: float = 0.0,
        bias: torch.Tensor | None = None,  # [n]
        add_to: torch.Tensor | None = None,  # [m, n]: y = add_to + product, written into it
    ) -> torch.Tensor:
        width = 2 * k if prologue in self.GATED else k
        if x.dim() != 2 or x.shape[1] != width or x.dtype not in DTYPES or not x.is_contiguous():
            raise ValueError(f"quantized matmul: x {tuple(x.shape)} {x.dtype} for k = {k}")
        m = x.shape[0]
        for name, tensor, shape in (
            ("norm", norm, (k,)),
            ("bias", bias, (n,)),
            ("add_to", add_to, (m, n)),
        ):
            if tensor is not None and (
                tensor.shape != shape or tensor.dtype != x.dtype or not tensor.is_contiguous()
            ):
                raise ValueError(f"quantized matmul: {name} must be {x.dtype} {shape}")
        if prologue == "rms_norm" and norm is None:
            raise ValueError("quantized matmul: rms_norm needs norm")
        y = add_to if add_to is not None else x.new_empty(m, n)
        status = fn(
            x.data_ptr(), y.data_ptr(), DTYPES[x.dtype], m, k, n, *ptrs,
            self.PROLOGUES[prologue], ptr(norm), eps, ptr(bias), ptr(add_to), threads(),
        )  # fmt: skip
        if status:
            raise RuntimeError(f"quantized matmul kernel: {STATUS.get(status, status)}")
        return y


@per_library
def matmul_kernel() -> MatmulKernel | None:
    """The matmul kernels; None where the library cannot be built."""
    loaded = library()
    return MatmulKernel(*loaded) if loaded else None
