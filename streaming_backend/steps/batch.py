"""The running batch: the streams stepped together and the per-row state that must stay aligned.

Row r of the batch is one stream: its model state (a slot of the compact forward's cache, or a
row of a Hugging Face DynamicCache with its attention mask and next position) and its sampling
settings, held as tensors by the batch's `NextTokenChooser`. Every change (rows added after a
prefill, rows removed, one decode step) goes through `RunningBatch`, so rows, model state and
sampling tensors never fall out of step; both forwards use it, each with its own `RowState`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

import torch

from streaming_backend.model import kvcache
from streaming_backend.sampling.logits import NextTokenChooser, Row

R = TypeVar("R", bound=Row)


class Decoded(NamedTuple):
    """One decode step: the rows in order, their logits fp32 and their chooser.

    Without drafts the logits are [B, V], a row each. With drafts (speculative decoding, on the
    compact forward) row r's tokens drafted after its latest one are `drafts[r]`, and its logits
    are 1 + len(drafts[r]) consecutive rows: after its latest token, then after each drafted
    token in order (`first_rows` says where each row's begin).
    """

    streams: list
    logits: torch.Tensor
    chooser: NextTokenChooser
    drafts: tuple[list[int], ...] = ()

    def first_rows(self) -> list[int]:
        """Where each row's logits begin in `logits`."""
        if not self.drafts:
            return list(range(len(self.streams)))
        starts, at = [], 0
        for drafted in self.drafts:
            starts.append(at)
            at += 1 + len(drafted)
        return starts


class RowState(Protocol):
    """A forward's per-row model state, in the batch's row order."""

    def extend(self, added) -> None: ...  # the state of rows appended after a prefill

    # keep these rows, in this order; where a state can, a row named twice is forked (beam
    # search on a Hugging Face cache)
    def select(self, keep: list[int]) -> None: ...

    def clear(self) -> None: ...

    def decode(self, tokens: list[int]) -> torch.Tensor: ...  # one step -> logits [B, V] fp32


class RunningBatch(Generic[R]):
    """The live streams in row order with their model state and their chooser."""

    def __init__(self, state: RowState, eos_ids: Collection[int], device: torch.device | str):
        self.rows: list[R] = []
        self.state = state
        self.eos_ids = eos_ids
        self.device = device
        self._chooser: NextTokenChooser | None = None  # built on first use after a change

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, rows: Sequence[R], state) -> None:
        """Append prefilled streams with their model state (a cache, slots, ...)."""
        self.state.extend(state)
        self.rows.extend(rows)
        self._chooser = None

    def remove(self, gone: Collection[R]) -> None:
        """Drop these streams' rows (compared by identity); the others keep their order."""
        ids = {id(row) for row in gone}
        keep = [r for r, row in enumerate(self.rows) if id(row) not in ids]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[r] for r in keep]
        self.state.select(keep)
        self._chooser = None

    def fork(self, parents: Sequence[R], children: Sequence[R]) -> None:
        """Append each child with a copy of its parent's model state (the state's `select` of
        the parent's row named twice); the parents keep theirs."""
        index = {id(row): r for r, row in enumerate(self.rows)}
        self.state.select([*range(len(self.rows)), *(index[id(p)] for p in parents)])
        self.rows.extend(children)
        self._chooser = None

    def clear(self) -> list[R]:
        """Empty the batch (after a failed step); return the streams it held."""
        rows, self.rows, self._chooser = self.rows, [], None
        self.state.clear()
        return rows

    def chooser(self) -> NextTokenChooser:
        """The rows' logits pipeline, rebuilt only when the rows changed."""
        if self._chooser is None:
            self._chooser = NextTokenChooser.for_rows(self.rows, self.eos_ids, self.device)
        return self._chooser

    def step(self, drafts: Sequence[list[int]] = ()) -> Decoded:
        """One forward pass: each row's latest token in, next-token logits out; with `drafts`
        (one list a row, on a state that can `verify`), each row's drafted tokens after it too."""
        rows = list(self.rows)
        latest = [row.output_ids[-1] for row in rows]
        if not any(drafts):
            return Decoded(rows, self.state.decode(latest), self.chooser())
        logits = self.state.verify([[token, *d] for token, d in zip(latest, drafts)])
        return Decoded(rows, logits, self.chooser(), tuple(drafts))


# ---- the compact forward: one cache slot per row --------------------------------------------


class SlotForwardLike(Protocol):
    cache: Any  # forward.slots.SlotCache

    def decode(self, slots: Sequence[int], tokens: Sequence[int]) -> torch.Tensor: ...

    def verify(self, slots: Sequence[int], tokens: Sequence[Sequence[int]]) -> torch.Tensor: ...


class SlotRows:
    """Each row's slot of the compact forward's KV cache (which knows each slot's length).

    The slots belong to the caller (steps/slots.py), who allocates, copies and frees them: a row
    here only names its slot, so a row cannot be forked by naming it twice.
    """

    def __init__(self, forward: SlotForwardLike):
        self.forward = forward
        self.slots: list[int] = []

    def extend(self, added: Sequence[int]) -> None:
        self.slots.extend(added)

    def select(self, keep: list[int]) -> None:
        if len(set(keep)) != len(keep):
            raise ValueError("two rows cannot share a slot: fork a row by copying its slot")
        self.slots = [self.slots[r] for r in keep]

    def clear(self) -> None:
        self.slots = []

    def decode(self, tokens: list[int]) -> torch.Tensor:
        return self.forward.decode(self.slots, tokens)

    def verify(self, tokens: list[list[int]]) -> torch.Tensor:
        """Each row's tokens at its next positions -> logits after every one [sum, V]."""
        return self.forward.verify(self.slots, tokens)


# ---- the Hugging Face forward: rows of a left-padded DynamicCache ---------------------------


@dataclass(frozen=True)
class DecodeInputs:
    """The model inputs of one decode step for every row of the batch."""

    input_ids: torch.Tensor  # [B, 1] each row's latest token
    attention_mask: torch.Tensor  # [B, L + 1] the cache's mask plus the new token's column
    position_ids: torch.Tensor  # [B, 1] each row's next position


class Prefill(NamedTuple):
    """What a Hugging Face prefill hands the batch: its cache rows and their next positions."""

    cache: kvcache.BatchCache
    positions: torch.Tensor  # [N] the prompt lengths


class CacheRows:
    """Rows of a left-padded DynamicCache, their attention mask and next positions."""

    def __init__(self, forward: Callable[[kvcache.BatchCache, DecodeInputs], torch.Tensor]):
        """`forward(cache, inputs)` runs the model one step on the cache -> logits [B, V]."""
        self.forward = forward
        self.cache: kvcache.BatchCache | None = None  # None while the batch is empty
        self.positions = torch.zeros(0, dtype=torch.long)  # [B] next position id per row

    def extend(self, added: Prefill) -> None:
        if added.cache.rows != len(added.positions):
            raise ValueError(
                f"cache rows and positions differ: {added.cache.rows}, {len(added.positions)}"
            )
        self.cache = kvcache.merge(self.cache, added.cache)
        self.positions = torch.cat([self.positions, added.positions.to(self.positions.device)])

    def select(self, keep: list[int]) -> None:
        self.positions = self.positions[keep]
        self.cache = kvcache.select(self.cache, keep) if self.cache is not None else None

    def clear(self) -> None:
        self.cache = None
        self.positions = self.positions[:0]

    def inputs(self, tokens: list[int], device: torch.device | str) -> DecodeInputs:
        """Each row's latest token at its next position; the mask grows by one real column."""
        mask = self.cache.mask
        last = torch.tensor(tokens, dtype=torch.long)
        return DecodeInputs(
            input_ids=last[:, None].to(device),
            attention_mask=torch.cat([mask, mask.new_ones((len(tokens), 1))], dim=1),
            position_ids=self.positions[:, None].to(device),
        )

    def advance(self, inputs: DecodeInputs) -> None:
        """Record a decode step the model ran on `inputs` (its cache already holds the new keys)."""
        self.cache.mask = inputs.attention_mask
        self.positions = self.positions + 1

    def decode(self, tokens: list[int]) -> torch.Tensor:
        inputs = self.inputs(tokens, self.cache.mask.device)
        logits = self.forward(self.cache, inputs)
        self.advance(inputs)
        return logits
