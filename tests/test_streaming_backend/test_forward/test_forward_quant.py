"""Quantized linear weights: the kernels compute what the quantized numbers stand for, and the
compact forward with them stays close to the unquantized one."""

from __future__ import annotations

import pytest
import torch

from streaming_backend.forward import quant
from streaming_backend.forward.llama import CompactLlama
from streaming_backend.forward.runner import ForwardConfig, PromptChunk, SlotForward
from streaming_backend.forward.slots import CacheBudget
from streaming_backend.loading import load_model


def weight(out: int = 96, inputs: int = 128, dtype=torch.float32) -> torch.Tensor:
    """A random weight of a linear layer's size and spread."""
    return (torch.randn(out, inputs, generator=torch.Generator().manual_seed(0)) * 0.05).to(dtype)


def test_int8_keeps_each_weight_within_half_a_step():
    """Per-row symmetric int8: every weight is off by at most half its row's step (as stored, in
    bfloat16: the kernel's dtype)."""
    w = weight()
    q = quant.quantize_int8(w)
    assert q.weight.dtype == torch.int8 and q.scales.shape == (96,)
    assert q.scales.dtype == torch.bfloat16  # compute_dtype: no fast float32 path
    error = (quant.dequantize(q) - w).abs()
    assert (error <= q.scales.float()[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_kernel_reads_the_packing_as_written(dtype):
    """The kernel's weight (read back through it) is (q - 8) * s + zero per group with the
    stored scales and zeros, q = round((w - low) / step): the scales, zeros and packing are laid
    out as it expects. It computes in bfloat16 for a float32 weight too."""
    w = weight(dtype=dtype)
    q = quant.quantize_int4(w, quant.INT4_GROUP)
    assert q.scales_zeros.dtype == torch.bfloat16  # compute_dtype: no fast float32 path
    groups = w.float().view(96, -1, quant.INT4_GROUP)
    low = groups.amin(-1, keepdim=True)
    step = (groups.amax(-1, keepdim=True) - low) / 15
    levels = torch.round((groups - low) / step)  # [96, groups, group]
    stored = q.scales_zeros.float().transpose(0, 1)  # [96, groups, 2]
    scale, zero = stored[..., :1], stored[..., 1:]
    expected = ((levels - 8) * scale + zero).view(96, 128)
    got = quant.dequantize(q)
    # the kernel's output is bfloat16: 8 significant bits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=2**-8)
    # half a step, and the few hundredths of one that bfloat16 scales, zeros and output add
    # (measured: 0.524 float32, 0.529 bfloat16); a misread packing is off by whole steps
    assert ((got - w.float()).abs().view_as(groups) <= step * 0.55).all()


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_equals_the_dequantized_matmul(kind, dtype):
    """linear(x, q, bias) is x @ dequantize(q).T + bias, for 1-D batches and [N, T, in] inputs."""
    w, bias = weight(dtype=dtype), torch.randn(96).to(dtype)
    q = quant.quantize_weight(w, kind)
    x = torch.randn(2, 3, 128).to(dtype)
    expected = x.float() @ quant.dequantize(q).T + bias.float()
    got = quant.linear(x, q, bias)
    assert got.shape == (2, 3, 96) and got.dtype == dtype
    # both compute in bfloat16 whatever the activations' dtype (quant.compute_dtype)
    tolerance = 0.05
    torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)


def test_plain_weights_and_unfit_shapes_stay_tensors():
    """'none' is the weight itself; int4 leaves a weight whose inputs do not fill whole groups."""
    w = weight()
    assert quant.quantize_weight(w, "none") is w
    odd = weight(inputs=quant.INT4_GROUP + 8)
    assert quant.quantize_weight(odd, "int4") is odd
    assert quant.weight_bytes(quant.quantize_weight(w, "int8")) < quant.weight_bytes(w) / 3


def test_bad_kinds_and_devices_are_refused():
    """An unknown kind names the choices; a weight off the CPU is refused (CPU kernels)."""
    with pytest.raises(ValueError, match="unknown quantization 'int3'; choose none, int8, int4"):
        quant.quantize_weight(weight(), "int3")
    with pytest.raises(ValueError, match="unknown quantization"):
        ForwardConfig(quantize="fp8")
    with pytest.raises(ValueError, match="CPU kernels; the model is on meta"):
        quant.quantize_weight(torch.empty(8, 64, device="meta"), "int8")


# the quantized head at every batch size: a row's logits do not depend on its step's size
CONFIG = ForwardConfig(CacheBudget(bytes=64 << 20), max_len=128, max_slots=4, calibrate=False)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_forward_follows_the_plain_one(tiny_model_dir, kind):
    """With quantized weights the forward's logits stay close to the plain forward's, its
    lone-stream step equals its batched step, and every linear weight is quantized."""
    loaded = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    plain = SlotForward.create(loaded, CONFIG)
    quantized = SlotForward.create(loaded, ForwardConfig(**{**CONFIG.__dict__, "quantize": kind}))
    assert isinstance(quantized.model.head, quant.Int8Weight)  # int4 too: HEAD_KIND
    assert all(not isinstance(b.gate_up, torch.Tensor) for b in quantized.model.blocks)
    ids = torch.randint(0, 1000, (12,), generator=torch.Generator().manual_seed(4)).tolist()
    results = []
    for forward in (plain, quantized):
        one, other = forward.cache.allocate(), forward.cache.allocate()
        forward.prefill([PromptChunk(one, ids), PromptChunk(other, ids)])
        lone = forward.decode([one], [7])  # decode_one
        # the batched step: `other` holds the same prompt, so its row is the lone step's
        batched = forward.decode([other, one], [7, 8])[0]
        torch.testing.assert_close(lone[0], batched, atol=1e-4, rtol=0)
        results.append(lone[0])
    # a random tiny model quantizes worse than a trained one (measured cosine: int8 0.9999,
    # int4 0.988); a wrong layout or scale gives about 0
    close = torch.nn.functional.cosine_similarity(results[0], results[1], dim=0)
    assert close > (0.999 if kind == "int8" else 0.95)


def test_quantized_qwen2_keeps_its_biases():
    """Qwen2's q/k/v biases are added after a quantized matmul: the lone step and the batched
    step agree, and the logits follow the plain forward's."""
    from test_forward_llama import tiny_config_model

    loaded = tiny_config_model("qwen2")
    assert loaded.model.model.layers[0].self_attn.q_proj.bias is not None
    plain = SlotForward.create(loaded, CONFIG)
    quantized = SlotForward.create(loaded, ForwardConfig(**{**CONFIG.__dict__, "quantize": "int8"}))
    ids = torch.randint(0, 1000, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    results = []
    for forward in (plain, quantized):
        one, two, three = (forward.cache.allocate() for _ in range(3))
        forward.prefill([PromptChunk(one, ids), PromptChunk(two, ids), PromptChunk(three, ids)])
        lone = forward.decode([one], [11])[0]
        batched = forward.decode([two, three], [11, 11])[0]
        torch.testing.assert_close(batched, lone, atol=1e-4, rtol=0)
        results.append(lone)
    assert torch.nn.functional.cosine_similarity(results[0], results[1], dim=0) > 0.999


def test_score_gives_every_tokens_logits(tiny_model_dir):
    """score's row of logits at the last token equals forward's."""
    loaded = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    forward = SlotForward.create(loaded, CONFIG)
    model: CompactLlama = forward.model
    slot = forward.cache.allocate()
    rows = forward._prefill_rows([PromptChunk(slot, list(range(5, 15)))], [0])
    every = model.score(forward.cache.k, forward.cache.v, rows, 16)
    last = model(forward.cache.k, forward.cache.v, rows, 16)
    assert every.shape == (1, 10, loaded.model.config.vocab_size)
    torch.testing.assert_close(every[:, -1], last, atol=1e-5, rtol=0)


def test_the_head_is_chosen_by_rows_as_calibrated(tiny_model_dir):
    """From `full_head_from` rows on, the logits are the loaded head's; below, the quantized
    head's. calibrate_head leaves an unquantized model alone and picks a measured size."""
    loaded = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    plain = SlotForward.create(loaded, ForwardConfig(**{**CONFIG.__dict__, "calibrate": True}))
    assert plain.model.full_head_from is None and plain.model.head is plain.model.full_head
    config = ForwardConfig(**{**CONFIG.__dict__, "quantize": "int8"})
    model: CompactLlama = SlotForward.create(loaded, config).model
    x = torch.randn(3, loaded.model.config.hidden_size, generator=torch.Generator().manual_seed(6))
    full = torch.nn.functional.linear(x, model.full_head)
    quantized = quant.linear(x, model.head).float()
    assert not torch.allclose(full, quantized, atol=1e-4)  # the two heads can be told apart
    model.full_head_from = 3
    torch.testing.assert_close(model.logits(x), full)
    torch.testing.assert_close(model.logits(x[:2]), quantized[:2])
    model.full_head_from = None
    torch.testing.assert_close(model.logits(x), quantized)
    model.calibrate_head(4, repeats=1)
    assert model.full_head_from in (None, 1, 2, 4)


def test_the_layers_are_chosen_by_rows_as_calibrated(tiny_model_dir):
    """From `full_blocks_from` tokens in one call on, the layers run on the loaded weights: a
    prefill's logits are then the unquantized forward's; a lone decode step below the size
    stays quantized; `score` is quantized whatever the size (the quality gate's worst case)."""
    loaded = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    plain = SlotForward.create(loaded, CONFIG)
    quantized = SlotForward.create(loaded, ForwardConfig(**{**CONFIG.__dict__, "quantize": "int4"}))
    model: CompactLlama = quantized.model
    assert model.full_blocks_from is None and model.blocks_for(500) is model.blocks
    # the loaded weights are the Hugging Face model's own memory, not a copy
    gate = loaded.model.model.layers[0].mlp.gate_proj.weight
    assert model.full_blocks[0].gate_up.data_ptr() == gate.data_ptr()
    model.full_head_from = 1  # the loaded head too: only the layers differ below
    ids = torch.randint(0, 1000, (12,), generator=torch.Generator().manual_seed(7)).tolist()

    def prefill_and_step(forward: SlotForward) -> tuple[torch.Tensor, torch.Tensor]:
        slot = forward.cache.allocate()
        try:
            first = forward.prefill([PromptChunk(slot, ids)])[0]
            return first, forward.decode([slot], [5])[0]
        finally:
            forward.cache.free(slot)

    plain_prefill, plain_step = prefill_and_step(plain)
    int4_prefill, int4_step = prefill_and_step(quantized)
    assert not torch.allclose(int4_prefill, plain_prefill, atol=1e-3)  # the two can be told apart
    model.full_blocks_from = len(ids)  # the 12-token prefill on loaded weights, the step not
    mixed_prefill, mixed_step = prefill_and_step(quantized)
    torch.testing.assert_close(mixed_prefill, plain_prefill, atol=1e-5, rtol=0)
    assert not torch.allclose(mixed_step, plain_step, atol=1e-3)
    slot = quantized.cache.allocate()
    rows = quantized._prefill_rows([PromptChunk(slot, ids)], [0])
    scored = model.score(quantized.cache.k, quantized.cache.v, rows, 16)[0, -1]
    quantized.cache.free(slot)
    model.full_head_from = model.full_blocks_from = None  # quantized head and layers
    torch.testing.assert_close(scored, prefill_and_step(quantized)[0], atol=1e-5, rtol=0)


def test_calibrate_blocks_keeps_the_loaded_weights_from_where_they_win(tiny_model_dir, monkeypatch):
    """calibrate_blocks times growing call sizes and stops once the loaded weights won twice
    running: `full_blocks_from` is the first of those; a loss after a win starts over; never
    winning leaves None; an unquantized model is left alone."""
    from streaming_backend.forward import llama

    loaded = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    model = SlotForward.create(
        loaded, ForwardConfig(**{**CONFIG.__dict__, "quantize": "int4"})
    ).model
    timed = []

    def fake_race(loaded_wins_at):
        def race(call, quantized_args, loaded_args, repeats, warm_up=True):
            inputs, blocks = quantized_args
            assert blocks is model.blocks and loaded_args[1] is model.full_blocks
            rows = inputs[0].shape[0]
            timed.append(rows)
            return (1.0, 0.0) if rows in loaded_wins_at else (0.0, 1.0)

        return race

    for wins, max_rows, expected, sizes in [
        ({16, 32, 64}, 256, 16, [1, 2, 4, 8, 16, 32]),
        ({2, 16, 32}, 256, 16, [1, 2, 4, 8, 16, 32]),  # 2 alone was noise
        (set(), 8, None, [1, 2, 4, 8]),
        ({8}, 8, 8, [1, 2, 4, 8]),  # won at the largest size measured
        ({1, 2}, 256, 1, [1, 2]),
    ]:
        timed.clear()
        monkeypatch.setattr(llama, "_race", fake_race(wins))
        model.calibrate_blocks(max_rows)
        assert model.full_blocks_from == expected, wins
        assert timed == sizes
    monkeypatch.undo()
    plain = SlotForward.create(loaded, CONFIG).model
    plain.calibrate_blocks(8)
    assert plain.full_blocks_from is None
    model.calibrate_blocks(4, repeats=1)  # measured for real: one of the sizes, or None
    assert model.full_blocks_from in (None, 1, 2, 4)


def test_the_load_log_says_where_the_weights_split(capsys):
    """One `[tokenstream]` line names each split as calibrated (none for unquantized weights)."""
    from types import SimpleNamespace

    from streaming_backend.forward.runner import log_calibration

    loaded = SimpleNamespace(dtype=torch.float32)
    for blocks, head, expected in [
        (
            32,
            None,
            "layers int4 below 32 rows, float32 from there; head int8 at every size measured",
        ),
        (None, 1, "layers int4 at every size measured; head float32 at every size"),
        (1, 8, "layers float32 at every size; head int8 below 8 rows, float32 from there"),
    ]:
        model = SimpleNamespace(quantize="int4", full_blocks_from=blocks, full_head_from=head)
        log_calibration(model, loaded)
        line = capsys.readouterr().err.strip()
        assert line == f"[tokenstream] weights by call size, measured here: {expected}"
    log_calibration(SimpleNamespace(quantize="none"), loaded)
    assert capsys.readouterr().err == ""


def test_the_race_takes_turns():
    """The calibration's two contenders are timed in turns, after one warm-up each (or none)."""
    from streaming_backend.forward.llama import _race

    calls = []
    first, second = _race(calls.append, ("q",), ("full",), repeats=3)
    assert calls == ["q", "full"] * 4 and first >= 0 and second >= 0
    calls.clear()
    _race(calls.append, ("q",), ("full",), repeats=2, warm_up=False)
    assert calls == ["q", "full"] * 2
