"""Cache rows merged, selected and reordered give each stream the logits of an unbatched pass."""

import inspect

import pytest
import torch

from streaming_backend.model import kvcache


class Batch:
    """Left-padded rows on the tiny model, stepped greedily; each row's tokens kept for checks."""

    def __init__(self, model, prompts: list[list[int]]):
        self.model = model
        params = inspect.signature(model.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"
        length = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), length), dtype=torch.long)
        mask = torch.zeros((len(prompts), length), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, length - len(prompt) :] = torch.tensor(prompt)
            mask[row, length - len(prompt) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [N, L]
        cache = kvcache.DynamicCache()
        out = self._forward(ids, mask, positions, cache)
        self.cache = kvcache.BatchCache(cache, mask)
        self.seqs = [list(p) for p in prompts]
        self.logits = out.logits[:, -1].float()  # [N, V] the latest step's

    def _forward(self, ids, mask, positions, cache):
        with torch.inference_mode():
            return self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                **{self.cache_kwarg: cache},
            )

    def step(self) -> None:
        """Append each row's argmax token and run one decode step for all rows."""
        tokens = self.logits.argmax(-1)  # [B]
        for seq, token in zip(self.seqs, tokens.tolist()):
            seq.append(token)
        mask = self.cache.mask
        mask = torch.cat([mask, mask.new_ones((len(self.seqs), 1))], dim=1)
        positions = torch.tensor([len(s) - 1 for s in self.seqs])[:, None]  # [B, 1]
        out = self._forward(tokens[:, None], mask, positions, self.cache.cache)
        self.cache.mask = mask
        self.logits = out.logits[:, -1].float()

    def join(self, other: "Batch") -> None:
        """Append another batch's rows (kvcache.merge)."""
        self.cache = kvcache.merge(self.cache, other.cache)
        self.seqs += other.seqs
        self.logits = torch.cat([self.logits, other.logits])

    def keep(self, rows: list[int]) -> None:
        """Keep these rows in this order (kvcache.select)."""
        self.cache = kvcache.select(self.cache, rows)
        self.seqs = [self.seqs[r] for r in rows]
        self.logits = self.logits[rows]

    def check(self) -> None:
        """Each row's latest logits equal an unbatched, uncached pass over its tokens."""
        assert self.cache.rows == len(self.seqs)
        for row, seq in enumerate(self.seqs):
            with torch.inference_mode():
                alone = self.model(input_ids=torch.tensor([seq])).logits[0, -1].float()
            assert torch.allclose(self.logits[row], alone, atol=1e-4, rtol=1e-4), row
            assert int(self.cache.mask[row].sum()) == len(seq)  # its tokens, no more


@pytest.fixture
def model(tiny_loaded):
    return tiny_loaded.model


def _prompt(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


def test_a_shorter_newcomer_joins_a_running_batch(model):
    """A 3-token prompt joins two rows already 20+ tokens long: it is left-padded."""
    running = Batch(model, [_prompt(20, 100), _prompt(14, 300)])
    for _ in range(3):
        running.step()
    running.join(Batch(model, [_prompt(3, 500)]))
    assert running.cache.mask.shape == (3, 23)
    running.check()
    for _ in range(2):
        running.step()
        running.check()


def test_a_longer_newcomer_pads_the_running_rows(model):
    """A 30-token prompt joins a 5-token row: the running row is padded on the left."""
    running = Batch(model, [_prompt(5, 100)])
    running.step()
    running.join(Batch(model, [_prompt(30, 700)]))
    assert running.cache.mask.shape == (2, 30)
    running.check()
    running.step()
    running.check()


def test_several_groups_join_one_after_another(model):
    """Groups of different lengths and sizes merge into one batch that stays exact."""
    running = Batch(model, [_prompt(5, 100)])
    running.step()
    running.join(Batch(model, [_prompt(30, 200)]))
    running.join(Batch(model, [_prompt(2, 900), _prompt(9, 1000)]))
    running.step()
    running.join(Batch(model, [_prompt(12, 1200)]))
    running.check()
    for _ in range(2):
        running.step()
        running.check()


def test_selected_rows_reordered_and_trimmed(model):
    """Dropping the longest row trims the columns left all padding; rows may change order."""
    running = Batch(model, [_prompt(4, 100), _prompt(25, 200), _prompt(7, 400)])
    running.step()
    running.keep([2, 0])
    assert running.cache.mask.shape == (2, 8)  # the longest remaining row: 7 + 1 tokens
    running.check()
    for _ in range(2):
        running.step()
        running.check()
    running.join(Batch(model, [_prompt(6, 600)]))
    running.keep([1, 2, 0])
    running.step()
    running.check()


def test_merge_into_nothing_and_select_nothing(model):
    """Merging into no batch gives the newcomer; keeping no row gives no batch."""
    newcomer = Batch(model, [_prompt(3, 100)]).cache
    assert kvcache.merge(None, newcomer) is newcomer
    assert kvcache.select(newcomer, []) is None
