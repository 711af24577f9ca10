"""The C kernel of exact attention (csrc/exact_attention.c): built once with the machine's C
compiler, kept in the cache folder, called through ctypes.

    kernel = native.attention_kernel()          # None where it cannot be built (reason logged)
    kernel(q, k_layer, v_layer, out, placed, window, scale)

The library's name carries a digest of its source, flags and compiler, so an edited source or a
new compiler builds a new one; a build goes to a temporary name and is renamed into place, so
processes building at once (a server's stubs, parallel tests) never load half a file.
`scripts/setup.sh` builds it ahead (`python -m streaming_backend.forward.native`), so a server
does not compile on its first request.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch

from streaming_backend.paths import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "exact_attention.c"
COMPILER_VARIABLE = "CC"  # the C compiler, as make reads it; else gcc, else cc
BASE_FLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno")
X86_AVX2_FLAGS = ("-mavx2", "-mfma")  # every CPU kind here has them; one build for both kinds
DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the kernel's dtype codes
STATUS = {1: "bad arguments", 2: "out of memory"}  # its error codes


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
        self.variant = variant  # "avx2" or "generic": part of the numerics (numerics.py)
        fn = library.ts_exact_attention
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int, *[ctypes.c_void_p] * 6, *[ctypes.c_int64] * 6]
        fn.argtypes += [ctypes.c_float, ctypes.c_int]
        self._fn = fn

    def __call__(
        self,
        q: torch.Tensor,  # [n, kv_heads, groups, head_dim], contiguous
        k_layer: torch.Tensor,  # [places, kv_heads, max_len, head_dim], contiguous
        v_layer: torch.Tensor,
        placed: Placed,
        window: int,
        scale: float,
    ) -> torch.Tensor:
        """Each token's attention over positions [max(0, position + 1 - window), position] of
        its place -> [n, kv_heads * groups * head_dim] in q's dtype."""
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
            kv_heads,
            groups,
            head_dim,
            k_layer.shape[2],
            min(window, 1 << 62),
            scale,
            torch.get_num_threads(),
        )
        if status:
            raise RuntimeError(f"exact attention kernel: {STATUS.get(status, status)}")
        return out.reshape(n, -1)


def variant() -> str:
    """'avx2' on an x86-64 CPU with AVX2 and FMA (from /proc/cpuinfo: the hardware, not what
    torch is told to use), else 'generic'."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return "generic"
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return "generic"
    return "avx2" if "avx2" in flags and "fma" in flags else "generic"


def compiler() -> str | None:
    """$CC, else gcc, else cc, as found on PATH; None when there is none."""
    found = (
        shutil.which(name) for name in (os.environ.get(COMPILER_VARIABLE), "gcc", "cc") if name
    )
    return next((path for path in found if path), None)


def library_path(cc: str, kind: str) -> Path:
    """Where the library built from this source with `cc` for `kind` lives."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(flags(kind)).encode(), version.encode()):
        digest.update(part)
    return cache_dir() / "native" / f"exact_attention-{kind}-{digest.hexdigest()[:12]}.so"


def flags(kind: str) -> tuple[str, ...]:
    """The compiler flags of a build for `kind`."""
    return BASE_FLAGS + (X86_AVX2_FLAGS if kind == "avx2" else ())


def build(cc: str, kind: str) -> Path:
    """Build the library unless it is there; return its path (CalledProcessError on failure)."""
    target = library_path(cc, kind)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=target.name + ".", dir=target.parent)
    os.close(fd)
    try:
        command = [cc, *flags(kind), "-o", partial, str(SOURCE), "-lm"]
        subprocess.run(command, check=True, capture_output=True, text=True)
        os.replace(partial, target)  # atomic: a concurrent build renames the same bytes
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


@functools.cache
def attention_kernel() -> AttentionKernel | None:
    """The kernel, built if needed; None (with a warning saying why) where it cannot be, and the
    compact forward then attends with torch, one call per token."""
    cc = compiler()
    if cc is None:
        log.warning("no C compiler (gcc, cc or $CC): exact attention runs on torch, slower")
        return None
    kind = variant()
    try:
        path = build(cc, kind)
        return AttentionKernel(ctypes.CDLL(str(path)), kind)
    except subprocess.CalledProcessError as exc:
        log.warning("building %s failed, attention runs on torch: %s", SOURCE.name, exc.stderr)
    except OSError as exc:
        log.warning("loading the exact attention kernel failed, attention runs on torch: %s", exc)
    return None


def main() -> int:
    """Build the kernel now (scripts/setup.sh); exit 1 if it cannot be built."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    kernel = attention_kernel()
    if kernel is None:
        return 1
    print(f"exact attention kernel: {kernel.variant}, {library_path(compiler(), kernel.variant)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
