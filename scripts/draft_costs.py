"""What draft-model speculation costs, in decode steps of the model: a model's one-token decode
step, its verification of 3, 5 and 9 tokens of one slot, and a draft model's decode step and
two-token catch-up, timed in turns in one process (median of the rounds), and from them the
per-token acceptance above which drafts of --draft tokens pay, with the speed-up at a few
acceptances (an estimate: acceptance itself depends on the two models and the text).

    PYTHONPATH=$PWD nice -n 5 .venv/bin/python scripts/draft_costs.py \\
        --model ../models/llama-1b --draft-model <the default model's GGUF>

Both run on the compact forward as served (dtype and quantize auto), a 300-token context.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from streaming_backend.forward.runner import ForwardConfig, PromptChunk, SlotForward
from streaming_backend.forward.slots import CacheBudget
from streaming_backend.model.loading import load_model, resolve_quantize
from streaming_backend.model.weight_cache import compact_model

CONTEXT = list(range(100, 400))


def _forward(source: str | None) -> tuple[SlotForward, int]:
    """A model's compact forward as served, with one slot holding CONTEXT."""
    loaded = load_model(source, "auto", "cpu", weights=False)
    quantize = resolve_quantize("auto", loaded)
    config = ForwardConfig(
        budget=CacheBudget(bytes=512 * 2**20), quantize=quantize, max_len=1024, max_slots=2
    )
    forward = SlotForward.create(loaded, config, compact_model(loaded, quantize))
    slot = forward.cache.allocate()
    forward.prefill([PromptChunk(slot, CONTEXT)])
    return forward, slot


def _timed(forward: SlotForward, slot: int, call) -> float:
    """Seconds of one call; the slot is cut back to CONTEXT after it."""
    start = time.perf_counter()
    call()
    seconds = time.perf_counter() - start
    forward.cache.truncate(slot, len(CONTEXT))
    return seconds


def tokens_per_step(acceptance: float, draft: int) -> float:
    """Tokens a step gives on average with `draft` drafted tokens, each accepted with
    probability `acceptance` while the ones before it were: 1 + a + a^2 + ... + a^draft."""
    return sum(acceptance**i for i in range(draft + 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2")
    parser.add_argument("--draft-model", required=True)
    parser.add_argument("--draft", type=int, default=4, help="tokens drafted a step")
    parser.add_argument("--rounds", type=int, default=25)
    args = parser.parse_args()

    model, slot = _forward(args.model)
    draft, draft_slot = _forward(args.draft_model)
    verify = args.draft + 1
    cases = {
        "model decode 1": (model, slot, lambda: model.decode([slot], [5])),
        "model verify 3": (model, slot, lambda: model.verify([slot], [[5, 6, 7]])),
        f"model verify {verify}": (
            model, slot, lambda: model.verify([slot], [list(range(5, 5 + verify))])
        ),
        "model verify 9": (model, slot, lambda: model.verify([slot], [list(range(5, 14))])),
        "draft decode 1": (draft, draft_slot, lambda: draft.decode([draft_slot], [5])),
        "draft catch-up 2": (
            draft, draft_slot, lambda: draft.prefill([PromptChunk(draft_slot, [5, 6])])
        ),
    }  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in cases}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for name, (forward, held, call) in cases.items():
                times[name].append(_timed(forward, held, call))
    median = {name: statistics.median(values) for name, values in times.items()}
    step = median["model decode 1"]
    for name, seconds in median.items():
        print(f"{name:18s} {seconds * 1e3:7.2f} ms  {seconds / step:5.2f} model decode steps")
    # a step with drafts: the draft catches up (2 tokens) and decodes the rest, the model verifies
    cost = (
        median[f"model verify {verify}"]
        + median["draft catch-up 2"]
        + (args.draft - 1) * median["draft decode 1"]
    ) / step
    even = next((a / 100 for a in range(101) if tokens_per_step(a / 100, args.draft) >= cost), None)
    print(f"a step with {args.draft} drafts costs {cost:.2f} model decode steps; it pays from a "
          f"per-token acceptance of {even}")  # fmt: skip
    for acceptance in (0.5, 0.7, 0.8, 0.9):
        speed = tokens_per_step(acceptance, args.draft) / cost
        print(f"  acceptance {acceptance:.1f}: {speed:.2f}x")


if __name__ == "__main__":
    main()
