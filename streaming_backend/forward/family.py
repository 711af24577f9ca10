"""A model family's differences from Llama as data (FAMILIES), and the sizes the compact forward
reads off a Hugging Face model's config (model_shape -> LlamaShape, Dims).

Supported (docs/configuration.md#model-families): Llama and the families that differ from it in
ways declared here, read by the one forward: q/k/v biases, sliding windows, norms on the queries
and keys, norms after the attention and the MLP, multipliers, layers without RoPE, weights stored
fused, experts, soft caps. Anything else raises UnsupportedModel and the caller keeps the Hugging
Face forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from streaming_backend.model.loading import rope_context


class Family(NamedTuple):
    """What a model family's decoder layer does beyond Llama's."""

    # an RMS norm on the queries and keys before RoPE: over each head (Qwen3; weights of
    # head_dim) or over all heads at once (OLMo 2; weights of heads * head_dim)
    head_norms: bool = False
    pre_norms: bool = True  # the attention and the MLP take the normalised residual stream
    # their outputs are normalised before they join the residual stream (OLMo 2)
    post_norms: bool = False
    # norms scale in float32, then cast to the model's dtype (Llama casts, then scales): their
    # weights are held in float32, which tells rms_norm
    float_norms: bool = False
    # the config's embedding_multiplier, residual_multiplier (of the attention and MLP outputs
    # added to the residual stream), attention_multiplier (the scores' scale, for 1/sqrt(D))
    # and logits_scaling (the logits divided by it)
    multipliers: bool = False
    rope_layers: bool = False  # some layers without RoPE: the config's no_rope_layers (SmolLM3)
    fused: bool = False  # q/k/v and gate/up stored fused (qkv_proj, gate_up_proj: Phi-3)
    norm_offset: float = 0.0  # norms scale by offset + weight (Gemma: 1 + weight)
    experts: bool = False  # sparse layers: a mixture of experts with top-k routing (Experts)
    # the final logits soft-capped: cap * tanh(logits / cap), by final_logit_softcapping (Gemma)
    logit_cap: bool = False


FAMILIES = {  # Hugging Face model_type -> its differences
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(),
    "qwen3": Family(head_norms=True),
    "granite": Family(multipliers=True),
    "olmo2": Family(head_norms=True, pre_norms=False, post_norms=True, float_norms=True),
    "smollm3": Family(rope_layers=True),
    "phi3": Family(fused=True),
    "qwen3_moe": Family(head_norms=True, experts=True),
    "olmoe": Family(head_norms=True, experts=True),  # its q/k norms over all heads, as OLMo 2's
    # RoPE tables per layer type, the embedding scale, GELU and the scores' scale follow from
    # the config and the modules (model_shape, CompactLlama)
    "gemma2": Family(post_norms=True, float_norms=True, norm_offset=1.0, logit_cap=True),
    "gemma3_text": Family(
        head_norms=True, post_norms=True, float_norms=True, norm_offset=1.0, logit_cap=True
    ),
}
SUPPORTED_TYPES = tuple(FAMILIES)
# RoPE variants whose inverse frequencies are fixed at load (no position-dependent rescaling);
# LongRoPE (Phi-3/4) is too within its original context (loading.rope_context bounds the model's).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
NO_WINDOW = 1 << 62  # "sliding window" of a full-attention layer
# Hugging Face's activation name -> ours (Dims.activation; kernels' MatmulKernel's `{ours}_mul`)
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


class Dims(NamedTuple):
    """The sizes one layer needs (plain ints: a compiled layer specialises on them)."""

    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    scale: float  # of the attention scores: 1/sqrt(head_dim) unless the family sets it
    activation: str = "silu"  # of the MLP's gate: a key of ACTIVATIONS
    cap: float = 0.0  # the scores soft-capped at it, cap * tanh(score / cap) (Gemma 2); 0: not


class UnsupportedModel(ValueError):
    """The model is not one this forward implements; use the Hugging Face forward."""


@dataclass(frozen=True)
class LlamaShape:
    """The sizes the forward and the slot cache need."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_positions: int
    eps: float
    windows: tuple[int, ...]  # per layer: sliding window length, NO_WINDOW for full attention
    scale: float | None = None  # of the attention scores; None: 1/sqrt(head_dim)
    activation: str = "silu"
    cap: float = 0.0  # of the attention scores (Dims.cap)
    rotary_dim: int | None = None  # values of each head RoPE turns; None: all

    @property
    def groups(self) -> int:
        """Query heads per key/value head."""
        return self.heads // self.kv_heads

    @property
    def dims(self) -> Dims:
        """What `decoder_layer` needs to know."""
        scale = self.head_dim**-0.5 if self.scale is None else self.scale
        return Dims(
            self.heads, self.kv_heads, self.head_dim, self.eps, scale, self.activation, self.cap
        )


def model_shape(model: Any) -> LlamaShape:
    """Read a Hugging Face model's sizes, or raise UnsupportedModel saying why."""
    config = model.config
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED_TYPES:
        raise UnsupportedModel(
            f"the compact forward supports {', '.join(SUPPORTED_TYPES)}, not {kind!r}"
        )
    hooked = [name for name, m in model.named_modules() if m._forward_hooks or m._forward_pre_hooks]
    if hooked:
        raise UnsupportedModel(f"forward hooks on {hooked[:3]} would be skipped")
    if getattr(config, "clip_qkv", None) is not None:
        raise UnsupportedModel(f"queries, keys and values clipped at {config.clip_qkv} (clip_qkv)")
    activation = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)
    if activation not in ACTIVATIONS:
        raise UnsupportedModel(f"activation {activation!r} is not one of {', '.join(ACTIVATIONS)}")
    rope = getattr(config, "rope_parameters", None) or {}
    # one RoPE for every layer, or one per layer type (Gemma 3: {layer type: its parameters})
    for params in rope.values() if all(isinstance(v, dict) for v in rope.values()) else [rope]:
        rope_type = params.get("rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            raise UnsupportedModel(f"RoPE type {rope_type!r} is not supported")
    max_positions = rope_context(config) or config.max_position_embeddings
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    # RoPE on the first part of each head only (Phi-4-mini): `_turned_first` reorders it
    rotary_dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    if rotary_dim % 2 or (head_dim - rotary_dim) % 2:
        raise UnsupportedModel(f"RoPE on {rotary_dim} of each head's {head_dim} values")
    scale = config.attention_multiplier if FAMILIES[kind].multipliers else None
    if getattr(config, "query_pre_attn_scalar", None):  # Gemma: the scores' scale
        scale = config.query_pre_attn_scalar**-0.5
    return LlamaShape(
        layers=config.num_hidden_layers,
        hidden=config.hidden_size,
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        vocab=config.vocab_size,
        max_positions=max_positions,
        eps=config.rms_norm_eps,
        windows=_layer_windows(config),
        scale=scale,
        activation=ACTIVATIONS[activation],
        rotary_dim=rotary_dim,
        cap=float(getattr(config, "attn_logit_softcapping", None) or 0.0),
    )


def _layer_windows(config: Any) -> tuple[int, ...]:
    """Sliding window per layer as the Hugging Face masks apply it (None -> full attention)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if config.model_type == "mistral" or layer_types is None:
        return (window or NO_WINDOW,) * config.num_hidden_layers
    return tuple(
        (window or NO_WINDOW) if kind == "sliding_attention" else NO_WINDOW for kind in layer_types
    )
