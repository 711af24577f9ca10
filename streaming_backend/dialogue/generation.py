"""Batched, non-streaming generation: several requests (token ids in, token ids out) run together,
one forward pass per step for every row of every request.

Used by the dialogue_model, whose execute() receives a batch formed by Triton's dynamic batcher.
A request is one row (sampling) or W rows (beam search, dialogue/beam.py; greedy is beam search
of width 1). The rows' model state comes from a `BatchForward` (dialogue/batch_forward.py: slots
of the compact forward, or a Hugging Face cache); after each step it keeps
the rows that go on, each forked from the beam it continues, and finished requests' rows leave.
Tokens are chosen by the same logits pipeline as the streaming engine's
(streaming_backend.sampling.logits).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from streaming_backend.dialogue.batch_forward import BatchForward, HfBatchForward
from streaming_backend.dialogue.beam import BeamSearch, Hypothesis, step_all
from streaming_backend.errors import InvalidRequest, StreamingError
from streaming_backend.model.loading import LoadedModel
from streaming_backend.prompt_limits import PromptLimits
from streaming_backend.sampling import sampling
from streaming_backend.sampling.logits import NextTokenChooser
from streaming_backend.sampling.settings import SamplingSettings
from streaming_backend.wire import DIALOGUE_INPUT_IDS, END_ID, REQUEST_OUTPUT_LEN

log = logging.getLogger(__name__)

GREEDY = SamplingSettings(temperature=0.0)


@dataclass(frozen=True)
class GenerationRequest:
    """One request of a batch: prompt ids, how many new tokens, how to choose them."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    beam_width: int = 1
    # temperature 0 = greedy; beam search ignores temperature, top_p, top_k and seed
    settings: SamplingSettings = GREEDY
    end_ids: frozenset[int] | None = None  # None: the model's EOS ids
    length_penalty: float = 1.0

    @property
    def uses_beams(self) -> bool:
        """Beam search (greedy is its width-1 case) rather than sampling."""
        return self.beam_width > 1 or self.settings.greedy


@dataclass(frozen=True)
class GenerationResult:
    """A request's beams, best first (one for sampling and greedy)."""

    beams: tuple[Hypothesis, ...]


def validate(request: GenerationRequest, limits: PromptLimits, max_beam_width: int) -> None:
    """Raise InvalidRequest if the model cannot serve this request."""
    limits.check_ids(request.prompt_ids, DIALOGUE_INPUT_IDS)
    if not 1 <= request.beam_width <= max_beam_width:
        raise InvalidRequest(
            f"beam_width must be in [1, {max_beam_width}], got {request.beam_width}"
        )
    if request.max_new_tokens < 1:
        raise InvalidRequest(f"request_output_len must be at least 1, got {request.max_new_tokens}")
    limits.check_room(request.prompt_ids, request.max_new_tokens, REQUEST_OUTPUT_LEN)
    limits.check_in_vocab(sorted(request.end_ids or ()), END_ID)


def generate_batch(
    loaded: LoadedModel,
    requests: Sequence[GenerationRequest],
    max_beam_width: int,
    forward: BatchForward | None = None,
) -> list[GenerationResult | StreamingError]:
    """Generate for every request together on `forward` (default: Hugging Face's); a request
    that fails gets its own error instead."""
    forward = forward or HfBatchForward(loaded)
    results: list[GenerationResult | StreamingError | None] = [None] * len(requests)
    valid = []
    limits = PromptLimits.of(loaded)
    for index, request in enumerate(requests):
        try:
            validate(request, limits, max_beam_width)
            valid.append(index)
        except InvalidRequest as error:
            results[index] = error
    outcomes = _generate_isolated(forward, loaded.eos_ids, [requests[i] for i in valid])
    for index, outcome in zip(valid, outcomes):
        results[index] = outcome
    return results


def _generate_isolated(forward: BatchForward, eos_ids: frozenset[int], requests):
    """Run the batch; if it fails, run each request alone so only a failing one errs."""
    if not requests:
        return []
    try:
        with torch.inference_mode():
            return _generate(forward, eos_ids, requests)
    except Exception as error:  # a bug or an allocation failure: find who fails
        if len(requests) == 1:
            log.exception("generation failed")
            return [StreamingError(f"{type(error).__name__}: {error}")]
        return [_generate_isolated(forward, eos_ids, [r])[0] for r in requests]


# ---- one request's rows ---------------------------------------------------------------------


@dataclass
class _Sampled:
    """A request that samples: one row."""

    request: GenerationRequest
    end_ids: frozenset[int]
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    cum_log_prob: float = 0.0
    done: bool = False
    rows: int = 1
    grammar: None = None  # the dialogue model takes no grammar

    # the logits pipeline's view of this row (streaming_backend.sampling.logits.Row)
    @property
    def settings(self) -> SamplingSettings:
        return self.request.settings

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        return self.request.prompt_ids

    @property
    def output_ids(self) -> list[int]:
        return self.tokens

    def advance(self, token: int, log_prob: float) -> tuple[list[int], list[int]]:
        """Append a sampled token -> (source rows, tokens) of the next step; empty when done."""
        self.tokens.append(token)
        self.cum_log_prob += log_prob
        self.done = token in self.end_ids or len(self.tokens) >= self.request.max_new_tokens
        return ([], []) if self.done else ([0], [token])

    def result(self) -> GenerationResult:
        score = self.cum_log_prob / (len(self.tokens) ** self.request.length_penalty)
        return GenerationResult((Hypothesis(tuple(self.tokens), self.cum_log_prob, score),))


@dataclass
class _Beams:
    """A request searched with beams (greedy = width 1): W rows."""

    request: GenerationRequest
    search: BeamSearch

    @property
    def rows(self) -> int:
        return self.search.width

    @property
    def done(self) -> bool:
        return self.search.done

    def result(self) -> GenerationResult:
        return GenerationResult(tuple(self.search.results()))


def _start(request: GenerationRequest, model_end_ids: frozenset[int]):
    end_ids = request.end_ids or model_end_ids
    if request.uses_beams:
        search = BeamSearch(
            request.beam_width, request.max_new_tokens, end_ids, request.length_penalty
        )
        return _Beams(request, search)
    return _Sampled(request, end_ids, sampling.new_generator(request.settings.seed))


# ---- the loop -------------------------------------------------------------------------------


def _generate(
    forward: BatchForward, eos_ids: frozenset[int], requests: Sequence[GenerationRequest]
):
    """Prefill all prompts together, then step every live row together until all are done."""
    groups = [_start(r, eos_ids) for r in requests]
    rows = sum(g.rows for g in groups)
    length = max(len(r.prompt_ids) + r.max_new_tokens for r in requests)
    state, logits = forward.prefill([r.prompt_ids for r in requests], rows, length)
    try:
        expand = [i for i, g in enumerate(groups) for _ in range(g.rows)]  # beams share a prompt
        if len(expand) != len(groups):
            state.select(expand)
            logits = logits[expand]
        live = groups
        while True:
            choices = _choose(live, logits, eos_ids)  # per group: (source rows, next tokens)
            keep, next_tokens, still = [], [], []
            offset = 0
            for group, (sources, tokens) in zip(live, choices):
                if sources:
                    keep += [offset + s for s in sources]
                    next_tokens += tokens
                    still.append(group)
                offset += group.rows
            if not still:
                break
            if keep != list(range(offset)):
                state.select(keep)  # finished requests leave; beams follow their parents
            logits = state.decode(next_tokens)
            live = still
    finally:
        state.clear()
    return [g.result() for g in groups]


def _choose(groups, logits: torch.Tensor, eos_ids) -> list[tuple[list[int], list[int]]]:
    """Pick each group's next tokens from its rows of logits [R, V] (one logits pipeline)."""
    starts = [0]
    for group in groups:
        starts.append(starts[-1] + group.rows)
    choices: list[tuple[list[int], list[int]] | None] = [None] * len(groups)
    sampled = [i for i, g in enumerate(groups) if isinstance(g, _Sampled)]
    if sampled:
        rows = [starts[i] for i in sampled]
        tokens, log_probs = _sample([groups[i] for i in sampled], logits[rows], eos_ids)
        for i, token, log_prob in zip(sampled, tokens, log_probs):
            choices[i] = groups[i].advance(token, log_prob)
    beams = [i for i, g in enumerate(groups) if isinstance(g, _Beams)]
    if beams:
        rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in beams])
        log_probs = _beam_log_probs([groups[i] for i in beams], logits[rows], eos_ids)
        for i, choice in zip(beams, step_all([groups[i].search for i in beams], log_probs)):
            choices[i] = choice
    return choices


def _sample(
    groups: list[_Sampled], logits: torch.Tensor, eos_ids: frozenset[int]
) -> tuple[list[int], list[float]]:
    """One token per sampling row (logits [N, V]) and its log-prob under the raw model."""
    choice = NextTokenChooser.for_rows(groups, eos_ids, logits.device).choose(
        logits, groups, logprobs=True
    )
    return choice.ids, [picked for picked, _ in choice.logprobs]


@dataclass(frozen=True)
class _BeamRow:
    """One beam as the logits pipeline sees it: its request's settings and its tokens."""

    settings: SamplingSettings
    prompt_ids: tuple[int, ...]
    output_ids: list[int]
    generator: None = None  # beams draw nothing
    grammar: None = None  # the dialogue model takes no grammar


def _beam_log_probs(
    groups: list[_Beams], logits: torch.Tensor, eos_ids: frozenset[int]
) -> torch.Tensor:
    """Log-softmax of the beam groups' stacked rows [R, V], after their logits processors
    (repetition penalty)."""
    rows = [
        _BeamRow(group.request.settings, group.request.prompt_ids, tokens)
        for group in groups
        for tokens in group.search.tokens
    ]
    chooser = NextTokenChooser.for_rows(rows, eos_ids, logits.device)
    processed, _ = chooser.process(logits.clone(), rows)  # no grammars: nothing fails
    return torch.log_softmax(processed.float(), dim=-1)
