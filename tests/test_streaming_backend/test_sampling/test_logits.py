"""Tests for streaming_backend/sampling/logits.py: one batch's logits pipeline, the same for
every caller."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from streaming_backend.kernels import greedy
from streaming_backend.sampling import sampling
from streaming_backend.sampling.logits import NextTokenChooser
from streaming_backend.sampling.settings import SamplingSettings

EOS = 0
V = 6


@dataclass(eq=False)
class Row:
    settings: SamplingSettings = field(default_factory=SamplingSettings)
    prompt_ids: list[int] = field(default_factory=lambda: [3])
    output_ids: list[int] = field(default_factory=list)
    generator: torch.Generator = field(default_factory=lambda: sampling.new_generator(7))
    grammar: None = None


def choose(rows, logits, **kwargs):
    return NextTokenChooser.for_rows(rows, [EOS]).choose(logits, rows, **kwargs)


def test_greedy_rows_take_the_argmax_and_logprobs_are_the_log_softmax():
    """Without processors the logprobs are the model's log-softmax, with the top alternatives
    most likely first; temperature does not change them."""
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0, 0.0, 0.0], [5.0, 1.0, 0.0, 0.0, 0.0, 9.0]])
    rows = [Row(SamplingSettings(temperature=0)), Row(SamplingSettings(temperature=0.3))]
    choice = choose(rows, logits.clone(), logprobs=True, top_logprobs=2)
    assert choice.ids[0] == 2 and choice.finite == [True, True]
    table = torch.log_softmax(logits, -1)
    (first, top), (second, _) = choice.logprobs
    assert first == pytest.approx(table[0, 2].item())
    assert second == pytest.approx(table[1, choice.ids[1]].item())
    assert [i for i, _ in top] == [2, 3]
    assert [v for _, v in top] == pytest.approx(table[0, [2, 3]].tolist())
    assert choose(rows, logits.clone()).logprobs is None


def test_logprobs_follow_the_processors():
    """A penalised row's logprobs are of the penalised distribution, the one it is drawn from."""
    logits = torch.tensor([[0.0, 0.0, 0.0, 2.0, 1.9, 0.0]])
    row = Row(SamplingSettings(temperature=0, repetition_penalty=2.0), prompt_ids=[3])
    ((picked, _),) = choose([row], logits.clone(), logprobs=True).logprobs
    processed = logits.clone()
    processed[0, 3] = 1.0
    assert picked == pytest.approx(torch.log_softmax(processed, -1)[0, 4].item())


def test_eos_is_banned_until_min_tokens():
    """A row short of min_tokens cannot draw EOS; once it has them it can."""
    logits = torch.tensor([[9.0, 1.0, 0.0, 0.0, 0.0, 0.0]])
    short = Row(SamplingSettings(temperature=0, min_tokens=2), output_ids=[4])
    assert choose([short], logits.clone()).ids == [1]
    enough = Row(SamplingSettings(temperature=0, min_tokens=2), output_ids=[4, 4])
    assert choose([enough], logits.clone()).ids == [EOS]


def test_repetition_penalty_counts_prompt_and_output():
    """A seen token (prompt or output) is penalised; an unseen one is not; other rows are not."""
    logits = torch.tensor([[0.0, 0.0, 0.0, 2.0, 1.9, 0.0]] * 2)
    penalised = Row(SamplingSettings(temperature=0, repetition_penalty=2.0), prompt_ids=[3])
    plain = Row(SamplingSettings(temperature=0), prompt_ids=[3])
    assert choose([penalised, plain], logits).ids == [4, 3]


def test_min_p_drops_tokens_below_its_share_of_the_likeliest_after_temperature():
    """min_p 0.5 over probabilities 0.5, 0.3, 0.2: at temperature 1 the 0.2 token (below 0.25)
    is never drawn, the others are; at temperature 2 its share is sqrt(0.4) = 0.63 and it stays;
    a row without min_p beside it is untouched."""
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0, 0.0])
    logits = probs.clamp(min=1e-9).log()[None].repeat(2, 1)

    def drawn(temperature, min_p):
        settings = SamplingSettings(temperature=temperature, min_p=min_p)
        rows = [Row(settings, generator=sampling.new_generator(seed)) for seed in range(300)]
        chooser = NextTokenChooser.for_rows(rows, [EOS])
        return set(chooser.choose(logits[:1].repeat(300, 1), rows).ids)

    assert drawn(1.0, 0.5) == {0, 1}
    assert drawn(1.0, 0.0) == drawn(2.0, 0.5) == {0, 1, 2}
    cut, plain = Row(SamplingSettings(temperature=1.0, min_p=0.5)), Row(SamplingSettings(1.0))
    processed, _ = NextTokenChooser.for_rows([cut, plain], [EOS]).process(
        logits.clone(), [cut, plain]
    )
    assert processed[0, 2] == float("-inf") and processed[0, :2].isfinite().all()
    assert torch.equal(processed[1], logits[1])


def test_a_non_finite_row_is_reported_and_the_others_are_unharmed():
    """NaN in one row: that row is flagged, the other is chosen as alone."""
    logits = torch.tensor([[float("nan")] * V, [0.0, 0.0, 5.0, 0.0, 0.0, 0.0]])
    choice = choose([Row(SamplingSettings(temperature=0)), Row(SamplingSettings(0))], logits)
    assert choice.finite == [False, True] and choice.ids[1] == 2
    for bad in (float("inf"), float("-inf"), float("nan")):  # one value among finite ones
        logits = torch.zeros(2, V)
        logits[0, 3] = bad
        choice = choose([Row(SamplingSettings(temperature=0)), Row(SamplingSettings(0))], logits)
        assert choice.finite == [False, True], bad


@pytest.mark.parametrize("kernels", ["ours", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plainly_greedy_rows_get_what_the_whole_pipeline_gives(dtype, kernels, monkeypatch):
    """Greedy rows with nothing to process but an EOS ban take a shorter way (`_greedy`, the
    pipeline not run; float32 on our C kernels where they build, else numpy's argmax): the same
    ids and flags as the pipeline (which logprobs take) gives, ties to the first largest, and
    for a row that would take a banned EOS its next best, tied or not. A row that is not finite
    is the pipeline's."""
    if kernels == "none":
        monkeypatch.setattr(greedy, "greedy_kernel", lambda: None)
    torch.manual_seed(3)
    logits = torch.randn(4, 49152).to(dtype)
    logits[1, [7, 9000, 40000]] = 50.0  # a three-way tie
    logits[2, EOS] = 60.0  # EOS on top, allowed: that row is past min_tokens
    rows = [Row(SamplingSettings(temperature=0, min_tokens=m)) for m in (0, 0, 1, 5)]
    rows[2].output_ids = [4]
    whole = NextTokenChooser.for_rows(rows, [EOS]).choose(logits.clone(), rows, logprobs=True)
    chooser = NextTokenChooser.for_rows(rows, [EOS])
    pipeline = chooser.process
    monkeypatch.setattr(chooser, "process", lambda *a: pytest.fail("the pipeline ran"))
    short = chooser.choose(logits.clone(), rows)
    assert short.ids == whole.ids and short.finite == whole.finite == [True] * 4
    assert short.ids[1] == 7 and short.ids[2] == EOS
    monkeypatch.setattr(chooser, "process", pipeline)
    banned = logits.clone()
    banned[3, EOS] = 70.0  # row 3 is short of min_tokens: EOS banned, its next best
    banned[0, EOS] = 70.0  # row 0 has no min_tokens: EOS allowed
    banned[1, EOS] = 70.0  # row 1 short of min_tokens too: the first of its tie below
    rows[1].settings = SamplingSettings(temperature=0, min_tokens=3)
    chooser, eos_banned = (
        NextTokenChooser.for_rows(rows, [EOS]),
        NextTokenChooser.for_rows(rows, [EOS]),
    )
    monkeypatch.setattr(chooser, "process", lambda *a: pytest.fail("the pipeline ran"))
    expected = eos_banned.choose(banned.clone(), rows, logprobs=True)
    assert chooser.choose(banned.clone(), rows).ids == expected.ids
    assert expected.ids[0] == EOS and expected.ids[1] == 7 and expected.ids[2] == EOS
    assert expected.ids[3] == int(logits[3].float().argmax())
    chooser = NextTokenChooser.for_rows(rows, [EOS])
    for bad in (float("nan"), float("inf"), float("-inf")):
        broken = logits.clone()
        broken[2, 123] = bad
        expected = NextTokenChooser.for_rows(rows, [EOS]).choose(broken.clone(), rows, True)
        choice = chooser.choose(broken.clone(), rows)
        assert choice.ids == expected.ids and choice.finite == [True, True, False, True]


def test_greedy_rows_with_something_to_process_take_the_whole_pipeline():
    """A penalty, or a sampled row beside: no shorter way."""
    logits = torch.tensor([[0.0, 0.0, 0.0, 2.0, 1.9, 0.0]])
    row = Row(SamplingSettings(temperature=0, repetition_penalty=2.0), prompt_ids=[3])
    assert choose([row], logits.clone()).ids == [4]  # 3 was seen: 2.0 / 2 < 1.9
    banned = Row(SamplingSettings(temperature=0, min_tokens=1))
    assert choose([banned], torch.tensor([[9.0, 0.0, 0.0, 1.0, 0.0, 0.0]])).ids == [3]
    rows = [Row(SamplingSettings(temperature=0)), Row(SamplingSettings(seed=1))]
    assert not NextTokenChooser.for_rows(rows, [EOS])._plain_greedy(rows)


def test_a_rows_draw_does_not_depend_on_its_neighbours():
    """Each row draws one uniform from its own generator: a seeded row picks the same token
    alone and beside any other rows."""
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    alone = choose([Row(SamplingSettings(seed=1))], logits[1:2].clone()).ids
    rows = [Row(SamplingSettings(temperature=0.5)), Row(), Row(SamplingSettings(top_k=2))]
    rows[0].generator = sampling.new_generator(5)
    assert choose(rows, logits.clone()).ids[1] == alone[0]


def test_a_chooser_refuses_rows_it_was_not_built_for():
    """Rows and chooser out of step is a bug, caught at once."""
    chooser = NextTokenChooser.for_rows([Row()], [EOS])
    with pytest.raises(ValueError, match="chooser of 1 rows was given 2"):
        chooser.process(torch.zeros(2, V), [Row(), Row()])
