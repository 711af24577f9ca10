"""The greedy pick (streaming_backend/kernels/greedy.py, csrc/greedy.c) in every build this CPU
runs."""

from __future__ import annotations

import ctypes

import pytest
import torch

from streaming_backend.kernels import build, greedy


def cpu_has(variant: str) -> bool:
    """Whether this CPU runs the build `variant` (its row's needs)."""
    return build.VARIANTS[variant].needs <= build.cpu_flags()


def test_the_greedy_pick_is_the_first_largest_in_every_build(tmp_path, monkeypatch):
    """ts_greedy_rows (sampling's greedy rows): the first index of each row's largest value, as
    torch's max gives it, ties at every lane place and lengths on and off the vector widths;
    a row with NaN or an infinity, or so large that its sum might overflow, is not certain
    (0, for the pipeline to decide). Every build this CPU runs."""
    monkeypatch.setenv("TOKENSTREAM_CACHE", str(tmp_path))
    cc = build.compiler()
    builds = [v for v in ("avx512", "avx2") if cpu_has(v)] + ["generic"]
    kernels = [greedy.GreedyKernel(ctypes.CDLL(str(build.build(cc, v))), v) for v in builds]
    generator = torch.Generator().manual_seed(5)
    for vocab in (1, 7, 8, 15, 16, 17, 33, 100, 49152, 49155):
        x = torch.randn(4, vocab, generator=generator)
        x[1, vocab // 2 :] = x[1].max() + 1.0  # a tie from the middle on: the first wins
        x[2] = -3.0  # all alike
        x[3, -1] = 1e4  # the last place
        expected = x.max(-1).indices.tolist()
        for kernel in kernels:
            assert kernel(x) == (expected, [True] * 4), (kernel.variant, vocab)
    bad = torch.randn(6, 50, generator=generator)
    bad[0, 3], bad[1, 49], bad[2, 20] = float("nan"), float("inf"), float("-inf")
    bad[3] = 4e36  # 2 x 50 x 4e36 > float's largest: a sum could overflow
    bad[4] = 1e30  # far from it
    for kernel in kernels:
        ids, sure = kernel(bad)
        assert sure == [False, False, False, False, True, True], kernel.variant
        assert ids[:4] == [0, 0, 0, 0] and ids[4:] == bad[4:].max(-1).indices.tolist()
    with pytest.raises(ValueError, match="greedy: logits"):
        kernels[0](torch.zeros(2, 5, dtype=torch.bfloat16))
