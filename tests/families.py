"""Tiny random models of the families the compact forward runs, made from their config classes
(no files, no downloads): what the forward tests check against the Hugging Face forward; and the
same models trained for seconds to recite a text, so that their greedy tokens are as clear as a
trained model's."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from streaming_backend.model.loading import LoadedModel
from streaming_backend.prompts import load_chat_prompts

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


# a sliding window shorter than the tests' prompts on the first layer (Qwen2's and Qwen3's
# max_window_layers)
SLIDING = {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}

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


# A random model's next-token logits are nearly flat, so any rounding flips its argmax and greedy
# agreement says nothing. A trained one recites: each family's tiny model learns the first
# RECITED rows of RECITED_LENGTH bytes of the shipped chats (their messages, one a line, as UTF-8:
# token ids 0-255 of the tiny vocabulary), every row at every step, until its greedy tokens lead
# by several logits (docs/configuration.md#model-families has the margins)
RECITED, RECITED_LENGTH = 3, 80
# 200 steps: at 100-125 Granite's and SmolLM3's still tied on some tokens (loss 0.2-1.4), at 150
# their smallest lead was 1.0-2.9 logits, at 200 at least 4.7 (2026-12-03, also with the weights
# nudged by 1e-6 at the start to stand for another CPU kind's rounding)
TRAINING_STEPS = 200
# What a trained model sets beyond DIFFERENCES: Gemma's real final cap (2, there for random O(1)
# logits, caps any lead at 4 and rounds learnt logits to ties at the cap), and Mistral's and
# Qwen2's sliding windows, shorter than the rows (without them Mistral's model is Llama's)
TRAINED = {
    "mistral": {"sliding_window": 8},
    "qwen2": SLIDING,
    "gemma2": {"final_logit_softcapping": 30.0},
    "gemma3_text": {"final_logit_softcapping": 30.0},
}


def recited_rows() -> torch.Tensor:
    """The text the trained models learn: [RECITED, RECITED_LENGTH] byte ids of the shipped
    chats' messages."""
    lines = [message["content"] for chat in load_chat_prompts() for message in chat]
    text = "\n".join(lines).encode()[: RECITED * RECITED_LENGTH]
    return torch.tensor(list(text)).view(RECITED, RECITED_LENGTH)


def trained_config_model(kind: str) -> LoadedModel:
    """The tiny model of the family `kind` (tiny_config_model, TRAINED) in float32, trained to
    recite recited_rows(): the same weights every run on one CPU kind."""
    loaded = tiny_config_model(kind, **TRAINED.get(kind, {}))
    with one_thread():
        _train(loaded.model, recited_rows())
    return loaded


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread within: figures that do not depend on the core count, and for a tiny
    model's ops faster than two threads that wait for each other at every op when the machine is
    busy (the greedy tests of test_forward_quality.py: 27 s against 60 s on a busy 2-core one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _train(model: torch.nn.Module, rows: torch.Tensor) -> None:
    """TRAINING_STEPS of AdamW on all rows at once: no sampling, nothing random."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _learning_rate_factor)
    model.train()
    for _ in range(TRAINING_STEPS):
        logits = model(input_ids=rows[:, :-1]).logits  # [RECITED, RECITED_LENGTH - 1, V]
        loss = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        # without the clip a loss spike now and then undid what some families had learnt
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
    model.eval()


def _learning_rate_factor(step: int, warm_up: int = 10) -> float:
    """A linear warm-up over `warm_up` steps, then a cosine decay to 0 at TRAINING_STEPS."""
    if step < warm_up:
        return (step + 1) / warm_up
    return 0.5 * (1 + math.cos(math.pi * (step - warm_up) / (TRAINING_STEPS - warm_up)))
