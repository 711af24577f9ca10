"""Quantized linear weights: the kernels compute what the quantized numbers stand for, and the
compact forward with them stays close to the unquantized one."""

from __future__ import annotations

import pytest
import torch

from streaming_backend.forward import quant
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


CONFIG = ForwardConfig(CacheBudget(bytes=64 << 20), max_len=128, max_slots=4)


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
