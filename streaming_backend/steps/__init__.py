"""How the engine's streams reach the model: prefill and decode over one forward pass per step.

`hf.HfSteps`: the Hugging Face forward, any causal LM; whole prompts prefilled in length groups,
a DynamicCache whose rows are concatenated and selected as streams join and leave.
`slots.SlotSteps`: the compact Llama-family forward over a preallocated per-slot KV cache, with
chunked prefill under a per-step token budget and prefix reuse across requests.

Both take streams from the engine (`admit`), prefill them (`prefill` yields each group of streams
whose prompt is done, with their next-token logits), step the decoding rows (`decode`, one
`RunningBatch` step), fork a decoding stream into a new one with a copy of its model state
(`fork`: beam search) and free a stream's row when it ends (`remove`). Choosing tokens (the
batch's `NextTokenChooser`) and errors stay in the engine, events in `stream_events`.
`admission` says how many waiting requests the steps take now, for the engine and the dialogue
model alike.
batch.py holds the running batch both use; forward_choice.py says which forward was built and why.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import NamedTuple, Protocol, TypeVar

import torch

from streaming_backend.model.memory import MemoryReport
from streaming_backend.sampling.settings import SamplingSettings
from streaming_backend.steps.batch import Decoded
from streaming_backend.steps.drafts import DraftCounts

__all__ = ["Decoded", "OnFailure", "Prefilled", "Steps", "Stream", "admission"]


class Stream(Protocol):
    """What the steps need of a stream (the engine's `_Stream`)."""

    prompt_ids: list[int]
    output_ids: list[int]
    settings: SamplingSettings
    generator: torch.Generator
    scheduled_ns: int  # set when its prefill starts
    cached_tokens: int  # set at admission: prompt tokens reused from the prefix cache


S = TypeVar("S", bound=Stream)

OnFailure = Callable[[list, Exception], None]  # streams whose prefill failed, and why


class Prefilled(NamedTuple):
    """Streams whose whole prompt is in the cache, with their next-token logits [N, V] fp32."""

    streams: list
    logits: torch.Tensor


class Steps(Protocol[S]):
    """A forward path's stream bookkeeping (see the module docstring)."""

    name: str
    why: str | None  # why the Hugging Face forward runs (steps/build.py); None on the compact one
    quantize: str  # the linear weights' format: none, int8, int4 (forward/quant.py)
    decode_path: str  # how a decode step runs: eager, compiled (torch.compile) or cuda_graphs
    # c-VARIANT: our C kernels, built as kernels/build.py's variant() says for this CPU
    attention: str  # what computes attention: c-VARIANT, torch (compact) or hf
    matmul: str  # what runs the linear weights: c-VARIANT, aten, dense (compact) or hf
    prompt_tokens_per_step: int | None  # admission cap on prompt tokens; None: prefill is chunked
    kv_cache: dict | None  # the compact forward's slot cache (SlotCache.report); None on hf
    kv_cache_dtype: str  # what its keys and values are kept in: float32, bfloat16, float16
    draft_kv_cache: dict | None  # the draft model's slot cache, where one drafts; else None
    # numerics.weights_digest of the model the steps run where they hold it (the compact
    # forward's weight file holds it; Hugging Face's reads its model); "": the loaded model's
    weights_digest: str

    def capacity(self) -> int: ...  # streams that can be admitted now

    # what the forward costs the host now (model/memory.py); None where it does not tell (hf,
    # a GPU). Called from any thread: it reads the tensors' addresses and pages, not their values
    def memory(self) -> MemoryReport | None: ...

    def live(self) -> list[S]: ...  # every admitted stream, prefilling or decoding

    def admit(self, streams: list[S]) -> None: ...

    def prefill(self) -> Iterator[Prefilled]: ...

    def decoding(self) -> bool: ...  # True when a decode step has rows

    def decode(self) -> Decoded: ...

    # speculative decoding (steps/drafts.py): turn drafts on, counting into `counts` (None when
    # on, else why not); after a step with drafts was emitted, drop its rejected drafts' KV
    draft_counts: DraftCounts | None

    def enable_drafts(self, counts: DraftCounts) -> str | None: ...

    def settle(self, step: Decoded) -> None: ...

    # each child (new to the steps) decodes on from a copy of its decoding parent's model state
    def fork(self, pairs: Sequence[tuple[S, S]]) -> None: ...

    def remove(self, streams: Collection[S], keep: bool = True) -> None: ...

    def clear(self) -> list[S]: ...  # after a failed step: drop every stream, return them


def admission(steps: Steps, waiting: Iterable[tuple[int, int]], reserved: int = 0) -> int:
    """How many of the waiting requests, each (rows, prompt tokens) in order, the steps take now.

    Each one goes while the steps have room for all its rows (their capacity less the `reserved`
    rows kept for requests already admitted, such as beams not yet forked) and, where the forward
    caps the prompt tokens a step admits (`prompt_tokens_per_step`), while their sum stays within
    the cap; the first one goes whatever its length, so a long prompt is never stuck."""
    room, limit, tokens, count = steps.capacity() - reserved, steps.prompt_tokens_per_step, 0, 0
    for rows, size in waiting:
        if rows > room or (count and limit is not None and tokens + size > limit):
            break
        room, tokens, count = room - rows, tokens + size, count + 1
    return count
