"""Speculative decoding's drafts from a draft model: a smaller model with the same tokenizer.

    weights = load_draft_model("path/to/small", loaded, config)  # ValueError: another vocabulary
    draft = weights.with_cache(slots, max_len)                    # its own KV cache
    drafts = draft.propose([DraftRequest(key, context, count), ...])   # one list a request
    draft.release(key)                                           # the stream ended

The draft model runs on the compact forward, loaded as the model itself is (a skeleton and the
weight cache's mapped weight file, model/weight_cache.py), with a KV cache slot of its own per
stream that drafts; that cache's bytes come out of the model's KV cache budget (steps/build.py
splits it: `DraftWeights.slot_bytes` is one slot's cost). Each step, the streams that draft
(steps/slots.py decides which, and how many tokens, through each stream's `Drafter`) are
brought up to date in one prefill call: the tokens of their context the draft's slot does not
hold yet (after a rejected draft the slot is first cut back to what the context still shares
with it). The logits after each stream's newest token give its first drafted token, greedily;
decode calls of the streams still drafting give the next ones. The steps then verify the drafts
as rows of the running batch, which keeps the answer plain decoding's whatever the draft model
proposes.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import torch

from streaming_backend.configuration.models import EngineConfig
from streaming_backend.forward.llama import CompactLlama
from streaming_backend.forward.runner import ForwardConfig, PromptChunk, SlotForward, cache_dtype
from streaming_backend.forward.slots import SlotCache, slot_bytes
from streaming_backend.model.loading import (
    DTYPES,
    LoadedModel,
    load_model,
    progress,
    resolve_quantize,
)

# The most context tokens a stream's draft slot takes in per step: a long prompt is caught up
# over several steps (no drafts meanwhile) instead of delaying one step by its whole prefill
CATCH_UP_TOKENS = 256


class DraftRequest(NamedTuple):
    """One stream's wish for a draft: its context (prompt then answer) and how many tokens."""

    key: Hashable  # the stream's, until release(key)
    context: list[int]
    count: int


class DraftWeights(NamedTuple):
    """A draft model loaded on the compact forward, before any KV cache is made for it."""

    model: CompactLlama
    dtype: torch.dtype  # its KV cache's
    device: torch.device
    vocab: int  # the target's vocabulary size: no drafted id at or past it
    name: str
    context: int  # its own context: no slot is longer

    def slot_length(self, max_len: int) -> int:
        """Positions of a slot beside the model's slots of `max_len` (at most its context)."""
        return min(max_len, self.context, self.model.shape.max_positions)

    def slot_bytes(self, max_len: int) -> int:
        """Bytes of K and V one such slot takes (its scratch slot takes as many)."""
        return slot_bytes(self.model.shape, self.slot_length(max_len), self.dtype)

    def with_cache(self, slots: int, max_len: int) -> DraftModel:
        """The draft model with a new KV cache of `slots` slots (and its scratch slot) of
        `slot_length(max_len)` positions."""
        cache = SlotCache(
            self.model.shape, slots, self.slot_length(max_len), self.dtype, self.device
        )
        return DraftModel(
            SlotForward(self.model, cache, self.device), self.vocab, self.name, self.context
        )


class DraftModel:
    """A draft model on the compact forward, with one KV cache slot per drafting stream."""

    def __init__(
        self, forward: SlotForward, vocab: int, name: str = "draft", context: int | None = None
    ):
        self.forward = forward
        self.cache = forward.cache
        self.vocab = vocab  # the target's vocabulary size: no drafted id at or past it
        self.name = name
        self.context = context or self.cache.max_len  # its own context: no slot is longer
        self._slot: dict[Hashable, int] = {}  # key -> its slot
        self._written: dict[Hashable, list[int]] = {}  # key -> the tokens its slot holds

    @property
    def weights(self) -> DraftWeights:
        """Its model as loaded, to be given another cache (steps/build.py Carried)."""
        model, dtype, device = self.forward.model, self.cache.k[0].dtype, self.forward.device
        return DraftWeights(model, dtype, device, self.vocab, self.name, self.context)

    def describe(self) -> str:
        """Its KV cache, for the load log."""
        return (
            f"draft model {self.name}: {self.cache.slots} KV cache slots of "
            f"{self.cache.max_len} positions ({self.cache.bytes / 2**20:.0f} MiB)"
        )

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """Each request's draft: up to `count` tokens, greedily; [] for a request whose slot
        is still catching up with its context, or when no slot is free."""
        drafts: list[list[int]] = [[] for _ in requests]
        pending = []  # (request index, its catch-up chunk, whether it drafts after it)
        for at, request in enumerate(requests):
            chunk, complete = self._catch_up(request)
            if chunk is not None:
                pending.append((at, chunk, complete and request.count > 0))
        if not pending:
            return drafts
        logits = self.forward.prefill(
            [PromptChunk(self._slot[chunk.key], chunk.tokens) for _, chunk, _ in pending]
        )  # [N, V]: after each chunk's last token
        drafting = {}
        for row, (at, chunk, drafts_now) in enumerate(pending):
            self._written[chunk.key] += chunk.tokens
            if drafts_now:
                drafts[at].append(self._pick(logits[row]))
                drafting[at] = requests[at]
        self._extend(drafts, drafting)
        return drafts

    def _extend(self, drafts: list[list[int]], rows: dict[int, DraftRequest]) -> None:
        """Decode the drafts' next tokens, in steps of every request still short of its count."""
        while True:
            going = [at for at, request in rows.items() if len(drafts[at]) < request.count]
            if not going:
                return
            keys = [rows[at].key for at in going]
            latest = [drafts[at][-1] for at in going]
            logits = self.forward.decode([self._slot[key] for key in keys], latest)
            for row, (at, key, token) in enumerate(zip(going, keys, latest)):
                self._written[key].append(token)
                drafts[at].append(self._pick(logits[row]))

    def _catch_up(self, request: DraftRequest) -> tuple[_Chunk | None, bool]:
        """(the context tokens the request's slot takes in now, whether that completes it);
        (None, False) when no slot is free or the context leaves no room."""
        key, context = request.key, request.context
        if key not in self._slot:
            if not self.cache.free_slots:
                return None, False
            self._slot[key], self._written[key] = self.cache.allocate(), []
        written = self._written[key]
        kept = _shared(written, context)
        kept = min(kept, len(context) - 1)  # the newest token goes in again: its logits draft
        if kept < len(written):
            kept = self._cut(key, kept)
        room = self.cache.max_len - kept
        if len(context) - kept + max(request.count - 1, 0) > room:
            return None, False
        tokens = list(context[kept : kept + CATCH_UP_TOKENS])
        return _Chunk(key, tokens), kept + len(tokens) == len(context)

    def _cut(self, key: Hashable, length: int) -> int:
        """Keep the first `length` tokens of the key's slot (a rejected draft's are dropped);
        where a sliding-window ring no longer holds what that needs, start the slot afresh.
        Returns the tokens kept."""
        slot = self._slot[key]
        if self.cache.reusable(slot, length) != length:
            length = 0
        self.cache.truncate(slot, length)
        del self._written[key][length:]
        return length

    def _pick(self, logits: torch.Tensor) -> int:
        """The draft's greedy token from one row of its logits [V], in the model's vocabulary."""
        return int(torch.argmax(logits[: self.vocab]))

    def release(self, key: Hashable) -> None:
        """The stream ended: its slot is free."""
        slot = self._slot.pop(key, None)
        if slot is not None:
            self.cache.free(slot)
            del self._written[key]

    @property
    def streams(self) -> int:
        """Streams holding a slot of the draft model's cache."""
        return len(self._slot)


class _Chunk(NamedTuple):
    key: Hashable
    tokens: list[int]


# A slot's tokens are its stream's context up to the newest draft: they can differ from the
# context only in this many last tokens (MAX_DRAFT is 8), compared one by one; what is before
# them is compared at once (and one by one only if that finds a difference)
SHARED_TAIL = 64


def _shared(written: list[int], context: list[int]) -> int:
    """How many leading tokens two sequences share."""
    limit = min(len(written), len(context))
    at = max(0, limit - SHARED_TAIL)
    if written[:at] != context[:at]:
        at = 0
    while at < limit and written[at] == context[at]:
        at += 1
    return at


def load_draft_model(source: str, loaded: LoadedModel, config: EngineConfig) -> DraftWeights:
    """The draft model at `source` (a model folder or GGUF file) for the model `loaded`, on the
    compact forward in the model's dtype, device and quantize setting, without a KV cache yet.
    ValueError when its tokenizer is not the model's, or when the compact forward does not run
    it."""
    from streaming_backend.forward.family import UnsupportedModel
    from streaming_backend.model.weight_cache import compact_model

    dtype = next(name for name, value in DTYPES.items() if value == loaded.dtype)
    progress(f"draft model {source}")
    draft = load_model(source, dtype, str(loaded.device), weights=False)
    check_same_vocabulary(loaded, draft)
    forward_config = ForwardConfig(
        quantize=resolve_quantize(config.quantize, draft), kv_cache_dtype=config.kv_cache_dtype
    )
    try:
        model = compact_model(
            draft, forward_config.quantize, forward_config.matmul, forward_config.huge_pages
        )
    except UnsupportedModel as exc:
        raise ValueError(
            f"the draft model {draft.name} does not run on the compact forward: {exc}"
        ) from None
    vocab = loaded.model.config.vocab_size
    dtype = cache_dtype(forward_config, draft.dtype, model)
    return DraftWeights(model, dtype, draft.device, vocab, draft.name, draft.context_length)


def check_same_vocabulary(model: LoadedModel, draft: LoadedModel) -> None:
    """ValueError, saying what differs, unless the draft's tokenizer gives every token the id
    the model's gives it and names the same special tokens: a drafted id must mean the same."""
    why = vocabulary_difference(model.tokenizer, draft.tokenizer)
    if why:
        raise ValueError(
            f"the draft model {draft.name} has another vocabulary than the model {model.name} "
            f"({why}): a draft model must use the model's tokenizer"
        )


def vocabulary_difference(tokenizer: Any, other: Any) -> str:
    """What differs between two tokenizers' vocabularies ("" when nothing): their sizes, the
    ids of their tokens, their special tokens."""
    if len(tokenizer) != len(other):
        return f"{len(other)} tokens, not {len(tokenizer)}"
    ours, theirs = tokenizer.get_vocab(), other.get_vocab()
    moved = sorted(t for t in ours.keys() | theirs.keys() if ours.get(t) != theirs.get(t))
    if moved:
        token = moved[0]
        return (
            f"{len(moved)} tokens with other ids, such as {token!r}: "
            f"{theirs.get(token)} where the model has {ours.get(token)}"
        )
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        if getattr(tokenizer, name, None) != getattr(other, name, None):
            return f"{name} {getattr(other, name, None)}, not {getattr(tokenizer, name, None)}"
    if sorted(tokenizer.all_special_ids) != sorted(other.all_special_ids):
        return "other special tokens"
    return ""
