"""Quality gate of quantized weights: teacher-forced greedy agreement and perplexity on the
shipped chats, against the same model unquantized.

    .venv/bin/python scripts/quant_quality.py --quantize int8,int4

The quantized forwards keep their KV cache as served (--kv-cache-dtype, auto: bfloat16 for a
float32 model on our kernels); the reference keeps it in the model's dtype.

Prints one line per quantization and exits 1 when one misses the gate (agreement below
--min-agreement, or perplexity more than --max-perplexity-change higher).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from streaming_backend.forward.quality import (
    MAX_PERPLEXITY_CHANGE,
    MIN_AGREEMENT,
    Quality,
    compare,
    reference_texts,
)
from streaming_backend.forward.quant import check_kind
from streaming_backend.forward.runner import ForwardConfig, SlotForward
from streaming_backend.forward.slots import CacheBudget
from streaming_backend.model.loading import load_model
from streaming_backend.prompts import encode_prompt, load_chat_prompts


@dataclass(frozen=True)
class GateConfig:
    """What to check."""

    model: str | None
    dtype: str
    kinds: tuple[str, ...]
    kv_cache_dtype: str
    new_tokens: int
    min_agreement: float
    max_perplexity_change: float
    out: Path | None


def forward_for(loaded, kind: str, max_len: int, kv_cache_dtype: str) -> SlotForward:
    """A compact forward with `kind` weights, its KV cache in `kv_cache_dtype` and room for one
    text at a time."""
    budget = CacheBudget(bytes=1 << 30)
    config = ForwardConfig(
        budget, max_len, max_slots=2, quantize=kind, kv_cache_dtype=kv_cache_dtype
    )
    return SlotForward.create(loaded, config)


def main(cfg: GateConfig) -> int:
    """Measure each quantization; print; 0 when all pass, else 1."""
    loaded = load_model(cfg.model, dtype=cfg.dtype, device="cpu")
    prompts = [encode_prompt(loaded.tokenizer, messages=m) for m in load_chat_prompts()]
    max_len = max(map(len, prompts)) + cfg.new_tokens + 1
    plain = forward_for(loaded, "none", max_len, str(loaded.dtype).removeprefix("torch."))
    texts = reference_texts(plain, prompts, cfg.new_tokens, loaded.eos_ids)
    print(f"{loaded.name} in {loaded.dtype}: {len(texts)} chats, {sum(map(len, texts))} tokens")
    results: list[Quality] = []
    for kind in cfg.kinds:
        candidate = forward_for(loaded, kind, max_len, cfg.kv_cache_dtype)
        print(f"{kind:>5}: KV cache {str(candidate.cache.dtype).removeprefix('torch.')}")
        quality = compare(plain, candidate, texts, kind)
        results.append(quality)
        verdict = quality.passes(cfg.min_agreement, cfg.max_perplexity_change)
        print(
            f"{kind:>5}: greedy agreement {quality.agreement:.1%} over {quality.positions} "
            f"positions, perplexity {quality.reference_perplexity:.4f} -> "
            f"{quality.perplexity:.4f} ({quality.perplexity_change:+.2%}): "
            f"{'pass' if verdict else 'FAIL'}",
            flush=True,
        )
    if cfg.out:
        rows = [asdict(q) | {"passes": q.passes()} for q in results]
        cfg.out.write_text(json.dumps({"model": loaded.name, "results": rows}, indent=2))
    ok = all(q.passes(cfg.min_agreement, cfg.max_perplexity_change) for q in results)
    return 0 if ok else 1


def parse_args(argv: list[str] | None = None) -> GateConfig:
    """Command line -> GateConfig."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder or .gguf (default model)")
    parser.add_argument("--dtype", default="auto", help="the dtype both forwards run in")
    parser.add_argument("--quantize", default="int8,int4", help="comma-separated: int8, int4")
    parser.add_argument(
        "--kv-cache-dtype", default="auto", choices=("auto", "float32", "bfloat16"),
        help="the quantized forwards' KV cache (as served: auto)",
    )  # fmt: skip
    # 256: with 64 (8 chats, ~700 positions) the int4 perplexity change moved by more than a
    # point between runs that changed only attention rounding; 256 (~1250-1500 positions, each
    # chat's answer until it ends) holds it steadier (docs/design.md, the quality gate)
    parser.add_argument("--new-tokens", type=int, default=256, help="answer tokens per chat")
    parser.add_argument("--min-agreement", type=float, default=MIN_AGREEMENT)
    parser.add_argument("--max-perplexity-change", type=float, default=MAX_PERPLEXITY_CHANGE)
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    try:
        kinds = tuple(check_kind(k.strip()) for k in args.quantize.split(",") if k.strip())
    except ValueError as error:
        parser.error(str(error))
    if args.new_tokens < 1:
        parser.error("--new-tokens must be at least 1")
    return GateConfig(
        model=args.model,
        dtype=args.dtype,
        kinds=kinds,
        kv_cache_dtype=args.kv_cache_dtype,
        new_tokens=args.new_tokens,
        min_agreement=args.min_agreement,
        max_perplexity_change=args.max_perplexity_change,
        out=args.out,
    )


if __name__ == "__main__":
    sys.exit(main(parse_args()))
