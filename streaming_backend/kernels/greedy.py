"""A greedy step's pick (csrc/greedy.c): each row's first largest logit, and whether its sum is
finite for certain; sampling/logits.py takes it for plainly greedy rows.

    pick = greedy.greedy_kernel()           # None where the library cannot be built
    ids, sure = pick(logits)
"""

from __future__ import annotations

import ctypes

import torch

from streaming_backend.kernels.abi import STATUS
from streaming_backend.kernels.build import library, per_library


class GreedyKernel:
    """The loaded library's `ts_greedy_rows`, and what it was built as."""

    def __init__(self, library: ctypes.CDLL, variant: str):
        self.variant = variant
        self._greedy = library.ts_greedy_rows
        self._greedy.restype = ctypes.c_int
        self._greedy.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
        self._greedy.argtypes += [ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int32)]

    def __call__(self, logits: torch.Tensor) -> tuple[list[int], list[bool]]:
        """Each row of logits [B, V] (float32, contiguous, on the CPU): the first index of its
        largest value, and whether its sum is finite for certain (every value finite, 2 V
        max|x| below float's range); a row not certain gets 0 (`ts_greedy_rows`)."""
        if logits.dtype != torch.float32 or logits.dim() != 2 or not logits.is_contiguous():
            raise ValueError(f"greedy: logits {tuple(logits.shape)} {logits.dtype}")
        rows, vocab = logits.shape
        ids, sure = (ctypes.c_int64 * rows)(), (ctypes.c_int32 * rows)()
        status = self._greedy(logits.data_ptr(), rows, vocab, ids, sure)
        if status:
            raise RuntimeError(f"greedy kernel: {STATUS.get(status, status)}")
        return list(ids), [bool(s) for s in sure]


@per_library
def greedy_kernel() -> GreedyKernel | None:
    """The greedy pick; None where the library cannot be built."""
    loaded = library()
    return GreedyKernel(*loaded) if loaded else None
