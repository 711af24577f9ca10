"""The kernels' build (streaming_backend/kernels/build.py): its variants, names and flags, the
library built and loaded, and the builds of every variant giving the same bits (the cross-build
tests: AVX-512, AVX2 and portable)."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import pytest
import torch

from streaming_backend.forward import quant
from streaming_backend.kernels import attention, build, matmul
from streaming_backend.kernels.attention import Placed

PLACES, KV_HEADS, GROUPS, MAX_LEN = 6, 3, 3, 300  # the attention's cross-build cases
NO_WINDOW = 1 << 62
ROWS = [(0, 0), (1, 7), (2, 8), (3, 15), (4, 16), (5, 17), (0, 255), (1, 256), (2, 299)]


def test_no_compiler_means_torch_kernels_with_a_warning(monkeypatch, caplog):
    """Without a C compiler both kernels are None, the reason is logged, and quantized weights
    take torch's layouts (its weight-only kernels run them)."""
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv(build.COMPILER_VARIABLE, raising=False)
    assert build.compiler() is None
    build.forget()
    try:
        assert attention.attention_kernel() is None and matmul.matmul_kernel() is None
        assert "no C compiler" in caplog.text
        w = torch.randn(64, 128)
        assert isinstance(quant.quantize_weight(w, "int4"), quant.Int4Weight)
        assert isinstance(quant.quantize_weight(w, "int8"), quant.Int8Weight)
    finally:
        monkeypatch.undo()
        build.forget()
    assert isinstance(quant.quantize_weight(torch.randn(64, 128), "int4"), quant.NativeInt4Weight)


def test_a_build_goes_to_a_new_name_per_source_and_leaves_no_partial_file(tmp_path, monkeypatch):
    """The library is built under the cache folder with a digest in its name, loads, and a
    second build finds it instead of compiling again; no temporary file stays behind."""
    monkeypatch.setenv("TOKENSTREAM_CACHE", str(tmp_path))
    cc = build.compiler()
    path = build.build(cc, build.variant())
    assert path.parent == tmp_path / "native" and path.suffix == ".so"
    assert build.variant() in path.name
    library = ctypes.CDLL(str(path))
    library.ts_exact_attention, library.ts_q4_matmul, library.ts_q8_matmul  # noqa: B018 - there
    stamp = os.stat(path).st_mtime_ns
    assert build.build(cc, build.variant()) == path and os.stat(path).st_mtime_ns == stamp
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def cpu_has(variant: str) -> bool:
    """Whether this CPU runs the build `variant` (its row's needs)."""
    return build.VARIANTS[variant].needs <= build.cpu_flags()


@pytest.mark.skipif(not cpu_has("avx512"), reason="the CPU has no AVX-512 with VNNI")
def test_the_avx512_and_avx2_builds_give_the_same_bits(tmp_path, monkeypatch):
    """The AVX-512 build's matmuls sum the AVX2 build's products in the AVX2 build's order (the
    dense one is the same code): the same bits from both, whatever the rows, inputs (block
    counts even, odd, below and above 8; a dense input count off the lanes of 8), prologue and
    dtype. Its attention takes 16 lanes where the AVX2 build takes 8, each lane adding the
    products an AVX2 lane adds, in its order: the same bits too, whatever the head size and
    cache dtype. So an answer does not depend on which of the two CPU kinds served it."""
    monkeypatch.setenv("TOKENSTREAM_CACHE", str(tmp_path))
    cc = build.compiler()
    built = {v: ctypes.CDLL(str(build.build(cc, v))) for v in ("avx2", "avx512")}
    matmuls = {v: matmul.MatmulKernel(lib, v) for v, lib in built.items()}
    generator = torch.Generator().manual_seed(2)
    for inputs in (96, 576, 608, 2048):
        w = torch.randn(77, inputs, generator=generator) * 0.05
        weights = (quant.quantize_int4_native(w), quant.quantize_int8_native(w))
        for rows, dtype in ((1, torch.float32), (5, torch.bfloat16), (9, torch.float32)):
            x = torch.randn(rows, 2 * inputs, generator=generator).to(dtype)
            norm = torch.rand(inputs, generator=generator).to(dtype)
            around = [
                {},
                {"prologue": "rms_norm", "norm": norm, "eps": 1e-5},
                {"prologue": "silu_mul", "add_to": torch.ones(rows, 77, dtype=dtype)},
                {"prologue": "gelu_tanh_mul"},
            ]
            for options in around:
                gated = options.get("prologue") in matmul.MatmulKernel.GATED
                width = 2 * inputs if gated else inputs
                a = x[:, :width].contiguous()
                got = {}
                for variant, kernel in matmuls.items():
                    opts = {k: v.clone() if k == "add_to" else v for k, v in options.items()}
                    got[variant] = (
                        kernel.q4(a, *weights[0], **opts),
                        kernel.q8(a, *weights[1], **opts),
                        kernel.dense(a, w.to(dtype), **opts),
                        kernel.dense(x[:, : inputs - 5].contiguous(), w[:, :-5].contiguous()),
                    )
                assert all(torch.equal(p, q) for p, q in zip(got["avx2"], got["avx512"]))
    # the attention: head sizes of 4 x 16 values (64, 128), 16 off them (80, 96) and off 16 (40,
    # the one-head functions), float32 and bfloat16 caches, with and without a cap
    heads = [(64, torch.float32), (64, torch.bfloat16), (128, torch.bfloat16)]
    heads += [(80, torch.float32), (96, torch.bfloat16), (40, torch.bfloat16)]
    for head_dim, dtype in heads:
        shape = (PLACES, KV_HEADS, MAX_LEN, head_dim)
        k, v = (torch.randn(shape, generator=generator).to(dtype) for _ in range(2))
        q = torch.randn(len(ROWS), KV_HEADS, GROUPS, head_dim, generator=generator).to(dtype)
        for cap in (0.0, 1.5):
            outs = [
                attention.AttentionKernel(lib, n)(q, k, v, Placed.of(ROWS), NO_WINDOW, 0.125, cap)
                for n, lib in built.items()
            ]
            assert torch.equal(*outs), (head_dim, dtype, cap)


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump to read the library")
@pytest.mark.skipif(build.variant() == "generic", reason="the generic build does not prefetch")
def test_the_matmuls_prefetch_their_weight_rows(tmp_path, monkeypatch):
    """The quantized matmuls ask for their weights ahead (csrc/isa/, `ask`): about
    1.5x the weight stream from memory. gcc drops the calls of a function
    of prefetches alone as having no effect unless it is inlined first; this catches the
    library built without them."""
    monkeypatch.setenv("TOKENSTREAM_CACHE", str(tmp_path))
    path = build.build(build.compiler(), build.variant())
    listing = subprocess.run(["objdump", "-d", str(path)], capture_output=True, text=True)
    assert listing.returncode == 0 and "prefetcht0" in listing.stdout


@pytest.mark.skipif(not cpu_has("avx512"), reason="the CPU has no AVX-512 with VNNI")
def test_q4_gives_the_same_bits_from_the_avx512_avx2_and_portable_builds(tmp_path, monkeypatch):
    """q4's sums are defined lane by lane (csrc/isa/, q4_tile), so the portable build
    gives the SIMD builds' bits too (with no prologue: the portable RMS norm sums its squares
    in another order). Block counts cover every tail of a group of 4 and of 16, and weight
    matrices of 1 and 2 rows of 1 block, where a row's last group is read by copy rather than
    past its end; activation rows 1 to 5 cover every row tile. Rows of 2304 and 8192 inputs
    too, on one thread and on two (1 and 2 rows take the tiles that ask for the next tile's
    weight rows as they read, rows_ahead)."""
    monkeypatch.setenv("TOKENSTREAM_CACHE", str(tmp_path))
    cc = build.compiler()
    kernels = [
        matmul.MatmulKernel(ctypes.CDLL(str(build.build(cc, v))), v)
        for v in ("avx512", "avx2", "generic")
    ]
    generator = torch.Generator().manual_seed(3)
    short = [(b, 37) for b in range(1, 34)] + [(1, 1), (1, 2), (3, 1), (17, 2)]
    for blocks, outputs in short + [(72, 37), (72, 130), (256, 9)]:
        inputs = 32 * blocks
        weight = quant.quantize_int4_native(torch.randn(outputs, inputs, generator=generator))
        for rows in (1, 2, 3, 4, 5):
            x = torch.randn(rows, inputs, generator=generator)
            norm = torch.rand(inputs, generator=generator)
            options = {"prologue": "rms_norm", "norm": norm, "eps": 1e-5} if rows % 2 else {}
            got = [kernel.q4(x, *weight, **options) for kernel in kernels]
            assert torch.equal(got[0], got[1]), (blocks, outputs, rows)
            assert options or torch.equal(got[0], got[2]), (blocks, outputs, rows)


@pytest.mark.skipif(not cpu_has("avx512"), reason="the CPU has no AVX-512 with VNNI")
def test_a_compiler_without_amx_still_builds_the_avx512_kernels(tmp_path, monkeypatch):
    """A compiler that rejects AMX's flags (gcc before 11) builds the AVX-512 kernels without
    them, and they run without AMX, rather than the build failing and the forward losing every
    kernel."""
    monkeypatch.setenv("TOKENSTREAM_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "AMX_FLAGS", ("-mno-such-option-anywhere",))
    cc = build.compiler()
    assert "-mno-such-option-anywhere" not in build.flags("avx512", cc)
    assert "-mno-such-option-anywhere" in build.flags("avx512")  # no compiler: as declared
    kernel = matmul.MatmulKernel(ctypes.CDLL(str(build.build(cc, "avx512"))), "avx512")
    assert not kernel.amx
    weight = quant.quantize_int4_native(torch.randn(40, 64))
    x = torch.randn(9, 64)
    assert torch.equal(kernel.q4(x, *weight), matmul.matmul_kernel().q4(x, *weight))
