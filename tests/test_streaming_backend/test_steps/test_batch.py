"""The running batch keeps rows, model state (cache rows and positions, or slots) and the
chooser's sampling tensors aligned, for both forwards."""

from dataclasses import dataclass, field

import pytest
import torch

from streaming_backend.model import kvcache
from streaming_backend.sampling.settings import SamplingSettings
from streaming_backend.steps.batch import CacheRows, Prefill, RunningBatch, SlotRows


@dataclass(eq=False)
class Row:
    name: str
    settings: SamplingSettings = field(default_factory=SamplingSettings)
    output_ids: list[int] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=lambda: [1])
    generator: torch.Generator = field(default_factory=torch.Generator)
    grammar: None = None


def _cache(values: list[float], lengths: list[int]) -> Prefill:
    """A 2-layer cache whose row r holds values[r] everywhere, left-padded to the longest, and
    its positions (the lengths)."""
    length = max(lengths)
    keys = torch.stack([torch.full((2, length, 4), v) for v in values])  # [B, heads, L, dim]
    mask = torch.zeros((len(values), length), dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, length - n :] = 1
    cache = kvcache.BatchCache(kvcache._build([(keys, keys.clone())] * 2), mask)
    return Prefill(cache, torch.tensor(lengths))


class EchoModel:
    """Stands in for a model step: logits [B, 4] whose row r is its position and its cache
    value, so a test sees which state each row was stepped with."""

    def __call__(self, cache: kvcache.BatchCache, inputs) -> torch.Tensor:
        keys = cache.cache.layers[0].keys[:, 0, -1, 0]  # [B]
        pos = inputs.position_ids[:, 0].float()
        return torch.stack([pos, keys, inputs.input_ids[:, 0].float(), pos], dim=-1)


def _hf_batch() -> RunningBatch:
    return RunningBatch(CacheRows(EchoModel()), eos_ids=[0], device="cpu")


def _row_values(batch: RunningBatch) -> list[float]:
    keys = batch.state.cache.cache.layers[0].keys  # [B, heads, L, dim]
    return keys[:, 0, -1, 0].tolist()


def _filled() -> tuple[RunningBatch, list[Row]]:
    rows = [Row("a", SamplingSettings(temperature=0)), Row("b"), Row("c", SamplingSettings(0.5))]
    for i, row in enumerate(rows):
        row.output_ids.append(10 + i)
    batch = _hf_batch()
    batch.add(rows[:2], _cache([1.0, 2.0], [3, 5]))
    batch.add(rows[2:], _cache([3.0], [2]))
    return batch, rows


def test_add_appends_rows_cache_and_positions_together():
    """Rows added after a prefill line up with their cache rows and positions."""
    batch, rows = _filled()
    assert batch.rows == rows and len(batch) == 3
    assert batch.state.positions.tolist() == [3, 5, 2]
    assert _row_values(batch) == [1.0, 2.0, 3.0]
    assert batch.state.cache.mask.sum(-1).tolist() == [3, 5, 2]


def test_add_refuses_mismatched_sizes():
    """Two rows with one cache row is a bug, caught at once."""
    bad = Prefill(_cache([1.0], [2]).cache, torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="differ"):
        _hf_batch().add([Row("a"), Row("b")], bad)


def test_remove_keeps_the_others_aligned():
    """Removing a middle row keeps the rest in order with their cache rows and positions."""
    batch, rows = _filled()
    batch.remove([rows[1]])
    assert batch.rows == [rows[0], rows[2]]
    assert batch.state.positions.tolist() == [3, 2]
    assert _row_values(batch) == [1.0, 3.0]
    assert batch.state.cache.mask.shape == (2, 3)  # the 5-token row's extra columns are gone


def test_remove_compares_by_identity():
    """A different row that looks the same is not removed; removing all empties the cache."""
    batch, rows = _filled()
    batch.remove([Row("a", SamplingSettings(temperature=0), [10])])
    assert len(batch) == 3
    batch.remove(rows)
    assert len(batch) == 0 and batch.state.cache is None and batch.state.positions.tolist() == []


def test_fork_appends_a_copy_of_the_parents_state():
    """A forked row (a beam continued twice) joins with its parent's cache row, mask and
    position; the parent keeps its own, and the chooser covers the new row."""
    batch, rows = _filled()
    child = Row("b2", output_ids=[11])
    batch.fork([rows[1]], [child])
    assert batch.rows == [*rows, child]
    assert batch.state.positions.tolist() == [3, 5, 2, 5]
    assert _row_values(batch) == [1.0, 2.0, 3.0, 2.0]
    assert batch.state.cache.mask.sum(-1).tolist() == [3, 5, 2, 5]
    assert len(batch.chooser()) == 4


def test_slot_rows_refuse_to_share_a_slot():
    """On the compact forward a fork must copy the slot (steps/slots.py): naming a row twice is
    a bug, caught at once."""
    batch = RunningBatch(SlotRows(SlotEcho()), eos_ids=[0], device="cpu")
    rows = [Row("a", output_ids=[1])]
    batch.add(rows, [3])
    with pytest.raises(ValueError, match="share a slot"):
        batch.fork(rows, [Row("b", output_ids=[1])])


def test_chooser_follows_the_rows():
    """The chooser is built once per batch and rebuilt after rows come or go."""
    batch, rows = _filled()
    chooser = batch.chooser()
    assert batch.chooser() is chooser
    assert chooser.params.greedy.tolist() == [True, False, False]
    assert chooser.params.temperature.tolist() == [1.0, 1.0, 0.5]
    batch.remove([rows[0]])
    assert batch.chooser().params.greedy.tolist() == [False, False]
    batch.add([rows[0]], _cache([9.0], [1]))
    assert batch.chooser().params.greedy.tolist() == [False, False, True]


def test_step_runs_each_row_at_its_position_and_advances():
    """A step feeds each row's last token at its next position with a mask one column wider,
    then records the step; the logits come back in row order with the batch's chooser."""
    batch, rows = _filled()
    step = batch.step()
    assert step.streams == rows and step.chooser is batch.chooser()
    assert step.logits[:, :3].tolist() == [[3, 1, 10], [5, 2, 11], [2, 3, 12]]
    assert (
        batch.state.cache.mask.shape == (3, 6) and batch.state.cache.mask[:, -1].tolist() == [1] * 3
    )
    assert batch.state.positions.tolist() == [4, 6, 3]
    batch.remove([rows[1]])
    assert batch.step().logits[:, :3].tolist() == [[4, 1, 10], [3, 3, 12]]


class SlotEcho:
    """Stands in for the compact forward: logits whose row r is (slot, token)."""

    def __init__(self):
        self.calls = []

    def decode(self, slots, tokens):
        self.calls.append((list(slots), list(tokens)))
        return torch.tensor([[float(s), float(t)] for s, t in zip(slots, tokens)])


def test_slot_rows_keep_each_stream_on_its_slot():
    """On the compact forward the batch steps each row on its own slot, in row order, through
    joins and removals."""
    forward = SlotEcho()
    batch = RunningBatch(SlotRows(forward), eos_ids=[0], device="cpu")
    rows = [Row(name, output_ids=[10 + i]) for i, name in enumerate("abc")]
    batch.add(rows[:2], [5, 2])
    batch.add(rows[2:], [7])
    assert batch.step().logits.tolist() == [[5, 10], [2, 11], [7, 12]]
    batch.remove([rows[0]])
    assert batch.step().logits.tolist() == [[2, 11], [7, 12]]
    assert batch.clear() == rows[1:] and batch.state.slots == []


def test_clear_hands_back_the_rows():
    """After a failed step the batch empties and returns the streams it held."""
    batch, rows = _filled()
    assert batch.clear() == rows
    assert len(batch) == 0 and batch.state.cache is None and batch.state.positions.tolist() == []
