"""The running batch keeps rows, cache rows, positions and sampling parameters aligned."""

from dataclasses import dataclass, field

import pytest
import torch

from streaming_backend import kvcache
from streaming_backend.batch import RunningBatch
from streaming_backend.settings import SamplingSettings


@dataclass(eq=False)
class Row:
    name: str
    settings: SamplingSettings = field(default_factory=SamplingSettings)
    output_ids: list[int] = field(default_factory=list)


def _cache(values: list[float], lengths: list[int]) -> kvcache.BatchCache:
    """A 2-layer cache whose row r holds values[r] everywhere, left-padded to the longest."""
    length = max(lengths)
    keys = torch.stack([torch.full((2, length, 4), v) for v in values])  # [B, heads, L, dim]
    mask = torch.zeros((len(values), length), dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, length - n :] = 1
    return kvcache.BatchCache(kvcache._build([(keys, keys.clone())] * 2), mask)


def _row_values(batch: RunningBatch) -> list[float]:
    keys = batch.cache.cache.layers[0].keys  # [B, heads, L, dim]
    return keys[:, 0, -1, 0].tolist()


def _filled() -> tuple[RunningBatch, list[Row]]:
    rows = [Row("a", SamplingSettings(temperature=0)), Row("b"), Row("c", SamplingSettings(0.5))]
    for i, row in enumerate(rows):
        row.output_ids.append(10 + i)
    batch = RunningBatch()
    batch.add(rows[:2], _cache([1.0, 2.0], [3, 5]), torch.tensor([3, 5]))
    batch.add(rows[2:], _cache([3.0], [2]), torch.tensor([2]))
    return batch, rows


def test_add_appends_rows_cache_and_positions_together():
    """Rows added after a prefill line up with their cache rows and positions."""
    batch, rows = _filled()
    assert batch.rows == rows and len(batch) == 3
    assert batch.positions.tolist() == [3, 5, 2]
    assert _row_values(batch) == [1.0, 2.0, 3.0]
    assert batch.cache.mask.sum(-1).tolist() == [3, 5, 2]


def test_add_refuses_mismatched_sizes():
    """Two rows with one cache row is a bug, caught at once."""
    with pytest.raises(ValueError, match="differ"):
        RunningBatch().add([Row("a"), Row("b")], _cache([1.0], [2]), torch.tensor([2, 2]))


def test_remove_keeps_the_others_aligned():
    """Removing a middle row keeps the rest in order with their cache rows and positions."""
    batch, rows = _filled()
    batch.remove([rows[1]])
    assert batch.rows == [rows[0], rows[2]]
    assert batch.positions.tolist() == [3, 2]
    assert _row_values(batch) == [1.0, 3.0]
    assert batch.cache.mask.shape == (2, 3)  # the 5-token row's extra columns are gone


def test_remove_compares_by_identity():
    """A different row that looks the same is not removed; removing all empties the cache."""
    batch, rows = _filled()
    batch.remove([Row("a", SamplingSettings(temperature=0), [10])])
    assert len(batch) == 3
    batch.remove(rows)
    assert len(batch) == 0 and batch.cache is None and batch.positions.tolist() == []


def test_sampling_parameters_follow_the_rows():
    """The parameters are built once per batch and rebuilt after rows come or go."""
    batch, rows = _filled()
    params = batch.sampling_params("cpu")
    assert batch.sampling_params("cpu") is params
    assert params.greedy.tolist() == [True, False, False]
    assert params.temperature.tolist() == [1.0, 1.0, 0.5]
    batch.remove([rows[0]])
    assert batch.sampling_params("cpu").greedy.tolist() == [False, False]
    batch.add([rows[0]], _cache([9.0], [1]), torch.tensor([1]))
    assert batch.sampling_params("cpu").greedy.tolist() == [False, False, True]


def test_decode_inputs_then_advance():
    """Inputs: each row's last token at its next position and a mask one column wider;
    advance records the step (the inputs alone change nothing)."""
    batch, rows = _filled()
    inputs = batch.decode_inputs("cpu")
    assert inputs.input_ids.tolist() == [[10], [11], [12]]
    assert inputs.position_ids.tolist() == [[3], [5], [2]]
    assert (
        inputs.attention_mask.shape == (3, 6) and inputs.attention_mask[:, -1].tolist() == [1] * 3
    )
    assert batch.cache.mask.shape == (3, 5) and batch.positions.tolist() == [3, 5, 2]
    batch.advance(inputs)
    assert batch.cache.mask is inputs.attention_mask
    assert batch.positions.tolist() == [4, 6, 3]


def test_clear_hands_back_the_rows():
    """After a failed step the batch empties and returns the streams it held."""
    batch, rows = _filled()
    assert batch.clear() == rows
    assert len(batch) == 0 and batch.cache is None and batch.positions.tolist() == []
