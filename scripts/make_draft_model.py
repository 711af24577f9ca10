"""Write a draft model for speculative decoding cut from a model: its first layers, its final
norm and its head, with its tokenizer, as a Hugging Face folder (safetensors).

    PYTHONPATH=. .venv/bin/python scripts/make_draft_model.py --layers 8 --out ../models/draft-8
    tokenstream serve --speculative draft --draft-model ../models/draft-8

No hub model of the default model's tokenizer is at hand without a download, so a draft for
measurements is made from the model itself (default: the bundled SmolLM2-135M-Instruct): the
same embedding, the first --layers decoder layers, the final norm and the head. Such a draft
shares the model's tokenizer by construction; how often its greedy tokens are the model's is
what scripts/speculation_bench.py --draft-model measures. A real deployment takes a smaller
model trained with the same tokenizer instead (SmolLM2's 135M for its 1.7B, say).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def cut(model, layers: int):
    """The model keeping only its first `layers` decoder layers (in place; returned)."""
    total = model.config.num_hidden_layers
    if not 1 <= layers <= total:
        raise SystemExit(f"--layers must be within 1..{total}, not {layers}")
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):  # per-layer attention kinds, where listed
        model.config.layer_types = model.config.layer_types[:layers]
    return model


def write_draft(source: str | None, layers: int, out: Path) -> Path:
    """Cut the model at `source` (None: the bundled default) to `layers` and save it with its
    tokenizer to `out`, in the model's own dtype."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from streaming_backend.model.loading import convert_gguf, default_model_path

    path = Path(source) if source else default_model_path()
    if path.suffix == ".gguf":
        path = convert_gguf(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    cut(model, layers).save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(path).save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2")
    parser.add_argument("--layers", type=int, required=True, help="decoder layers kept")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    with torch.no_grad():
        out = write_draft(args.model, args.layers, args.out)
    print(f"draft model with {args.layers} layers written to {out}")


if __name__ == "__main__":
    main()
