"""Beam search (streaming_backend.dialogue.beam, through dialogue.generation) on tiny random
models: against an exhaustive search over a small vocabulary, against Hugging Face's beam search,
and its promises."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from conftest import generate, sequence_log_prob

from streaming_backend.dialogue.beam import length_normalised
from streaming_backend.dialogue.generation import (
    GenerationRequest,
)
from streaming_backend.errors import InvalidRequest
from streaming_backend.model.loading import LoadedModel
from streaming_backend.sampling.settings import SamplingSettings

PROMPT = (1, 2, 3)


def small_vocab_model(vocab: int, eos: frozenset[int]) -> LoadedModel:
    """A random 2-layer Llama over a vocabulary of `vocab` ids (no tokenizer needed)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config).eval()
    # sharpen the logits so sequences differ clearly in probability (no near-ties)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    return LoadedModel(model, None, torch.device("cpu"), torch.float32, eos, 64, "small")


def prefix_log_probs(loaded, length: int) -> dict[tuple[int, ...], float]:
    """The model's log-probability of every sequence of 1..length tokens after PROMPT."""
    vocab = loaded.model.config.vocab_size
    full = torch.tensor(list(itertools.product(range(vocab), repeat=length)))  # [V**L, L]
    ids = torch.cat([torch.tensor(PROMPT).expand(len(full), -1), full], dim=1)
    with torch.inference_mode():
        logits = loaded.model(input_ids=ids).logits.float()  # [V**L, P + L, V]
    steps = torch.log_softmax(logits[:, len(PROMPT) - 1 : -1], dim=-1)  # [V**L, L, V]
    cum = steps.gather(-1, full[:, :, None]).squeeze(-1).cumsum(-1)  # [V**L, L]
    found = {}
    for row, seq in enumerate(full.tolist()):
        for n in range(1, length + 1):
            found[tuple(seq[:n])] = float(cum[row, n - 1])
    return found


def exhaustive_top(loaded, length, width, eos, penalty):
    """The `width` best sequences that end with an end id or have `length` tokens."""
    scored = []
    for seq, cum in prefix_log_probs(loaded, length).items():
        if any(t in eos for t in seq[:-1]) or (len(seq) < length and seq[-1] not in eos):
            continue  # the search cannot return it: it ran past an end id, or stopped early
        scored.append((length_normalised(cum, len(seq), penalty), seq, cum))
    scored.sort(reverse=True)
    return scored[:width]


def beams(batch_forward, loaded, **kw):
    request = GenerationRequest(PROMPT, **kw)
    (result,) = generate(loaded, batch_forward, [request], 64)
    return result.beams


@pytest.mark.parametrize(
    "eos, penalty", [(frozenset(), 1.0), (frozenset({0}), 1.0), (frozenset({0}), 0.5)]
)
def test_wide_beam_finds_the_exhaustive_best(batch_forward, eos, penalty):
    """With W = V ** (L - 1) beams every prefix survives: the W best sequences of all are found."""
    vocab, length = 5, 3
    width = vocab ** (length - 1)
    loaded = small_vocab_model(vocab, eos)
    found = beams(
        batch_forward, loaded, max_new_tokens=length, beam_width=width, length_penalty=penalty
    )
    expected = exhaustive_top(loaded, length, width, eos, penalty)
    assert [b.tokens for b in found] == [seq for _, seq, _ in expected]
    for beam, (score, _, cum) in zip(found, expected):
        assert beam.cum_log_prob == pytest.approx(cum, abs=1e-4)
        assert beam.score == pytest.approx(score, abs=1e-4)


def test_narrow_beam_beats_or_equals_greedy(batch_forward):
    """A beam of 3 never returns a best sequence worse than greedy's."""
    loaded = small_vocab_model(7, frozenset({0}))
    greedy = beams(batch_forward, loaded, max_new_tokens=4, beam_width=1)[0]
    best = beams(batch_forward, loaded, max_new_tokens=4, beam_width=3)[0]
    assert best.score >= greedy.score - 1e-6


def hf_beam_search(loaded, prompt, width, new_tokens, eos_id, penalty):
    out = loaded.model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        num_beams=width,
        num_return_sequences=width,
        max_new_tokens=new_tokens,
        do_sample=False,
        early_stopping=False,
        length_penalty=penalty,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        return_dict_in_generate=True,
        output_scores=True,
    )
    sequences = []
    for row in out.sequences[:, len(prompt) :].tolist():
        seq = []
        for token in row:
            seq.append(token)
            if token == eos_id:
                break
        sequences.append(tuple(seq))
    return sequences, out.sequences_scores.tolist()


def mid_beam_token(batch_forward, loaded, prompt) -> int:
    """A token the best beam picks half-way, so that as the end id it ends beams early."""
    request = GenerationRequest(tuple(prompt), max_new_tokens=10, beam_width=4)
    (result,) = generate(loaded, batch_forward, [request], 4)
    return result.beams[0].tokens[5]


@pytest.mark.parametrize("penalty", [1.0, 0.0, 2.0])
def test_matches_hugging_face_beam_search(batch_forward, tiny_loaded, penalty):
    """Same model, same settings: the same beams in the same order with the same scores."""
    prompt = [1, 504, 2300, 28, 1017, 30]
    eos = mid_beam_token(batch_forward, tiny_loaded, prompt)
    expected, scores = hf_beam_search(tiny_loaded, prompt, 4, 10, eos, penalty)
    request = GenerationRequest(
        tuple(prompt), 10, beam_width=4, end_ids=frozenset({eos}), length_penalty=penalty
    )
    (result,) = generate(tiny_loaded, batch_forward, [request], 8)
    assert [b.tokens for b in result.beams] == expected
    if penalty == 0.0:  # no length normalisation: the short beams ended by the end id win
        assert result.beams[0].tokens[-1] == eos and len(result.beams[0].tokens) < 10
    assert [b.score for b in result.beams] == pytest.approx(scores, abs=1e-4)


def test_width_one_is_greedy(batch_forward, tiny_loaded):
    """beam_width=1 picks the most likely token at each step, as HF greedy generate does."""
    prompt = [1, 9690, 198, 2683, 359]
    out = tiny_loaded.model.generate(
        torch.tensor([prompt]), max_new_tokens=12, do_sample=False, num_beams=1, eos_token_id=None
    )
    expected = tuple(out[0, len(prompt) :].tolist())
    request = GenerationRequest(tuple(prompt), 12, beam_width=1, end_ids=frozenset({-1 % 7}))
    (result,) = generate(tiny_loaded, batch_forward, [request], 1)
    assert result.beams[0].tokens == expected


def test_four_beams_are_distinct_best_first_and_scored_by_the_model(batch_forward, tiny_loaded):
    """beam_width=4: 4 distinct beams, scores non-increasing, each the model's log-probability."""
    prompt = (1, 4093, 314, 253, 2365)
    penalty = 0.7
    request = GenerationRequest(prompt, 8, beam_width=4, length_penalty=penalty)
    (result,) = generate(tiny_loaded, batch_forward, [request], 4)
    assert len(result.beams) == 4
    assert len({b.tokens for b in result.beams}) == 4
    scores = [b.score for b in result.beams]
    assert scores == sorted(scores, reverse=True)
    for beam in result.beams:
        cum = sequence_log_prob(tiny_loaded, prompt, beam.tokens)
        assert beam.cum_log_prob == pytest.approx(cum, abs=1e-3)
        assert beam.score == pytest.approx(cum / len(beam.tokens) ** penalty, abs=1e-3)


def test_beam_width_above_the_maximum_is_refused(batch_forward, tiny_loaded):
    """A clear per-request error; the request beside it in the batch succeeds."""
    bad = GenerationRequest((1, 2), 4, beam_width=5)
    good = GenerationRequest((1, 2), 4, beam_width=2)
    refused, served = generate(tiny_loaded, batch_forward, [bad, good], 4)
    assert isinstance(refused, InvalidRequest)
    assert "beam_width must be in [1, 4], got 5" in str(refused)
    assert len(served.beams) == 2


def test_sampling_settings_do_not_change_beam_search(batch_forward, tiny_loaded):
    """Beam search is deterministic: temperature / top_p / seed are ignored when beam_width > 1."""
    plain = GenerationRequest((5, 6, 7), 6, beam_width=3)
    sampled = GenerationRequest(
        (5, 6, 7), 6, beam_width=3, settings=SamplingSettings(temperature=1.5, top_p=0.5, seed=3)
    )
    a, b = generate(tiny_loaded, batch_forward, [plain, sampled], 4)
    assert [x.tokens for x in a.beams] == [x.tokens for x in b.beams]
    assert all(math.isfinite(x.cum_log_prob) for x in a.beams)
