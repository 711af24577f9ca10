"""The Hugging Face forward: any causal LM, whole prompts prefilled in groups of similar length.

Admitted prompts are left-padded into groups whose padding stays under `max_padding` and each
group is prefilled in one forward pass; its rows then join the running batch (a DynamicCache whose
rows are concatenated on join and selected on leave). No prefix reuse, no chunking: this is the
fallback for architectures the compact forward does not know, and `forward=hf` for comparison.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterator

from streaming_backend.batch import CacheRows, DecodeInputs, Prefill, RunningBatch
from streaming_backend.batch_forward import cache_kwarg, prefill_prompts
from streaming_backend.config import EngineConfig
from streaming_backend.loading import LoadedModel
from streaming_backend.steps import Decoded, OnFailure, Prefilled, S

log = logging.getLogger(__name__)

ASKED_FOR = "asked for with --forward hf"  # why it runs, unless the compact forward refused


class HfSteps:
    """Streams on the Hugging Face forward."""

    name = "hf"
    quantize = "none"  # the model's own weights, as loaded
    decode_path = "eager"
    attention = "hf"  # the Hugging Face modelling code's own
    matmul = "hf"

    def __init__(
        self, loaded: LoadedModel, config: EngineConfig, on_failure: OnFailure, why: str = ASKED_FOR
    ):
        """`why`: why this forward runs (the compact forward's UnsupportedModel, or ASKED_FOR)."""
        self.loaded = loaded
        self.why = why
        self.config = config
        self.prompt_tokens_per_step = config.max_prefill_tokens
        self._on_failure = on_failure
        self._batch: RunningBatch = RunningBatch(
            CacheRows(self._forward), loaded.eos_ids, loaded.device
        )
        self._pending: list = []  # admitted, not yet prefilled
        self._cache_kwarg = cache_kwarg(loaded.model)

    def capacity(self) -> int:
        return self.config.max_streams - len(self._batch) - len(self._pending)

    def live(self) -> list:
        return [*self._pending, *self._batch.rows]

    def admit(self, streams: list) -> None:
        self._pending.extend(streams)

    def decoding(self) -> bool:
        return bool(self._batch.rows)

    def prefill(self) -> Iterator[Prefilled]:
        """Prefill the admitted prompts group by group; each group's streams join the batch."""
        pending, self._pending = self._pending, []
        for group in length_groups(pending, self.config.max_padding):
            yield from self._prefill_group(group)

    def _prefill_group(self, streams: list) -> Iterator[Prefilled]:
        """One group in one pass; if that fails, each alone, so only a bad prompt fails."""
        try:
            cache, logits, positions = self._forward_prompts(streams)
        except Exception as exc:
            if len(streams) == 1:
                log.exception("prefill failed for %s", streams[0].handle.request_id)
                self._on_failure(streams, exc)
                return
            for stream in streams:
                yield from self._prefill_group([stream])
            return
        self._batch.add(streams, Prefill(cache, positions))
        yield Prefilled(streams, logits)

    def _forward_prompts(self, streams: list):
        """One forward pass over left-padded prompts -> (cache, last logits [N, V], positions)."""
        now = time.monotonic_ns()
        for stream in streams:
            stream.scheduled_ns = now
        return prefill_prompts(self.loaded, [s.prompt_ids for s in streams])

    def decode(self) -> Decoded:
        """One forward pass for every row of the batch, one new token each."""
        return self._batch.step()

    def _forward(self, cache, inputs: DecodeInputs):
        """The model one step on the batch's cache -> logits [B, V] fp32."""
        out = self.loaded.model(
            input_ids=inputs.input_ids,
            attention_mask=inputs.attention_mask,
            position_ids=inputs.position_ids,
            use_cache=True,
            **{self._cache_kwarg: cache.cache},
        )
        return out.logits[:, -1, :].float()

    def remove(self, streams: Collection, keep: bool = True) -> None:
        gone = {id(s) for s in streams}
        self._pending = [s for s in self._pending if id(s) not in gone]
        self._batch.remove(streams)

    def clear(self) -> list:
        pending, self._pending = self._pending, []
        return pending + self._batch.clear()


def length_groups(streams: list[S], max_padding: float) -> list[list[S]]:
    """Split prompts, shortest first, into groups whose padding stays under max_padding."""
    groups: list[list[S]] = []
    real = 0
    for stream in sorted(streams, key=lambda s: len(s.prompt_ids)):
        n = len(stream.prompt_ids)
        group = groups[-1] if groups else None
        # Sorted ascending, so the newest prompt is the longest: every row pads to n.
        if group and n * (len(group) + 1) <= (1 + max_padding) * (real + n):
            group.append(stream)
            real += n
        else:
            groups.append([stream])
            real = n
    return groups
