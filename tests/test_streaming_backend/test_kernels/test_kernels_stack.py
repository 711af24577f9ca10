"""The decoder stack kernel (streaming_backend/kernels/stack.py, csrc/stack.c) and the layers it
stacks (forward/layers.py's native_layer, a few C calls a layer): against torch's layers, and the
stack against the layer-by-layer calls, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from families import COMPACT_FAMILIES, tiny_config_model

from streaming_backend.forward.runner import ForwardConfig, PromptChunk, SlotForward
from streaming_backend.forward.slots import CacheBudget
from streaming_backend.kernels.attention import Placed
from streaming_backend.model.loading import load_model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize(
    "family",
    COMPACT_FAMILIES,
)
def test_the_native_layers_compute_what_the_torch_layers_do(tiny_model_dir, family, kind, dtype):
    """With quantized weights every layer runs as a few C calls (layers.native_layer: the norms,
    RoPE, K/V writes, attention, silu and residuals in C; Qwen3's head norms in torch between
    them; Granite's multipliers folded into the weights); prefill (padded rows too) and decode
    give the logits of the same weights through torch's norms, RoPE and MLP, within the rounding
    of the activations' quantization (a norm a hair apart can move a level)."""
    logits = {}
    for use_native in (True, False):
        if family == "llama":
            loaded = load_model(str(tiny_model_dir), dtype=dtype, device="cpu")
        else:
            loaded = tiny_config_model(family, getattr(torch, dtype))
        # the cache in the model's dtype: torch's layers read it too
        config = ForwardConfig(
            CacheBudget(bytes=64 << 20), 128, 4, quantize=kind, kv_cache_dtype=dtype
        )
        forward = SlotForward.create(loaded, config)
        assert forward.model.native
        forward.model.native = use_native
        slots = [forward.cache.allocate() for _ in range(3)]
        prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18]]
        steps = [forward.prefill([PromptChunk(s, p) for s, p in zip(slots, prompts)])]
        for step in range(4):  # the same tokens fed to both (an argmax tie could part them)
            steps.append(forward.decode(slots, [20 + step, 30 + step, 40 + step]))
        logits[use_native] = torch.stack(steps)
    ours, theirs = logits[True], logits[False]
    # float32: a norm one ulp apart can move an activation a level (of 2032 per block): measured
    # up to 8.1e-4 of the largest logit; a wrong RoPE or norm is off by about the logits themselves
    if dtype == "float32":
        worst = ((ours - theirs).abs().max() / theirs.abs().max()).item()
        assert worst <= 2e-3, worst
    else:  # torch rounds each step to bfloat16, C once (measured: cosine 0.99984 at the least)
        close = F.cosine_similarity(ours.flatten(0, 1), theirs.flatten(0, 1), dim=-1)
        assert close.min() > 0.999


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("family", COMPACT_FAMILIES)
def test_the_decoder_stack_gives_the_bits_of_the_layer_by_layer_calls(tiny_model_dir, family, kind):
    """Where no layer needs torch between its calls, every layer runs in one C call
    (kernels.stack.DecoderStack): the same functions in the same order as native_layer's calls from
    Python, so the same logits to the bit, in prefill (padded rows too), decode, and a prompt
    longer than the windows of the families that have them. Families with head norms, post
    norms or experts keep the calls from Python."""
    if family == "llama":
        loaded = load_model(str(tiny_model_dir), dtype="bfloat16", device="cpu")
    else:
        loaded = tiny_config_model(family, torch.bfloat16)
    config = ForwardConfig(CacheBudget(bytes=64 << 20), max_len=128, max_slots=4, quantize=kind)
    forward = SlotForward.create(loaded, config)
    stack = forward.model.native_stack
    blocks = forward.model.native_blocks
    plain = all(b.q_norm is None and b.attn_out_norm is None and b.experts is None for b in blocks)
    assert (stack is not None) == plain
    if stack is None:
        return
    logits = {}
    for use_stack in (True, False):
        forward.model.native_stack = stack if use_stack else None
        slots = [forward.cache.allocate() for _ in range(3)]
        prompts = [[5, 6, 7, 8, 9], [10, 11], [(12 + i) % 50 for i in range(40)]]
        steps = [forward.prefill([PromptChunk(s, p) for s, p in zip(slots, prompts)]).float()]
        for step in range(4):
            steps.append(forward.decode(slots, [20 + step, 30 + step, 40 + step]).float())
        logits[use_stack] = torch.stack(steps)
        for slot in slots:
            forward.cache.free(slot)
    assert torch.equal(logits[True], logits[False])


def test_the_decoder_stack_refuses_caches_that_do_not_fit(tiny_model_dir):
    """A cache list of the wrong length, dtype or shape is refused before any C runs."""
    loaded = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    config = ForwardConfig(CacheBudget(bytes=16 << 20), max_len=64, max_slots=2, quantize="int4")
    model = SlotForward.create(loaded, config).model
    stack = model.native_stack
    k = [torch.zeros(2, model.shape.kv_heads, 64, model.shape.head_dim) for _ in model.blocks]
    x = torch.zeros(1, model.shape.hidden)
    placed = Placed.of([(0, 0)])
    with pytest.raises(ValueError, match="layers' caches"):
        stack(x, k[:-1], k[:-1], placed)
    with pytest.raises(ValueError, match="caches"):
        stack(x, k, [t.to(torch.bfloat16) for t in k], placed)
    with pytest.raises(ValueError, match="x "):
        stack(x.to(torch.bfloat16), k, k, placed)
    # tuples of caches are checked once and their arguments kept; other caches are checked anew
    kept = tuple(k)
    stack(x, kept, kept, placed)
    assert stack._caches[0] is kept
    with pytest.raises(ValueError, match="caches"):
        stack(x, kept, tuple(t.to(torch.bfloat16) for t in k), placed)
    with pytest.raises(ValueError, match="caches"):
        stack(x, kept, tuple(t[:, :, :32] for t in k), placed)
