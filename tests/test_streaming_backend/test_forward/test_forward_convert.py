"""forward/convert.py: a Hugging Face model's modules -> the compact forward's weights: q/k/v and
gate/up fused with the model's parameters re-pointed at them, multipliers folded in, the C layers'
float32 parameters where every weight is theirs, and each module read and each part handed on
through the Stream, a layer at a time."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from families import tiny_config_model

from streaming_backend.forward.convert import all_tensors, compact_weights
from streaming_backend.kernels import matmul


def test_qkv_and_gate_up_are_fused_and_the_model_reads_the_fused_memory():
    """The fused q/k/v weight is q, k, v stacked, and the model's q_proj is a view of it (the
    weights held once); likewise gate/up."""
    model = tiny_config_model("qwen2").model  # q/k/v biases too
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    q, k, v = (p.weight.detach().clone() for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    block = compact_weights(model).blocks[0]
    assert torch.equal(block.qkv, torch.cat([q, k, v]))
    assert attn.q_proj.weight.data_ptr() == block.qkv.data_ptr()
    assert attn.k_proj.weight.data_ptr() == block.qkv[q.shape[0] :].data_ptr()
    assert block.qkv_bias is not None and block.qkv_bias.shape == (block.qkv.shape[0],)
    assert mlp.gate_proj.weight.data_ptr() == block.gate_up.data_ptr()


def test_granites_multipliers_are_folded_into_the_weights():
    """Granite's residual multiplier scales copies of the output projections, its logits
    scaling divides the final norm, its embedding multiplier is the embedding's scale."""
    model = tiny_config_model("granite").model
    o = model.model.layers[1].self_attn.o_proj.weight.detach().clone()
    weights = compact_weights(model)
    assert torch.equal(weights.blocks[1].o, o * 0.3)
    assert torch.equal(weights.final_norm, model.model.norm.weight.detach() / 4.0)
    assert weights.embed_scale == 6.0


def test_the_c_layers_get_float32_parameters_only_where_every_weight_is_theirs():
    """Quantized for our kernels: the native parameters hold each block's norms in float32 (the
    linear weights stay the blocks'); unquantized: none."""
    model = tiny_config_model("llama", torch.bfloat16).model
    assert compact_weights(model, "none").native is None
    weights = compact_weights(model, "int8")
    if matmul.matmul_kernel() is None:  # no C compiler here: torch runs every weight
        assert weights.native is None
        return
    block = weights.native.blocks[0]
    assert block.norm1.dtype == torch.float32 and weights.blocks[0].norm1.dtype == torch.bfloat16
    assert block.qkv is weights.blocks[0].qkv
    assert weights.native.final_norm.dtype == torch.float32


class Recorded:
    """A Stream that records the modules it is asked to load and the parts it is handed."""

    def __init__(self):
        self.events: list[str] = []

    @contextmanager
    def loaded(self, *modules):
        self.events.append("load " + ",".join(type(m).__name__ for m in modules))
        yield
        self.events.append("release")

    def keep(self, tree):
        self.events.append(f"keep {sum(1 for _ in all_tensors(tree))}")
        return tree


def test_each_layer_is_read_derived_and_handed_on_before_the_next():
    """compact_weights reads the embedding, head and final norm, then one decoder layer at a
    time, handing on each layer's block before it releases it; the RoPE tables last."""
    stream = Recorded()
    compact_weights(tiny_config_model("llama").model, stream=stream)
    layer = ["load LlamaDecoderLayer", "keep 6", "release"]  # norm1, qkv, o, norm2, gate_up, down
    assert stream.events == [
        "load Embedding,Linear,LlamaRMSNorm",
        "keep 3",  # embed, head, final norm
        "release",
        *layer,
        *layer,
        "keep 2",  # one RoPE table: cos, sin
    ]
