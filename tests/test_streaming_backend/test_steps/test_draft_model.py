"""A draft model's drafts: greedy tokens of the draft's own forward, its KV cache slot kept in
step with each stream's context (cut back after a rejected draft, caught up in pieces after a
long prompt), its slot freed when the stream ends; and the refusal of another vocabulary."""

from __future__ import annotations

import pytest

from streaming_backend.forward.runner import ForwardConfig, PromptChunk, SlotForward
from streaming_backend.forward.slots import CacheBudget
from streaming_backend.steps import draft_model as draft_module
from streaming_backend.steps.draft_model import DraftModel, DraftRequest, vocabulary_difference

CONTEXT = [(37 * i) % 700 + 100 for i in range(40)]


def _draft(loaded, slots: int = 2) -> DraftModel:
    """The tiny model as its own draft model, `slots` streams at most."""
    config = ForwardConfig(budget=CacheBudget(bytes=64 * 2**20), max_slots=slots, max_len=256)
    return DraftModel(SlotForward.create(loaded, config), loaded.model.config.vocab_size)


def _greedy(loaded, context, count) -> list[int]:
    """`count` greedy tokens of the model after `context`, by plain prefill and decode."""
    forward = SlotForward.create(loaded, ForwardConfig(budget=CacheBudget(bytes=32 * 2**20)))
    slot = forward.cache.allocate()
    logits = forward.prefill([PromptChunk(slot, list(context))])
    tokens = [int(logits[0].argmax())]
    while len(tokens) < count:
        tokens.append(int(forward.decode([slot], [tokens[-1]])[0].argmax()))
    return tokens


def test_drafts_are_the_draft_models_greedy_tokens(tiny_loaded):
    """A fresh stream's draft is the draft model's greedy continuation of its context."""
    draft = _draft(tiny_loaded)
    [proposed] = draft.propose([DraftRequest("a", CONTEXT, 5)])
    assert proposed == _greedy(tiny_loaded, CONTEXT, 5)


def test_after_a_rejection_the_slot_is_cut_back_to_the_context(tiny_loaded):
    """One drafted token accepted and then another token: the next draft is what a fresh draft
    model proposes for that context (no KV of the rejected draft is left), and the slot holds
    the context but its newest token, plus the new draft's tokens but its last."""
    draft = _draft(tiny_loaded)
    [first] = draft.propose([DraftRequest("a", CONTEXT, 4)])
    context = CONTEXT + first[:1] + [first[1] + 1]  # one accepted, then another token
    [second] = draft.propose([DraftRequest("a", context, 4)])
    [fresh] = _draft(tiny_loaded).propose([DraftRequest("b", context, 4)])
    assert second == fresh
    slot = draft._slot["a"]
    assert draft.cache.lengths[slot] == len(context) + 3
    assert draft._written["a"] == context + second[:3]


def test_streams_draft_together_as_each_alone(tiny_loaded):
    """Two streams in one call, with different counts: each gets what it gets alone."""
    other = [(53 * i) % 900 + 40 for i in range(25)]
    together = _draft(tiny_loaded).propose(
        [DraftRequest("a", CONTEXT, 3), DraftRequest("b", other, 6)]
    )
    assert together == [_greedy(tiny_loaded, CONTEXT, 3), _greedy(tiny_loaded, other, 6)]


def test_a_long_context_is_caught_up_in_pieces(tiny_loaded, monkeypatch):
    """A context longer than CATCH_UP_TOKENS behind the slot is taken in over several calls,
    with no draft until it is whole; then the draft is the fresh greedy one."""
    monkeypatch.setattr(draft_module, "CATCH_UP_TOKENS", 16)
    draft = _draft(tiny_loaded)
    results = [draft.propose([DraftRequest("a", CONTEXT, 3)])[0] for _ in range(3)]
    assert results == [[], [], _greedy(tiny_loaded, CONTEXT, 3)]


def test_no_free_slot_no_draft_and_release_frees_it(tiny_loaded):
    """With every slot held a new stream drafts nothing; once a stream is released, it does."""
    draft = _draft(tiny_loaded, slots=1)
    assert draft.propose([DraftRequest("a", CONTEXT, 2)])[0]
    assert draft.propose([DraftRequest("b", CONTEXT[:30], 2)]) == [[]]
    draft.release("a")
    assert draft.streams == 0 and draft.cache.free_slots == 1
    assert draft.propose([DraftRequest("b", CONTEXT[:30], 2)])[0]
    assert draft.streams == 1


def test_no_draft_past_the_slots_context(tiny_loaded):
    """A draft that would not fit in the slot's positions is not made."""
    draft = _draft(tiny_loaded)
    long = (CONTEXT * 7)[:255]
    assert draft.propose([DraftRequest("a", long, 3)]) == [[]]
    assert draft.propose([DraftRequest("b", long[:250], 3)])[0]


class _Tok:
    """A stand-in with what vocabulary_difference reads of a tokenizer."""

    def __init__(self, vocab, specials=(1, 2), **ids):
        self.vocab = dict(vocab)
        self.all_special_ids = list(specials)
        self.bos_token_id, self.eos_token_id = ids.get("bos", 1), ids.get("eos", 2)
        self.pad_token_id = self.unk_token_id = None

    def __len__(self):
        return len(self.vocab)

    def get_vocab(self):
        return dict(self.vocab)


VOCAB = {"<s>": 1, "</s>": 2, "a": 3, "b": 4, "c": 5}


@pytest.mark.parametrize(
    "other, why",
    [
        (_Tok(VOCAB), ""),
        (_Tok(VOCAB | {"d": 6}), "6 tokens, not 5"),
        (
            _Tok(VOCAB | {"a": 4, "b": 3}),
            "2 tokens with other ids, such as 'a': 4 where the model has 3",
        ),
        (_Tok(VOCAB, eos=3), "eos_token_id 3, not 2"),
        (_Tok(VOCAB, specials=(1, 2, 5)), "other special tokens"),
    ],
)
def test_vocabulary_differences_are_named(other, why):
    """Sizes, ids and special tokens are compared; the first difference is named."""
    assert vocabulary_difference(_Tok(VOCAB), other) == why


@pytest.mark.parametrize(
    "written, context, shared",
    [
        (list(range(100)) + [7, 8], list(range(100)) + [7, 9, 10], 101),  # a rejected draft
        (list(range(100)), list(range(100)) + [5], 100),  # behind the context
        ([9] + list(range(1, 100)), list(range(100)), 0),  # a difference far back
        ([], [1, 2], 0),
    ],
)
def test_the_shared_prefix_is_found_wherever_it_ends(written, context, shared):
    """The tokens a slot still shares with its context: near the end (where drafts differ) or,
    should the slot differ further back, there."""
    assert draft_module._shared(written, context) == shared
