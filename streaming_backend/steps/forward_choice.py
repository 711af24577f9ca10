"""Which forward a model runs on and why, as its health answer (the canary) reports it.

    choice = ForwardChoice.of(steps)  # what steps/build.py picked
    choice.as_dict()                  # under wire.FORWARD in the health answer and in /status

The compact forward runs every model it can; a model it refuses (a family outside
forward/llama.py's FAMILIES, or a feature it lacks) runs on the Hugging Face forward, and `why`
says which refusal, or that `--forward hf` asked for it; with `--forward compact` the refusal
fails the load instead (fall_back, for the chat model's steps/build.py and the dialogue model's
dialogue/batch_forward.py alike). Standard library only at import.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from streaming_backend.forward.llama import UnsupportedModel
    from streaming_backend.steps import Steps

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ForwardChoice:
    """The forward a model's streams run on, what runs its weights and attention, and why."""

    forward: str  # compact or hf
    why: str | None  # why the Hugging Face forward runs; None on the compact forward
    quantize: str  # the linear weights' format: none, int8, int4 (forward/quant.py)
    # c-VARIANT: our C kernels, built as kernels/build.py's variant() says for this CPU
    matmul: str  # what runs the linear weights: c-VARIANT, aten, dense; or hf
    attention: str  # what computes attention: c-VARIANT, torch; or hf
    # the compact forward's KV cache: slots, positions, bytes, layers in sliding-window rings
    # and their rows (forward/slots.py, SlotCache.report); None on hf
    kv_cache: dict[str, Any] | None = None
    # the draft model's KV cache beside it (speculative=draft), of the same kv_cache_memory;
    # None without one
    draft_kv_cache: dict[str, Any] | None = None

    @classmethod
    def of(cls, steps: Steps) -> ForwardChoice:
        """The choice the steps embody (steps/build.py's build_steps)."""
        return cls(
            steps.name, steps.why, steps.quantize, steps.matmul, steps.attention, steps.kv_cache,
            steps.draft_kv_cache,
        )  # fmt: skip

    def as_dict(self) -> dict[str, Any]:
        """The choice by name."""
        return dataclasses.asdict(self)


def fall_back(refusal: UnsupportedModel, forward: str) -> str:
    """Why the Hugging Face forward runs a model the compact forward refused (logged); raise
    UnsupportedModel with that reason instead when `forward` is "compact" (no fallback asked)."""
    from streaming_backend.forward.llama import UnsupportedModel

    if forward == "compact":
        raise UnsupportedModel(f"forward compact was asked for, but {refusal}") from refusal
    log.warning("the Hugging Face forward runs this model: %s", refusal)
    return str(refusal)
