"""The Hugging Face forward: any causal LM, whole prompts prefilled in groups of similar length.

Admitted prompts are left-padded into groups whose padding stays under `max_padding` and each
group is prefilled in one forward pass; its rows then join the running batch (a DynamicCache whose
rows are concatenated on join, selected on leave and repeated on a fork). No prefix reuse, no
chunking: this is the fallback for architectures the compact forward does not know, and
`forward=hf` for comparison. `HfForward` is the model's two calls (prompts in, one token per row).
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Collection, Iterator, Sequence

import torch

from streaming_backend.configuration.models import EngineConfig
from streaming_backend.model import kvcache
from streaming_backend.model.loading import LoadedModel
from streaming_backend.model.numerics import weights_digest
from streaming_backend.steps import Decoded, OnFailure, Prefilled, S
from streaming_backend.steps.batch import CacheRows, DecodeInputs, Prefill, RunningBatch

log = logging.getLogger(__name__)

ASKED_FOR = "asked for with --forward hf"  # why it runs, unless the compact forward refused


class HfSteps:
    """Streams on the Hugging Face forward."""

    name = "hf"
    quantize = "none"  # the model's own weights, as loaded
    decode_path = "eager"
    attention = "hf"  # the Hugging Face modelling code's own
    matmul = "hf"
    kv_cache = None  # a DynamicCache per batch, grown as it goes: nothing preallocated to report
    draft_kv_cache = None  # no draft model runs here
    draft_counts = None  # no speculative decoding (enable_drafts)

    def __init__(
        self, loaded: LoadedModel, config: EngineConfig, on_failure: OnFailure, why: str = ASKED_FOR
    ):
        """`why`: why this forward runs (the compact forward's UnsupportedModel, or ASKED_FOR)."""
        self.loaded = loaded
        self.why = why
        self.config = config
        self.prompt_tokens_per_step = config.max_prefill_tokens
        self._on_failure = on_failure
        self.model = HfForward(loaded)
        self._batch: RunningBatch = RunningBatch(
            CacheRows(self.model.step), loaded.eos_ids, loaded.device
        )
        self._pending: list = []  # admitted, not yet prefilled

    @property
    def kv_cache_dtype(self) -> str:
        """Its DynamicCache's dtype: the model's."""
        return str(self.loaded.dtype).removeprefix("torch.")

    @property
    def weights_digest(self) -> str:
        """numerics.weights_digest of the model (with its weights, where the engine's loaded
        model may be a skeleton: load_model's weights=False), read now."""
        return weights_digest(self.loaded)

    def capacity(self) -> int:
        return self.config.max_streams - len(self._batch) - len(self._pending)

    def memory(self) -> None:
        """Not told: the Hugging Face forward's cache grows with its rows."""
        return None

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
        return self.model.prefill([s.prompt_ids for s in streams])

    def decode(self) -> Decoded:
        """One forward pass for every row of the batch, one new token each."""
        return self._batch.step()

    def enable_drafts(self, counts) -> str | None:
        """Why this forward does not speculate: its cache cannot drop a rejected draft's rows."""
        return "the Hugging Face forward verifies no drafts"

    def settle(self, step: Decoded) -> None:
        """Nothing to settle: its steps carry no drafts."""

    def fork(self, pairs: Sequence[tuple]) -> None:
        """Each child joins the batch with a copy of its parent's cache row and position."""
        if pairs:
            self._batch.fork([parent for parent, _ in pairs], [child for _, child in pairs])

    def remove(self, streams: Collection, keep: bool = True) -> None:
        gone = {id(s) for s in streams}
        self._pending = [s for s in self._pending if id(s) not in gone]
        self._batch.remove(streams)

    def clear(self) -> list:
        pending, self._pending = self._pending, []
        return pending + self._batch.clear()


class HfForward:
    """Hugging Face's model on a left-padded DynamicCache: prompts prefilled together, then one
    token per row per step (any causal LM)."""

    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self._cache_kwarg = cache_kwarg(loaded.model)

    def prefill(self, prompts: Sequence[Sequence[int]]):
        """One forward pass over left-padded prompts -> (cache, last logits [N, V] fp32,
        positions [N])."""
        length = max(len(p) for p in prompts)
        pad = min(self.loaded.eos_ids, default=0)  # any valid id: masked out
        ids = torch.full((len(prompts), length), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), length), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, length - len(prompt) :] = torch.tensor(prompt)
            mask[row, length - len(prompt) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [N, L]; padding gets position 0
        device = self.loaded.device
        cache = kvcache.DynamicCache()
        out = self.loaded.model(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            position_ids=positions.to(device),
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kwarg: cache},
        )
        logits = out.logits[:, -1, :].float()  # [N, V]
        return kvcache.BatchCache(cache, mask.to(device)), logits, mask.sum(-1)

    def step(self, cache: kvcache.BatchCache, inputs: DecodeInputs) -> torch.Tensor:
        """The model one step on the batch's cache -> logits [B, V] fp32."""
        out = self.loaded.model(
            input_ids=inputs.input_ids,
            attention_mask=inputs.attention_mask,
            position_ids=inputs.position_ids,
            use_cache=True,
            **{self._cache_kwarg: cache.cache},
        )
        return out.logits[:, -1, :].float()


def cache_kwarg(model) -> str:
    """The name under which this model's forward() takes a KV cache."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


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
