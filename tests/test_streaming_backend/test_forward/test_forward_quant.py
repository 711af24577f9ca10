"""Quantized linear weights: the kernels compute what the quantized numbers stand for, and the
compact forward with them stays close to the unquantized one."""

from __future__ import annotations

import pytest
import torch

from streaming_backend.forward import quant
from streaming_backend.forward.runner import ForwardConfig, PromptChunk, SlotForward
from streaming_backend.forward.slots import CacheBudget
from streaming_backend.kernels import build, matmul
from streaming_backend.model.loading import load_model


def dequantize(weight: quant.Weight) -> torch.Tensor:
    """The float weight [out, in] a quantized one stands for (float32): each format's meaning,
    which the kernels are checked against."""
    if isinstance(weight, torch.Tensor):
        return weight.float()
    if isinstance(weight, quant.Int8Weight):
        return weight.weight.float() * weight.scales.float()[:, None]
    if isinstance(weight, quant.NativeInt8Weight):
        return (
            quant.native_int8_levels(weight).float() * weight.scales[: weight.out].float()[:, None]
        )
    if isinstance(weight, quant.NativeInt4Weight):
        levels, steps, lows = quant.native_int4_values(weight)
        out = levels.shape[0]
        levels = levels.float().view(out, -1, quant.INT4_GROUP)  # [out, groups, group]
        w = levels * steps.float()[..., None] + lows.float()[..., None]
        return w.reshape(out, -1)
    # the identity matrix through the kernel: row i of the result is input i of every output
    inputs = weight.packed.shape[1] * 2
    eye = torch.eye(inputs, dtype=weight.scales_zeros.dtype)
    return quant.linear(eye, weight).float().T.contiguous()


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
    error = (dequantize(q) - w).abs()
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
    got = dequantize(q)
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
    expected = x.float() @ dequantize(q).T + bias.float()
    got = quant.linear(x, q, bias)
    assert got.shape == (2, 3, 96) and got.dtype == dtype
    # both compute in bfloat16 whatever the activations' dtype (quant.compute_dtype)
    tolerance = 0.05
    torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)


def block_quantized(x: torch.Tensor) -> torch.Tensor:
    """x [m, k] as the C kernel reads it: each block of 32 inputs rounded to the nearest of the
    levels max|block| / LEVELS apart (two int8 halves; ties to even), as float32."""
    levels = matmul.MatmulKernel.LEVELS
    blocks = x.float().view(x.shape[0], -1, 32)
    top = blocks.abs().amax(-1, keepdim=True)
    # a true division, as the kernel's (torch computes `levels / top` as levels * (1 / top), which
    # moves a value that lands on a half level to the other side now and then)
    inverse = torch.where(top > 0, torch.full_like(top, float(levels)) / top, torch.zeros_like(top))
    return (torch.round(blocks * inverse) * (top / levels)).view(x.shape)


def test_native_int4_keeps_each_weight_within_half_a_step():
    """The C kernel's int4: per group of 32 inputs, w ~ l * step + low with l in [0, 15] and
    step, low in float16; each weight within half a step of its value (plus float16's rounding
    of the low); packed two inputs a byte, 4p + j and 16 + 4p + j of a group, in tiles of 16
    rows (byte 64 p + 4 c + j of a tile's group: its row c)."""
    w = weight()
    q = quant.quantize_int4_native(w)
    assert q.packed.shape == (96, 64) and q.packed.dtype == torch.uint8
    assert q.steps.shape == q.lows.shape == (96, 4) and q.steps.dtype == torch.float16
    assert q.out == 96
    got = dequantize(q).view(96, 4, 32)
    error = (got - w.view(96, 4, 32)).abs()
    _, steps, lows = quant.native_int4_values(q)
    assert (error <= steps.float()[..., None] * 0.51).all()
    # tile 1 (rows 16..31), group 2: its bytes start at (1 * 4 + 2) * 256, its scales at * 16
    tile, group, p, row, j = 1, 2, 3, 5, 1
    byte = q.packed.view(-1)[(tile * 4 + group) * 256 + 64 * p + 4 * row + j].item()
    step = q.steps.view(-1)[(tile * 4 + group) * 16 + row].float()
    low = q.lows.view(-1)[(tile * 4 + group) * 16 + row].float()
    for nibble, column in ((byte & 15, 4 * p + j), (byte >> 4, 16 + 4 * p + j)):
        assert nibble * step + low == got[16 * tile + row, group, column]


def test_a_weight_of_rows_off_the_tiles_is_padded_with_zeros():
    """Output rows that do not fill the last tile of 16: the stored rows are padded with zero
    weights and scales, `out` keeps the real count, and the kernel writes only those outputs."""
    w = weight(out=37)
    for q in (quant.quantize_int4_native(w), quant.quantize_int8_native(w)):
        assert q.out == 37 and q[0].shape[0] == 48
        assert (q[1].view(-1)[-1] == 0).all()  # the last padding row's scale
        torch.testing.assert_close(dequantize(q), w, atol=0.02, rtol=0)  # half an int4 step
        x = torch.randn(3, 128)
        got = quant.linear(x, q)
        assert got.shape == (3, 37)
        torch.testing.assert_close(got, block_quantized(x) @ dequantize(q).T, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("kind", "matmul"), [("int8", "auto"), ("int8", "aten"), ("int4", "auto")])
def test_a_weight_quantized_part_by_part_is_the_weight_quantized_whole(kind, matmul, monkeypatch):
    """A weight of more rows than ROWS_AT_ONCE (the last part off the tiles) is quantized a
    part at a time: the same tensors, bit for bit, as quantized in one go (torch's int4
    packing, not by rows, is quantized whole)."""
    torch.manual_seed(0)
    weight = torch.randn(5 * quant.TILE + 3, 64).to(torch.bfloat16)
    whole = quant.quantize_weight(weight, kind, matmul)
    monkeypatch.setattr(quant, "ROWS_AT_ONCE", 2 * quant.TILE)
    parts = quant.quantize_weight(weight, kind, matmul)
    assert type(parts) is type(whole)
    for at_once, part_by_part in zip(whole, parts, strict=True):
        if isinstance(at_once, torch.Tensor):
            assert part_by_part.dtype == at_once.dtype and torch.equal(part_by_part, at_once)
        else:
            assert part_by_part == at_once


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_linear_is_the_block_quantized_activations_times_the_weight(kind, dtype):
    """The C kernel computes (x quantized per block of 32) @ dequantize(W).T: to float32
    rounding for float32 output, to bfloat16's for bfloat16; the head's shape too."""
    generator = torch.Generator().manual_seed(1)
    for inputs, outputs in ((128, 96), (576, 960), (1536, 576), (576, 4099)):
        w = (torch.randn(outputs, inputs, generator=generator) * 0.05).to(dtype)
        q = quant.quantize_weight(w, kind)
        assert isinstance(q, quant.NATIVE_WEIGHTS)
        x = torch.randn(7, inputs, generator=generator).to(dtype)
        expected = block_quantized(x) @ dequantize(q).T
        got = quant.linear(x, q)
        assert got.dtype == dtype
        scale = expected.abs().max()
        rtol = 1e-5 if dtype == torch.float32 else 2**-8
        assert ((got.float() - expected).abs() <= scale * 1e-5 + expected.abs() * rtol).all()


def test_native_linear_is_the_same_on_one_thread_and_two():
    """Each output is computed by one thread in an order fixed by the inputs' count: one
    thread and two give the same bits."""
    w = torch.randn(3072, 576) * 0.05
    x = torch.randn(5, 576)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2):
            torch.set_num_threads(count)
            results.append([quant.linear(x, quant.quantize_weight(w, k)) for k in ("int8", "int4")])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_native_kernel_refuses_what_it_cannot_read():
    """An activation of the wrong width or dtype fails loudly before anything is read."""
    kernel = matmul.matmul_kernel()
    q = quant.quantize_int4_native(weight())
    with pytest.raises(ValueError, match="for k = 128"):
        kernel.q4(torch.randn(2, 96), *q)
    with pytest.raises(ValueError, match="float64"):
        kernel.q4(torch.randn(2, 128, dtype=torch.float64), *q)
    assert quant.linear(torch.randn(0, 128), q).shape == (0, 96)


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
    with pytest.raises(ValueError, match="unknown matmul 'mkl'; choose auto, aten"):
        ForwardConfig(quantize="int4", matmul="mkl")
    with pytest.raises(ValueError, match="CPU kernels; the model is on meta"):
        quant.quantize_weight(torch.empty(8, 64, device="meta"), "int8")


CONFIG = ForwardConfig(CacheBudget(bytes=64 << 20), max_len=128, max_slots=4)


@pytest.mark.parametrize("matmul", ["auto", "aten"])
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_forward_follows_the_plain_one(tiny_model_dir, kind, matmul):
    """With quantized weights, on our C kernels (auto, the suite's machines all have gcc) or on
    torch's (aten), the forward's logits stay close to the plain forward's, its lone-stream
    step equals its batched step, and every linear weight is quantized."""
    loaded = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    plain = SlotForward.create(loaded, CONFIG)
    options = {**CONFIG.__dict__, "quantize": kind, "matmul": matmul}
    quantized = SlotForward.create(loaded, ForwardConfig(**options))
    ours = matmul == "auto"  # int4 too has an int8 head: HEAD_KIND
    head_type = quant.NativeInt8Weight if ours else quant.Int8Weight
    assert isinstance(quantized.model.head, head_type) and quantized.model.native == ours
    assert quantized.model.matmul == (f"c-{build.variant()}" if ours else "aten")
    assert all(not isinstance(b.gate_up, torch.Tensor) for b in quantized.model.blocks)
    ids = torch.randint(0, 1000, (12,), generator=torch.Generator().manual_seed(4)).tolist()
    results = []
    for forward in (plain, quantized):
        one, other = forward.cache.allocate(), forward.cache.allocate()
        forward.prefill([PromptChunk(one, ids), PromptChunk(other, ids)])
        lone = forward.decode([one], [7])
        # the batched step: `other` holds the same prompt, so its row is the lone step's
        batched = forward.decode([other, one], [7, 8])[0]
        assert torch.equal(lone[0], batched)  # one model whatever the load
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
        assert torch.equal(batched, lone)
        results.append(lone)
    assert torch.nn.functional.cosine_similarity(results[0], results[1], dim=0) > 0.999


def test_score_gives_every_tokens_logits(tiny_model_dir):
    """score's row of logits at the last token is what prefill returns for the same chunk."""
    loaded = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    forward = SlotForward.create(loaded, CONFIG)
    ids = list(range(5, 15))
    every = forward.score(PromptChunk(forward.cache.allocate(), ids))
    last = forward.prefill([PromptChunk(forward.cache.allocate(), ids)])
    assert every.shape == (10, loaded.model.config.vocab_size)
    assert torch.equal(every[-1], last[0])
