"""Beam search for one request, one step at a time: (beam state, log-probs [W, V]) -> which rows
continue with which tokens. No model here: streaming_backend.dialogue.generation runs the forward
pass for the beams of every request in a batch together and calls `BeamSearch.step` per request.

Semantics follow Hugging Face's beam search with `early_stopping=False` (tests compare the two):
- every step looks at the best (1 + number of end ids) * W continuations of all W beams;
- a continuation that ends with an end id, or reaches the length limit, becomes a finished
  hypothesis only if it ranks among the best W of the step; its score is
  cum_log_prob / length ** length_penalty (length counts the new tokens, the end id included);
- the best W continuations that do not end run on;
- the search stops when W hypotheses are finished and the best running beam, scored at its
  current length, cannot beat the worst of them (early stopping), or at the length limit.
Width 1 is greedy search: the step keeps the single most likely token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Hypothesis:
    """A finished beam: its new tokens, summed log-probability and length-penalised score."""

    tokens: tuple[int, ...]
    cum_log_prob: float
    score: float


def length_normalised(cum_log_prob: float, length: int, length_penalty: float) -> float:
    """A beam's score: cum_log_prob / length ** length_penalty."""
    return cum_log_prob / (max(length, 1) ** length_penalty)


@dataclass
class BeamSearch:
    """The beams of one request: W running beams and at most W finished hypotheses."""

    width: int
    max_new_tokens: int
    end_ids: frozenset[int]
    length_penalty: float = 1.0
    # [W] summed log-probs of the running beams; at the start only beam 0 is real (-inf others),
    # because all W rows hold the same prompt and must not yield W copies of one continuation.
    scores: torch.Tensor = field(init=False)
    tokens: list[list[int]] = field(init=False)  # [W] new tokens of each running beam
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most W
    done: bool = False

    def __post_init__(self) -> None:
        if self.width < 1 or self.max_new_tokens < 1:
            raise ValueError("beam width and max_new_tokens must be at least 1")
        self.scores = torch.full((self.width,), -math.inf)
        self.scores[0] = 0.0
        self.tokens = [[] for _ in range(self.width)]

    @property
    def steps(self) -> int:
        """New tokens each running beam holds."""
        return len(self.tokens[0])

    def candidates(self) -> int:
        """How many of the best continuations a step must see: (1 + end ids) * W."""
        return (1 + len(self.end_ids)) * self.width

    def step(self, log_probs: torch.Tensor) -> tuple[list[int], list[int]]:
        """Advance by one token; log_probs [W, V] of the running beams -> (source rows, tokens).

        Row i of the next step continues running beam sources[i] with token tokens[i]. Both
        are empty once the search is done.
        """
        return step_all([self], log_probs)[0]

    def advance(self, top_scores: list[float], top_index: list[int], vocab: int):
        """Advance by one token, given the best continuations of all beams, best first
        (scores: summed log-probs; index: beam * vocab + token) -> (source rows, tokens)."""
        length = self.steps + 1  # of every candidate of this step
        last = length >= self.max_new_tokens
        sources, tokens, scores, new_tokens = [], [], [], []
        for rank, (score, index) in enumerate(zip(top_scores, top_index)):
            beam, token = divmod(index, vocab)
            if last or token in self.end_ids:
                if rank < self.width and score > -math.inf:
                    self._add(self.tokens[beam] + [token], score)
                continue
            if len(sources) < self.width:
                sources.append(beam)
                tokens.append(token)
                scores.append(score)
                new_tokens.append(self.tokens[beam] + [token])
        if last or not sources:
            return self._finish()
        self.scores = torch.tensor(scores)
        self.tokens = new_tokens
        if self._cannot_improve(length):
            return self._finish()
        return sources, tokens

    def results(self) -> list[Hypothesis]:
        """The W best hypotheses, best first (empty ones if fewer sequences exist at all)."""
        empty = Hypothesis((), -math.inf, -math.inf)
        return self.finished + [empty] * (self.width - len(self.finished))

    def _add(self, tokens: list[int], cum_log_prob: float) -> None:
        """Keep a finished hypothesis if it is among the W best so far."""
        score = length_normalised(cum_log_prob, len(tokens), self.length_penalty)
        self.finished.append(Hypothesis(tuple(tokens), cum_log_prob, score))
        self.finished.sort(key=lambda h: h.score, reverse=True)  # stable: earlier wins ties
        del self.finished[self.width :]

    def _cannot_improve(self, length: int) -> bool:
        """Early stopping: W finished, and the best running beam scores no better than the worst."""
        if len(self.finished) < self.width:
            return False
        best_running = length_normalised(float(self.scores[0]), length, self.length_penalty)
        return best_running <= self.finished[-1].score

    def _finish(self) -> tuple[list[int], list[int]]:
        self.done = True
        return [], []


def step_all(searches: list[BeamSearch], log_probs: torch.Tensor) -> list[tuple[list, list]]:
    """One step of several searches whose rows are stacked in log_probs [sum of W, V]; searches
    of one width share one top-k call (a few large tensor operations instead of many small
    ones) -> (source rows, tokens) per search, rows counted within each search."""
    vocab = log_probs.shape[-1]
    starts = [0]
    for search in searches:
        starts.append(starts[-1] + search.width)
    choices: list[tuple[list, list] | None] = [None] * len(searches)
    for width in sorted({s.width for s in searches}):
        members = [i for i, s in enumerate(searches) if s.width == width]
        rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in members])
        scores = torch.stack([searches[i].scores for i in members]).to(log_probs.device)  # [G, W]
        total = log_probs[rows].float().view(len(members), width, vocab) + scores[:, :, None]
        # Taking more candidates than a search needs changes nothing: those past its own count
        # are never used (there are always W non-ending ones among the first (1 + ends) * W).
        k = min(max(searches[i].candidates() for i in members), width * vocab)
        top_scores, top_index = total.view(len(members), -1).topk(k)  # [G, k] best first
        for i, row_scores, row_index in zip(members, top_scores.tolist(), top_index.tolist()):
            choices[i] = searches[i].advance(row_scores, row_index, vocab)
    return choices
