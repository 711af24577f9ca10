"""Tiny random models of the families the compact forward runs, made from their config classes
(no files, no downloads): what the forward tests check against the Hugging Face forward."""

from __future__ import annotations

import torch

from streaming_backend.model.loading import LoadedModel

# What a family's tiny model sets beyond the sizes, so that a forward which skips the family's
# difference fails its test: Granite's multipliers far from 1, SmolLM3's layers without RoPE
# (every second one; its default, every fourth, leaves both tiny layers with RoPE), Gemma 3's
# layer types
DIFFERENCES = {
    "granite": {
        "embedding_multiplier": 6.0,
        "residual_multiplier": 0.3,
        "attention_multiplier": 0.05,
        "logits_scaling": 4.0,
    },
    "smollm3": {"no_rope_layer_interval": 2},
    # Phi-4-mini's RoPE on the first three quarters of each head
    "phi3": {
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.75,
        }
    },
    # a sliding layer (a window shorter than the tests' prompts) and a full one, the logits
    # capped where it shows (they are O(1)); its default head_dim is 256
    "gemma3_text": {
        "head_dim": 16,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
        "final_logit_softcapping": 2.0,
    },
    # Gemma 3's, and the attention scores capped
    "gemma2": {
        "head_dim": 16,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
        "final_logit_softcapping": 2.0,
        "attn_logit_softcapping": 1.0,
        "query_pre_attn_scalar": 1,  # scores of a few units, so that their cap shows
    },
    # 4 experts, 2 per token, their weights summed as the router gave them (OLMoE's default)
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": False},
    # a sparse layer of 4 experts, 2 per token, and a dense one
    "qwen3_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "mlp_only_layers": [1],
    },
}
# Phi-3's LongRoPE, of 64 positions in its original context (the tiny head_dim 16: 8 factors)
LONGROPE = {
    "rope_parameters": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
        "long_factor": [4.0] * 8,
    },
    "original_max_position_embeddings": 64,
}
# Phi-4-mini's RoPE on the first three quarters of each head, and LongRoPE
PARTIAL_ROPE = {
    "rope_parameters": LONGROPE["rope_parameters"]
    | {"partial_rotary_factor": 0.75, "short_factor": [1.0, 1.2, 1.5, 2.0, 2.6, 3.3]}
    | {"long_factor": [4.0] * 6},
    "original_max_position_embeddings": 64,
}


# every model_type on the compact forward, as tests/families.py makes them
COMPACT_FAMILIES = (
    "llama",
    "qwen2",
    "mistral",
    "qwen3",
    "granite",
    "olmo2",
    "smollm3",
    "phi3",
    "gemma2",
    "gemma3_text",
    "qwen3_moe",
    "olmoe",
)


def family_classes(kind: str) -> tuple[type, type]:
    """transformers' config and causal-LM classes of the family `kind`."""
    import transformers

    names = {
        "llama": "Llama",
        "qwen2": "Qwen2",
        "mistral": "Mistral",
        "qwen3": "Qwen3",
        "olmo2": "Olmo2",
        "granite": "Granite",
        "smollm3": "SmolLM3",
        "phi3": "Phi3",
        "gemma2": "Gemma2",
        "gemma3_text": "Gemma3Text",
        "qwen3_moe": "Qwen3Moe",
        "olmoe": "Olmoe",
        "stablelm": "StableLm",  # not on the compact forward: LayerNorm, partial RoPE
    }
    name = names[kind]
    model = getattr(transformers, f"{name.removesuffix('Text')}ForCausalLM")
    return getattr(transformers, f"{name}Config"), model


def tiny_config_model(kind: str, dtype: torch.dtype = torch.float32, **overrides) -> LoadedModel:
    """A randomly initialised 2-layer model of the family `kind` (Hugging Face model_type), on
    the CPU in `dtype`; the same weights every call."""
    config_class, model_class = family_classes(kind)
    # no special tokens: some families' defaults lie beyond the tiny vocabulary
    special = {"pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
    overrides = special | DIFFERENCES.get(kind, {}) | overrides
    config = config_class(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        **overrides,
    )
    torch.manual_seed(1)
    model = model_class(config).eval().to(dtype)
    return LoadedModel(model, None, torch.device("cpu"), dtype, frozenset(), 256, kind)
