"""forward/compiled.py: the shapes a compiled decode step is warmed up with, the step that falls
back to eager for good when the fast one fails, the compiled layer in the model's place, and a
compilation or CUDA-graph capture that fails leaving the eager step (inductor itself, and a GPU,
are test_forward_llama.py's slow test and gpu_check.sh's)."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from streaming_backend.forward import compiled
from streaming_backend.forward.buckets import MIN_WINDOW
from streaming_backend.forward.layers import masked_layer
from streaming_backend.forward.runner import ForwardConfig, PromptChunk, SlotForward
from streaming_backend.forward.slots import CacheBudget

CONFIG = ForwardConfig(CacheBudget(bytes=64 << 20), max_len=256, max_slots=4)


@pytest.fixture
def forward(tiny_loaded) -> SlotForward:
    return SlotForward.create(tiny_loaded, CONFIG)


@pytest.mark.parametrize(
    ("max_len", "windows"),
    [
        (4096, [MIN_WINDOW, 2 * MIN_WINDOW, 4096]),
        (2 * MIN_WINDOW, [MIN_WINDOW, 2 * MIN_WINDOW]),
        (MIN_WINDOW // 2, [MIN_WINDOW // 2]),
    ],
)
def test_warm_up_covers_batch_one_and_more_at_each_kind_of_window(max_len, windows):
    """Batch 1 and 2 (size 1 is specialised) at the smallest window, a larger one and the whole
    cache (a slice of the whole dimension), each once, none past the cache."""
    shapes = compiled.warm_up_shapes(max_len)
    assert shapes == [(batch, window) for batch in (1, 2) for window in windows]


class Steps:
    """A fast step that fails on its `fail_at`-th call, and an eager one; both count calls."""

    def __init__(self, fail_at: int):
        self.fast_calls = self.eager_calls = 0
        self.fail_at = fail_at

    def fast(self, k, v, rows, window):
        self.fast_calls += 1
        if self.fast_calls == self.fail_at:
            raise RuntimeError("recompilation failed")
        return torch.full((1, 2), 1.0)

    def eager(self, k, v, rows, window):
        self.eager_calls += 1
        return torch.full((1, 2), 2.0)


def test_a_failed_fast_step_is_redone_eagerly_and_never_tried_again(caplog):
    """The call that fails returns the eager step's logits, is logged once, and every later
    call runs eagerly."""
    steps = Steps(fail_at=2)
    step = compiled.EagerFallback(steps.fast, steps.eager, "compiled")
    outs = [step(None, None, None, 64)[0, 0].item() for _ in range(4)]
    assert outs == [1.0, 2.0, 2.0, 2.0]
    assert (steps.fast_calls, steps.eager_calls) == (2, 3)
    failures = [r for r in caplog.records if "decoding eagerly from now on" in r.getMessage()]
    assert len(failures) == 1 and failures[0].levelno == logging.ERROR


def test_the_compiled_step_runs_the_given_layer_in_every_layers_place(forward):
    """CompiledStep calls the model with its layer for each decoder layer: the masked layer
    (what torch.compile compiles) gives the eager decode step's logits, and a layer of its own
    is what runs."""
    slots = [forward.cache.allocate() for _ in range(2)]
    forward.prefill([PromptChunk(s, [11, 12, 13 + s]) for s in slots])
    places = [forward.cache.physical[s] for s in slots]
    lengths = [forward.cache.lengths[s] for s in slots]
    index = forward.decode_index([40, 41], places, lengths)
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return masked_layer(*args, **kwargs)

    step = compiled.CompiledStep(forward.model, counted)
    masked = step(forward.cache.k, forward.cache.v, forward.decode_rows(index), MIN_WINDOW)
    assert len(calls) == forward.model.shape.layers
    eager = forward.decode(slots, [40, 41])  # rewrites the same positions, eagerly
    torch.testing.assert_close(masked, eager, atol=1e-5, rtol=0)


def test_a_compilation_that_fails_leaves_the_eager_step_and_inductors_cache_in_ours(
    forward, tmp_path, monkeypatch, caplog
):
    """A backend that fails: the eager model and no compile time, with a warning; inductor's
    cache folder is set under TOKENSTREAM_CACHE unless TORCHINDUCTOR_CACHE_DIR was set."""
    monkeypatch.setenv("TOKENSTREAM_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)

    def broken_backend(graph, example_inputs):
        raise RuntimeError("no compiler here")

    step, seconds = compiled.compile_decode(
        forward.model, forward.cache, forward.scratch_rows, backend=broken_backend
    )
    assert step is forward.model and seconds is None
    assert "torch.compile of the decode step failed" in caplog.text
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "theirs"))
    compiled.compile_decode(forward.model, forward.cache, forward.scratch_rows, broken_backend)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "theirs")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the capture would run")
def test_without_a_gpu_the_graph_capture_fails_to_the_eager_step(forward, caplog):
    """CUDA graphs asked for where there is no GPU: the eager model, with a warning."""
    step, seconds = compiled.graph_decode(forward.model, forward.cache, forward.scratch_rows)
    assert step is forward.model and seconds is None
    assert "capturing the decode step as CUDA graphs failed" in caplog.text
