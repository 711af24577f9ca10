"""Reading a request through Triton: its input tensors, copied out of Triton's memory.

Both models' execute() start here. The pb_utils module is importable only inside the model's
process, so it is given; tests pass a small fake with the same name.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def copy_inputs(pb_utils, request, names: Iterable[str]) -> dict[str, np.ndarray]:
    """Copy each of `names` the request sent out of Triton's memory (released when execute
    returns); tensor name -> array, absent inputs left out."""
    arrays = {}
    for name in names:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is not None:
            arrays[name] = tensor.as_numpy().copy()
    return arrays
