"""The compact forward's C kernels (csrc/): built once with the machine's C compiler into one
library, kept in the cache folder, called through ctypes.

    kernel = native.attention_kernel()          # None where it cannot be built (reason logged)
    kernel(q, k_layer, v_layer, out, placed, window, scale)
    matmul = native.matmul_kernel()             # the quantized matmuls (csrc/quant_matmul.c)
    y = matmul.q4(x, packed, steps, lows, out)

The library's name carries a digest of its sources, flags and compiler, so an edited source or a
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
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import torch

from streaming_backend.model.hardware import ATEN_BELOW_AVX512
from streaming_backend.paths import cache_dir

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (CSRC / "exact_attention.c", CSRC / "quant_matmul.c", CSRC / "team.c")  # one library
HEADERS = (CSRC / "common.h", CSRC / "team.h")
AMX_VARIABLE = "TOKENSTREAM_AMX"  # 0: the quantized matmuls leave AMX alone
COMPILER_VARIABLE = "CC"  # the C compiler, as make reads it; else gcc, else cc
# -ffp-contract=off: no multiply and add fused unless the source says so, so every copy of an
# inlined function rounds alike (a row's numbers must not depend on the tile it falls in)
BASE_FLAGS = ("-O3", "-fPIC", "-shared", "-pthread", "-fno-math-errno", "-ffp-contract=off")
X86_AVX2_FLAGS = ("-mavx2", "-mfma", "-mf16c")  # every CPU kind here has them
# AVX-512 with VNNI: the quantized matmuls' integer dot products, two blocks an instruction, and
# the attention's sums 16 lanes a register (the same sums as the AVX2 build, so the same bits)
X86_AVX512_FLAGS = (*X86_AVX2_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl")
X86_AVX512_FLAGS += ("-mavx512vnni",)
# AMX's tile multiplies where the CPU has them (asked at run time, csrc/quant_matmul.c's ts_amx):
# the same block dots, so the same bits, from the same build; left out where the compiler does
# not know them (gcc before 11), so an older compiler still builds the AVX-512 kernels
AMX_FLAGS = ("-mamx-tile", "-mamx-int8")
NEEDS = {  # /proc/cpuinfo flags per variant
    "avx2": {"avx2", "fma", "f16c"},
    "avx512": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"},
}
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
            _threads(),
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
            _threads(),
        )  # fmt: skip
        if status:
            raise RuntimeError(f"rope attention kernel: {STATUS.get(status, status)}")
        return out


class MatmulKernel:
    """The loaded library's quantized matmuls (csrc/quant_matmul.c): activations quantized in
    blocks of BLOCK inputs, integer dot products, float32 sums in an order fixed by k; a
    prologue on x (RMS norm, or silu(gate) * up) and bias and residual after, so a decoder layer
    is a few calls."""

    BLOCK = 32  # inputs per block (QK in the source): k must be a multiple
    TILE = 16  # quantized weight rows a tile takes together (TILE in the source)
    # how the quantized matmuls sum a value (the source's top comment), named in the numerics:
    # each block's exact integer dot product, then the blocks in float32 in the order of k
    SUMS = "block-dots-in-order"
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
        self._greedy = library.ts_greedy_rows
        self._greedy.restype = ctypes.c_int
        self._greedy.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
        self._greedy.argtypes += [ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int32)]
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

    def greedy(self, logits: torch.Tensor) -> tuple[list[int], list[bool]]:
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
            self.PROLOGUES[prologue], _ptr(norm), eps, _ptr(bias), _ptr(add_to), _threads(),
        )  # fmt: skip
        if status:
            raise RuntimeError(f"quantized matmul kernel: {STATUS.get(status, status)}")
        return y


class _StackLinear(ctypes.Structure):
    """csrc/quant_matmul.c's StackLinear: a quantized weight [n, k] and its float32 bias."""

    _fields_ = [
        *[(name, ctypes.c_int64) for name in ("kind", "n", "k")],
        *[(name, ctypes.c_void_p) for name in ("w", "steps", "lows", "scales", "bias")],
    ]


class _StackLayer(ctypes.Structure):
    """csrc/quant_matmul.c's StackLayer: one decoder layer's weights, norms and RoPE tables."""

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

    Q8, Q4 = 0, 1  # the kernel's weight kinds (csrc/quant_matmul.c)

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
        return _StackLinear(kind, n, k, *[_ptr(t) for t in tensors], _ptr(bias))

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
            placed.places.data_ptr(), placed.positions.data_ptr(), _threads(),
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


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _threads() -> int:
    """The kernels' threads: torch's count (the engine's StepThreads sets it per step)."""
    return torch.get_num_threads()


def variant(environ: Mapping[str, str] = os.environ) -> str:
    """The build this CPU takes (NEEDS, from /proc/cpuinfo): 'avx512' (with VNNI), 'avx2', else
    'generic'. ATEN_CPU_CAPABILITY=avx2 (or lower) keeps an AVX-512 CPU on the AVX2 build, as
    it keeps torch's kernels: CI's run under the AVX2 caps tests that build here."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return "generic"
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "generic"
    capped = environ.get("ATEN_CPU_CAPABILITY", "").lower() in ATEN_BELOW_AVX512
    if NEEDS["avx512"] <= flags and not capped:
        return "avx512"
    return "avx2" if NEEDS["avx2"] <= flags else "generic"


def compiler() -> str | None:
    """$CC, else gcc, else cc, as found on PATH; None when there is none."""
    found = (
        shutil.which(name) for name in (os.environ.get(COMPILER_VARIABLE), "gcc", "cc") if name
    )
    return next((path for path in found if path), None)


def library_path(cc: str, kind: str) -> Path:
    """Where the library built from these sources with `cc` for `kind` lives."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    for part in (" ".join(flags(kind, cc)).encode(), version.encode()):
        digest.update(part)
    return cache_dir() / "native" / f"tokenstream_kernels-{kind}-{digest.hexdigest()[:12]}.so"


def flags(kind: str, cc: str | None = None) -> tuple[str, ...]:
    """The compiler flags of a build for `kind` (with `cc`: AMX's only if it takes them)."""
    chosen = BASE_FLAGS + {"avx2": X86_AVX2_FLAGS, "avx512": X86_AVX512_FLAGS}.get(kind, ())
    if kind == "avx512" and (cc is None or accepts(cc, AMX_FLAGS)):
        chosen += AMX_FLAGS
    return chosen


@functools.cache
def accepts(cc: str, options: tuple[str, ...]) -> bool:
    """Whether `cc` compiles an empty C file with these options."""
    command = [cc, *options, "-x", "c", "-c", "-o", os.devnull, "-"]
    return subprocess.run(command, input="", capture_output=True, text=True).returncode == 0


def build(cc: str, kind: str) -> Path:
    """Build the library unless it is there; return its path (CalledProcessError on failure)."""
    target = library_path(cc, kind)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=target.name + ".", dir=target.parent)
    os.close(fd)
    try:
        command = [cc, *flags(kind, cc), "-o", partial, *map(str, SOURCES), "-lm"]
        subprocess.run(command, check=True, capture_output=True, text=True)
        os.replace(partial, target)  # atomic: a concurrent build renames the same bytes
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


@functools.cache
def library() -> tuple[ctypes.CDLL, str] | None:
    """The kernels' library and its variant, built if needed; None (with a warning saying why)
    where it cannot be: the compact forward then attends with torch, one call per token, and
    runs its quantized weights on torch's kernels."""
    cc = compiler()
    if cc is None:
        log.warning("no C compiler (gcc, cc or $CC): the forward's kernels run on torch, slower")
        return None
    kind = variant()
    try:
        return ctypes.CDLL(str(build(cc, kind))), kind
    except subprocess.CalledProcessError as exc:
        log.warning("building the C kernels failed, the forward runs on torch: %s", exc.stderr)
    except OSError as exc:
        log.warning("loading the C kernels failed, the forward runs on torch: %s", exc)
    return None


@functools.cache
def attention_kernel() -> AttentionKernel | None:
    """The exact attention kernel; None where the library cannot be built."""
    loaded = library()
    return AttentionKernel(*loaded) if loaded else None


def decoder_stack(layers: list[StackSpec], hidden: int, dims) -> DecoderStack | None:
    """DecoderStack over `layers` (dims: their llama.Dims); None where the library cannot be
    built."""
    loaded = library()
    return DecoderStack(loaded[0], layers, hidden, dims) if loaded else None


@functools.cache
def matmul_kernel() -> MatmulKernel | None:
    """The quantized matmul kernels; None where the library cannot be built."""
    loaded = library()
    return MatmulKernel(*loaded) if loaded else None


def forget() -> None:
    """Forget the loaded kernels, so the next call looks for a compiler again (tests)."""
    for cached in (library, attention_kernel, matmul_kernel):
        cached.cache_clear()


def main() -> int:
    """Build the kernels now (scripts/setup.sh); exit 1 if they cannot be built."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    loaded = library()
    if loaded is None:
        return 1
    print(f"C kernels: {loaded[1]}, {library_path(compiler(), loaded[1])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
