"""Sampling functions on the CPU: greedy, top-k, top-p, temperature, per-row generators."""

import pytest
import torch

from streaming_backend.sampling import sampling
from streaming_backend.sampling.sampling import BatchSampling
from streaming_backend.sampling.settings import SamplingSettings

VOCAB = 5000


def _logits(rows: int, scale: float = 3.0, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


def _sample(logits, settings, uniforms=None):
    rows = logits.shape[0]
    params = BatchSampling.from_settings(
        settings if isinstance(settings, list) else [settings] * rows
    )
    uniforms = torch.rand(rows) if uniforms is None else uniforms
    return sampling.sample(logits, params, uniforms)


def test_greedy_is_argmax():
    """Temperature 0 picks the argmax whatever the other settings say."""
    logits = _logits(8)
    ids = _sample(logits, SamplingSettings(temperature=0, top_p=0.5, top_k=3))
    assert torch.equal(ids, logits.argmax(-1))


def test_greedy_takes_the_first_of_tied_tokens():
    """A tie goes to the lowest id, as argmax gives it, wherever the tied values lie."""
    logits = torch.zeros(3, 64)
    logits[0, [5, 40]] = 2.0
    logits[1, [63, 0]] = 1.0
    logits[2, :] = -3.0
    ids = _sample(logits, SamplingSettings(temperature=0))
    assert ids.tolist() == [5, 0, 0]


def test_tiny_top_p_keeps_exactly_the_top_token():
    """top_p close to 0 still keeps one token: the most likely."""
    logits = _logits(8)
    for _ in range(5):
        assert torch.equal(_sample(logits, SamplingSettings(top_p=1e-6)), logits.argmax(-1))


def test_top_k_one_is_greedy():
    """top_k=1 leaves only the argmax."""
    logits = _logits(8)
    assert torch.equal(_sample(logits, SamplingSettings(top_k=1)), logits.argmax(-1))


def test_top_k_draws_only_among_the_k_best():
    """Every draw with top_k=5 is one of the 5 largest logits of its row."""
    logits = _logits(4, scale=0.1)  # flat: without the cut, draws would spread everywhere
    allowed = logits.topk(5, dim=-1).indices
    for _ in range(50):
        ids = _sample(logits, SamplingSettings(top_k=5))
        assert (allowed == ids[:, None]).any(-1).all()


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    """With probs 0.5/0.3/0.2, top_p=0.7 allows the first two tokens only."""
    probs = torch.tensor([[0.5, 0.3, 0.2]])
    logits = probs.log()
    uniforms = torch.linspace(0, 0.999, 200)
    ids = {int(_sample(logits, SamplingSettings(top_p=0.7), u[None])) for u in uniforms}
    assert ids == {0, 1}


def _tier(probs: torch.Tensor, top_k: int, top_p: float) -> int:
    """The fewest candidates (64, 1024 or the vocabulary) that hold a row's kept set."""
    for k in sampling.CANDIDATES:
        if 0 < top_k <= k or (top_p < 1.0 and probs.topk(k).values.sum() >= top_p):
            return k
    return probs.shape[-1]


def test_candidate_path_matches_full_sort():
    """Every candidate tier (64, 1,024, the full sort) picks the ids a full sort picks, for
    rows of all tiers mixed in one batch."""
    peaked, flat = _logits(4, scale=8.0), _logits(8, scale=0.05, seed=1)
    logits = torch.cat([peaked[:2], flat[:4], peaked[2:], flat[4:]])
    settings = [SamplingSettings(top_p=0.9)] * 2  # peaked: a few dozen tokens hold 0.9
    settings += [SamplingSettings(top_k=500)] * 2  # flat: 500 of 1,024
    settings += [SamplingSettings(top_p=0.15)] * 2  # flat: ~700 tokens hold 0.15
    settings += [SamplingSettings(top_k=40, top_p=0.95)] * 2
    settings += [SamplingSettings(top_p=0.5, top_k=2000)] * 2  # flat: past 1,024
    settings += [SamplingSettings(top_p=0.6)] * 2
    probs = torch.softmax(logits, -1)
    tiers = [_tier(p, s.top_k, s.top_p) for p, s in zip(probs, settings)]
    assert tiers == [64, 64, 1024, 1024, 1024, 1024, 64, 64, VOCAB, VOCAB, VOCAB, VOCAB]
    params = BatchSampling.from_settings(settings)
    sorted_probs, order = probs.sort(-1, descending=True)
    for seed in range(5):
        uniforms = torch.rand(12, generator=torch.Generator().manual_seed(seed))
        fast = sampling.sample(logits, params, uniforms)
        full = sampling._draw_truncated(sorted_probs, order, params.top_k, params.top_p, uniforms)
        assert torch.equal(fast, full), seed


def test_sync_free_sampling_picks_what_the_cpu_path_picks():
    """The GPU's way (whole-row sorts, no row selection by value) gives the same ids as the
    CPU's candidate tiers, for greedy, plain, top-k, top-p and mixed rows in one batch."""
    peaked, flat = _logits(6, scale=8.0), _logits(6, scale=0.05, seed=1)
    logits = torch.cat([peaked, flat])
    kinds = [
        SamplingSettings(temperature=0),
        SamplingSettings(temperature=0.8),  # plain: no truncation
        SamplingSettings(top_p=0.9),
        SamplingSettings(top_k=40),
        SamplingSettings(top_k=40, top_p=0.95, temperature=1.3),
        SamplingSettings(top_p=0.5, top_k=2000),
    ]
    params = BatchSampling.from_settings(kinds * 2)
    for seed in range(10):
        uniforms = torch.rand(12, generator=torch.Generator().manual_seed(seed))
        on_cpu = sampling.sample(logits, params, uniforms, sync_free=False)
        without_syncs = sampling.sample(logits, params, uniforms, sync_free=True)
        assert torch.equal(on_cpu, without_syncs), seed


def test_temperature_scales_the_distribution():
    """Draw frequencies follow softmax(logits / T): sharper for low T, flatter for high T."""
    logits = torch.tensor([[2.0, 1.0, 0.0]]).repeat(4000, 1)
    for temperature in (0.5, 2.0):
        uniforms = torch.rand(len(logits), generator=torch.Generator().manual_seed(1))
        ids = _sample(logits, SamplingSettings(temperature=temperature), uniforms)
        freq = torch.bincount(ids, minlength=3).float() / len(ids)
        expected = torch.softmax(logits[0] / temperature, -1)
        assert torch.allclose(freq, expected, atol=0.03), (temperature, freq, expected)


def test_per_row_settings_apply_to_their_row_only():
    """A greedy row stays greedy beside sampled rows in the same batch."""
    logits = _logits(4, scale=0.1)
    settings = [
        SamplingSettings(temperature=0),
        SamplingSettings(),
        SamplingSettings(temperature=0),
        SamplingSettings(top_k=1),
    ]
    for _ in range(10):
        ids = _sample(logits, settings)
        assert ids[0] == logits[0].argmax() and ids[2] == logits[2].argmax()
        assert ids[3] == logits[3].argmax()


def test_seeded_generators_reproduce_and_ignore_batch_neighbours():
    """A row's draws depend on its own seed only, not on the other rows of the batch."""
    logits = _logits(1, scale=0.5)
    alone = []
    gen = sampling.new_generator(42)
    for _ in range(20):
        alone.append(int(_sample(logits, SamplingSettings(), sampling.draw_uniforms([gen]))))
    batch_logits = torch.cat([_logits(2, scale=0.5, seed=9), logits])
    gens = [sampling.new_generator(1), sampling.new_generator(2), sampling.new_generator(42)]
    mixed = []
    for _ in range(20):
        mixed.append(
            int(_sample(batch_logits, SamplingSettings(), sampling.draw_uniforms(gens))[2])
        )
    assert alone == mixed
    assert len(set(alone)) > 1  # really sampled, not greedy


def test_unseeded_generators_differ():
    """Without a seed each request gets fresh entropy."""
    a, b = sampling.new_generator(None), sampling.new_generator(None)
    assert not torch.equal(torch.rand(8, generator=a), torch.rand(8, generator=b))


def test_repetition_penalty_lowers_seen_tokens():
    """Seen tokens: positive logits divided, negative multiplied by the penalty."""
    logits = torch.tensor([[2.0, -1.0, 3.0]])
    out = sampling.apply_repetition_penalty(logits.clone(), [(0, 2.0, [0, 1])])
    assert out.tolist() == [[1.0, -2.0, 3.0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_repetition_penalty_of_many_rows_equals_row_by_row(dtype):
    """Rows with their own penalties and repeated ids, penalised in one scatter, get what
    penalising each row's distinct ids on its own gives; other rows are untouched."""
    logits = _logits(4).to(dtype)
    generator = torch.Generator().manual_seed(3)
    rows = [
        (0, 1.3, torch.randint(0, VOCAB, (300,), generator=generator).tolist()),
        (2, 0.7, [5, 5, 9, 5, 17]),
        (3, 2.0, list(range(40)) * 3),
    ]
    expected = logits.clone()
    for row, penalty, seen in rows:
        ids = torch.tensor(sorted(set(seen)))
        scores = expected[row, ids]
        expected[row, ids] = torch.where(scores > 0, scores / penalty, scores * penalty)
    out = sampling.apply_repetition_penalty(logits.clone(), rows)
    assert torch.equal(out, expected)
    assert torch.equal(out[1], logits[1])


def test_suppressed_tokens_are_never_drawn():
    """EOS suppression (min_tokens) removes the token even when it is the argmax."""
    logits = torch.tensor([[10.0, 0.0, 0.0]])
    out = sampling.suppress_tokens(logits.clone(), [0], [0])
    assert int(_sample(out, SamplingSettings(temperature=0))) != 0


@pytest.mark.parametrize("uniform", [0.0, 0.25, 0.5, 0.999999])
def test_draw_never_picks_a_zero_probability_token(uniform):
    """The inverse-CDF draw lands on a token with positive probability for any uniform."""
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]])
    assert int(sampling.draw(probs, torch.tensor([uniform]))) in (1, 3)


@pytest.mark.parametrize("sync_free", [False, True])
@pytest.mark.parametrize(
    "kinds",
    [
        [SamplingSettings(temperature=1.0)],  # plain, unit temperature
        [SamplingSettings(temperature=1.0, top_p=0.9)],
        [SamplingSettings(temperature=0.7), SamplingSettings(temperature=1.0, top_k=40)],
        [SamplingSettings(temperature=0), SamplingSettings(temperature=1.0)],  # one row greedy
    ],
)
def test_the_shortcuts_pick_what_the_general_path_picks(kinds, sync_free):
    """With no greedy row `sample` skips the greedy ids, and with every temperature 1.0 the
    division: both give the ids of the general path (the flags forced off), bit for bit."""
    from dataclasses import replace

    logits = torch.cat([_logits(6, scale=8.0), _logits(6, scale=0.05, seed=1)])
    params = BatchSampling.from_settings(kinds * (12 // len(kinds)))
    general = replace(params, any_greedy=True, all_unit_temperature=False)
    for seed in range(10):
        uniforms = torch.rand(12, generator=torch.Generator().manual_seed(seed))
        fast = sampling.sample(logits, params, uniforms, sync_free=sync_free)
        assert torch.equal(fast, sampling.sample(logits, general, uniforms, sync_free=sync_free))


def test_the_batch_knows_which_shortcuts_apply():
    """any_greedy and all_unit_temperature from the rows' settings: a greedy row's temperature
    does not count."""
    one = BatchSampling.from_settings([SamplingSettings(temperature=1.0)] * 2)
    assert (one.any_greedy, one.all_unit_temperature) == (False, True)
    mixed = BatchSampling.from_settings([SamplingSettings(temperature=0), SamplingSettings()])
    default_is_one = SamplingSettings().temperature == 1.0
    assert mixed.any_greedy and mixed.all_unit_temperature == default_is_one
    warm = BatchSampling.from_settings([SamplingSettings(temperature=0.7)])
    assert (warm.any_greedy, warm.all_unit_temperature) == (False, False)
