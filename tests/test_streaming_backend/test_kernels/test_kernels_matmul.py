"""The matmul kernels (streaming_backend/kernels/matmul.py, csrc/matmul.c) on AMX: the same bits
as on the AVX-512 tiles, and TOKENSTREAM_AMX=0 keeping them off (their sums against torch are
tested through forward/quant.py, test_forward_quant.py; across builds in test_kernels_build.py);
the RMS-norm prologue of a row whose inputs are not whole eights, in every build this CPU runs."""

from __future__ import annotations

import ctypes

import pytest
import torch

from streaming_backend.forward import quant
from streaming_backend.kernels import build, matmul


def amx_kernel() -> matmul.MatmulKernel | None:
    """The loaded matmuls where their block dots can run on AMX (a Xeon's tiles), else None."""
    kernel = matmul.matmul_kernel()
    return kernel if kernel is not None and kernel.amx else None


@pytest.mark.skipif(amx_kernel() is None, reason="no AMX-INT8 here (or not granted, or capped)")
def test_the_amx_tiles_give_the_bits_of_the_avx512_tiles():
    """With AMX, a block's dot products come from tile multiplies; the sums after are the AVX-512
    tiles' own, in their order: the same bits, for q4 and q8, whatever the rows (below AMX's 8,
    its 16 and a last group of every size: 8 to 16 on AMX, fewer on the AVX-512 tiles), block
    counts (1, odd, past the 4 blocks unpacked ahead), weight rows off the tiles, prologue,
    dtype and threads; with extreme values too (nibbles 0 and 15, int8 +-127, activation
    halves at their ends)."""
    kernel = amx_kernel()
    generator = torch.Generator().manual_seed(4)
    threads = torch.get_num_threads()
    cases = [(1, 16), (2, 37), (3, 16), (5, 130), (18, 77), (72, 37), (256, 9)]
    try:
        for blocks, outputs in cases:
            inputs = 32 * blocks
            w = torch.randn(outputs, inputs, generator=generator) * 0.05
            if blocks == 5:  # the extremes: every weight at a block's lowest or highest level
                w = torch.where(w > 0, 1.0, -1.0) * torch.rand(outputs, 1, generator=generator)
            weights = (quant.quantize_int4_native(w), quant.quantize_int8_native(w))
            for rows in (1, 7, 8, 9, 15, 16, 17, 23, 24, 31, 33):
                x = torch.randn(rows, 2 * inputs, generator=generator)
                if blocks == 5:
                    x = torch.where(x > 0, 1.0, -1.0) * (1 + (x.abs() > 1))  # v at +-2032, +-1016
                dtype = torch.bfloat16 if rows % 2 else torch.float32
                x = x.to(dtype)
                norm = torch.rand(inputs, generator=generator).to(dtype)
                options = [{}, {"prologue": "rms_norm", "norm": norm, "eps": 1e-5}]
                options.append(
                    {"prologue": "silu_mul", "add_to": torch.ones(rows, outputs, dtype=dtype)}
                )
                for opts in options:
                    a = x if opts.get("prologue") == "silu_mul" else x[:, :inputs].contiguous()
                    got = {}
                    for on, count in ((True, 2), (False, 1), (True, 1)):
                        kernel.amx = on
                        torch.set_num_threads(count)
                        fresh = {
                            key: v.clone() if key == "add_to" else v for key, v in opts.items()
                        }
                        got[on, count] = (
                            kernel.q4(a, *weights[0], **fresh),
                            kernel.q8(a, *weights[1], **fresh),
                        )
                    for got_amx in (got[True, 2], got[True, 1]):
                        for p, q in zip(got_amx, got[False, 1]):
                            assert torch.equal(p, q), (blocks, outputs, rows, dtype, opts.keys())
    finally:
        kernel.amx = True
        torch.set_num_threads(threads)


@pytest.mark.skipif(amx_kernel() is None, reason="no AMX-INT8 here (or not granted, or capped)")
def test_tokenstream_amx_0_keeps_the_matmuls_off_amx(monkeypatch):
    """TOKENSTREAM_AMX=0 keeps the block dots on the AVX-512 tiles (benchmarks, a suspect CPU)."""
    library, variant = build.library()
    try:
        monkeypatch.setenv(build.AMX_VARIABLE, "0")
        assert not matmul.MatmulKernel(library, variant).amx
        monkeypatch.setenv(build.AMX_VARIABLE, "1")
        kernel = matmul.MatmulKernel(library, variant)
        assert not kernel.amx  # the variable only turns it off; turning on is the setter's
        kernel.amx = True
        assert kernel.amx
    finally:
        matmul.matmul_kernel().amx = True


def test_the_rms_norm_of_a_row_off_the_lanes_is_its_own_in_every_build(tmp_path, monkeypatch):
    """The RMS-norm prologue before a dense matmul of k inputs that are not whole eights (the
    lanes' width) normalises each row by its own k values: the lanes take the whole eights, the
    rest come one by one. (The lanes read 8 at a time to k's next eight: the next row's first
    values, or past the tensor's end for the last row, went into the norm.) Every build this CPU
    runs, against float64, with a next row of large values that would show such a read."""
    monkeypatch.setenv("TOKENSTREAM_CACHE", str(tmp_path))
    cc = build.compiler()
    variants = [v for v in ("avx512", "avx2") if build.VARIANTS[v].needs <= build.cpu_flags()]
    kernels = [
        matmul.MatmulKernel(ctypes.CDLL(str(build.build(cc, v))), v) for v in (*variants, "generic")
    ]
    generator = torch.Generator().manual_seed(6)
    for k in (3, 8, 12, 20, 36, 100):
        x = torch.randn(3, k, generator=generator)
        x[1] = 1000.0  # a row the norm of its neighbours must not read
        w = torch.randn(5, k, generator=generator)
        norm = torch.rand(k, generator=generator)
        xd = x.double()
        rms = torch.sqrt((xd * xd).mean(1, keepdim=True) + 1e-5)
        expected = (xd / rms * norm.double()) @ w.double().T
        for kernel in kernels:
            y = kernel.dense(x, w, prologue="rms_norm", norm=norm, eps=1e-5)
            torch.testing.assert_close(
                y.double(), expected, atol=1e-4, rtol=1e-4, msg=kernel.variant
            )
