"""forward/family.py: a Hugging Face config read as the compact forward's sizes (model_shape),
each family's differences found there, and what the forward does not run refused with why."""

from __future__ import annotations

import pytest
from families import PARTIAL_ROPE, SLIDING, tiny_config_model

from streaming_backend.forward.family import NO_WINDOW, UnsupportedModel, model_shape


def test_the_shape_holds_the_sizes_of_the_config():
    """Layers, widths, heads and the scores' scale 1/sqrt(head_dim) come from the config."""
    shape = model_shape(tiny_config_model("llama").model)
    assert (shape.layers, shape.hidden, shape.heads, shape.kv_heads) == (2, 64, 4, 2)
    assert (shape.head_dim, shape.vocab, shape.groups) == (16, 1000, 2)
    assert shape.windows == (NO_WINDOW, NO_WINDOW) and shape.rotary_dim == 16
    assert shape.dims.scale == 16**-0.5 and shape.dims.activation == "silu"


@pytest.mark.parametrize(
    ("kind", "overrides", "windows"),
    [
        ("qwen2", SLIDING, (NO_WINDOW, 8)),  # the layers from max_window_layers on slide
        ("mistral", {"sliding_window": 8}, (8, 8)),  # every layer, whatever layer_types say
        ("gemma3_text", {}, (8, NO_WINDOW)),  # by layer type
        ("qwen2", {}, (NO_WINDOW, NO_WINDOW)),
    ],
)
def test_each_layers_window_is_the_one_hugging_faces_masks_apply(kind, overrides, windows):
    """A sliding window per layer as the family's config gives it, else full attention."""
    assert model_shape(tiny_config_model(kind, **overrides).model).windows == windows


def test_the_families_scales_caps_and_partial_rope_are_read():
    """Granite's attention multiplier and Gemma's query_pre_attn_scalar set the scores' scale,
    Gemma 2's cap and GELU come through, Phi-4-mini turns 3/4 of each head."""
    assert model_shape(tiny_config_model("granite").model).dims.scale == 0.05
    gemma = model_shape(tiny_config_model("gemma2").model).dims
    assert (gemma.scale, gemma.cap, gemma.activation) == (1.0, 1.0, "gelu_tanh")
    assert model_shape(tiny_config_model("phi3", **PARTIAL_ROPE).model).rotary_dim == 12


def test_unsupported_family_is_refused_with_its_name():
    """A family the compact forward does not run (StableLM: LayerNorm, partial RoPE) is
    refused, naming it and what is supported."""
    with pytest.raises(UnsupportedModel, match=r"qwen3, granite, .*not 'stablelm'"):
        model_shape(tiny_config_model("stablelm").model)


def test_rope_on_part_of_a_head_of_odd_sizes_is_refused_with_the_reason():
    """RoPE on part of each head whose turned or untouched part is odd in size: refused."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.6}
    with pytest.raises(UnsupportedModel, match="RoPE on 9 of each head's 16 values"):
        model_shape(tiny_config_model("phi3", rope_parameters=rope).model)


def test_clipped_queries_keys_and_values_are_refused_with_the_reason():
    """OLMoE's clip_qkv (clamping q, k and v) is not on this forward: refused, named."""
    with pytest.raises(UnsupportedModel, match=r"clipped at 8\.0 \(clip_qkv\)"):
        model_shape(tiny_config_model("olmoe", clip_qkv=8.0).model)


def test_an_unknown_activation_and_a_hooked_module_are_refused():
    """An activation the forward lacks, or a forward hook it would skip: refused, named."""
    with pytest.raises(UnsupportedModel, match="activation 'relu'"):
        model_shape(tiny_config_model("llama", hidden_act="relu").model)
    model = tiny_config_model("llama").model
    model.model.layers[1].mlp.register_forward_hook(lambda *args: None)
    with pytest.raises(UnsupportedModel, match=r"forward hooks on \['model.layers.1.mlp'\]"):
        model_shape(model)
