"""Write a Llama-shaped model with random weights, in Hugging Face format, for speed measurements
at sizes the shipped model does not have (its numbers mean nothing; its speed is a real model's).

    PYTHONPATH=. .venv/bin/python scripts/make_model.py --out ../models/llama-1b   # 1.07 B
    PYTHONPATH=. .venv/bin/python scripts/forward_bench.py --model ../models/llama-1b \\
        --systems int4@bfloat16 --batch 1,8
    PYTHONPATH=. .venv/bin/python scripts/compare_peers.py --ours-args "--model ../models/llama-1b"

The defaults are a 1B-class Llama: hidden 2048, 16 layers, 32 query and 8 key/value heads,
intermediate 8192, SmolLM2's tokenizer and vocabulary (49152, from the shipped model), tied
embeddings, stored in bfloat16. The weights are drawn as transformers initialises a new model
(normal, std --init-std), from --seed, so the same options write the same files. --family takes
another model_type with the same sizes (--config adds its own keys), e.g. a Gemma 3 or a Qwen3
mixture of experts for the families' speed figures (docs/configuration.md#model-families).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Shape:
    """A Llama model's sizes."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    context: int


def make(
    shape: Shape,
    out: Path,
    dtype: torch.dtype,
    seed: int,
    init_std: float,
    family: str = "llama",
    extra: dict | None = None,
) -> int:
    """Write the model (of the Hugging Face model_type `family`, with `extra` config keys) and
    the shipped model's tokenizer to `out`; return its parameter count."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from streaming_backend.model.loading import convert_gguf, default_model_path

    tokenizer = AutoTokenizer.from_pretrained(convert_gguf(default_model_path()))
    config = AutoConfig.for_model(
        family,
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.context,
        tie_word_embeddings=True,
        initializer_range=init_std,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype=str(dtype).removeprefix("torch."),
        **(extra or {}),
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the folder to write")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--context", type=int, default=8192, help="max_position_embeddings")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init-std", type=float, default=0.02)
    parser.add_argument("--family", default="llama", help="the Hugging Face model_type")
    parser.add_argument(
        "--config",
        type=json.loads,
        default={},
        help="more config keys as JSON, e.g. '{\"head_dim\": 256}' for gemma3_text",
    )
    args = parser.parse_args()
    if args.heads % args.kv_heads or args.hidden % args.heads:
        parser.error("--heads must divide --hidden, and --kv-heads must divide --heads")
    shape = Shape(
        args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate, args.context
    )
    dtype = getattr(torch, args.dtype)
    count = make(shape, args.out, dtype, args.seed, args.init_std, args.family, args.config)
    print(f"wrote {args.out}: {count / 1e9:.2f} B parameters, {args.dtype}")


if __name__ == "__main__":
    main()
