"""What the kernels' bindings share with the C side (csrc/common.h): the dtype and status codes,
and how a call passes pointers and its thread count."""

from __future__ import annotations

import torch

DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the kernels' dtype codes
STATUS = {1: "bad arguments", 2: "out of memory"}  # their error codes


def ptr(tensor: torch.Tensor | None) -> int | None:
    """A tensor's data pointer, None for None (a NULL argument)."""
    return None if tensor is None else tensor.data_ptr()


def threads() -> int:
    """The kernels' threads: torch's count (the engine's StepThreads sets it per step)."""
    return torch.get_num_threads()
