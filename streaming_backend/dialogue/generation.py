"""Batched, non-streaming generation: the dialogue model's requests (token ids in, token ids
out) on the chat model's steps (streaming_backend/steps): the same forwards, prefix cache and
chunked prefill, one forward pass per step for every row of every request.

A request is one row (sampling) or W rows (beam search, dialogue/beam.py; greedy is beam search
of width 1). It joins when the steps have room for all its rows and is prefilled as one row;
its beams then fork from it (`Steps.fork`: a beam with two children is a copy of its model
state) and a row no beam continues leaves. Requests that wait for room join as others end, in
the same call: Triton's dynamic batcher forms the batch, the steps run it. Tokens are chosen by
the same logits pipeline as the streaming engine's (streaming_backend.sampling.logits).

Sampled and greedy (width-1) requests speculate as the chat model's streams do (steps/drafts.py,
steps/draft_model.py): a step verifies a row's drafted tokens, and while the token chosen at a
position equals the draft there, the row takes the token chosen after it too, by the same rule
as a step of its own (its draw, its beam step), so the answer is the same. Beam search of width
2 and more does not speculate: its beams fork and are pruned at every step.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from streaming_backend.configuration.models import EngineConfig
from streaming_backend.dialogue.beam import BeamSearch, Hypothesis, step_all
from streaming_backend.errors import InvalidRequest, StreamingError
from streaming_backend.model.loading import LoadedModel
from streaming_backend.prompts.prompt_limits import PromptLimits
from streaming_backend.sampling import sampling
from streaming_backend.sampling.logits import NextTokenChooser
from streaming_backend.sampling.settings import SamplingSettings
from streaming_backend.steps import Decoded, Steps, admission
from streaming_backend.steps.build import Carried, build_steps
from streaming_backend.steps.drafts import DraftCounts, resolve_mode
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


class Generator:
    """The dialogue model's generation: requests in, each one's beams or error out, on steps
    built once (`build_steps`: the compact forward where it runs, else Hugging Face's)."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, max_beam_width: int):
        self.loaded = loaded
        self.config = config
        self.max_beam_width = max_beam_width
        self.limits = PromptLimits.of(loaded)
        self.steps: Steps[_Row] = build_steps(loaded, config, self._prefill_failed)
        # speculative decoding, as the chat model's engine has it (counts kept across rebuilds)
        self.draft_counts = DraftCounts()
        self.speculative = resolve_mode(config.speculative, loaded.device.type)
        self._enable_drafts()

    @property
    def name(self) -> str:
        """The forward the rows run on: "compact" or "hf"."""
        return self.steps.name

    def generate(
        self, requests: Sequence[GenerationRequest]
    ) -> list[GenerationResult | StreamingError]:
        """Generate for every request together; a request that fails gets its own error."""
        results: list[GenerationResult | StreamingError | None] = [None] * len(requests)
        jobs = []
        for index, request in enumerate(requests):
            try:
                validate(request, self.limits, self.max_beam_width)
                jobs.append(_Job.start(index, request, self.loaded.eos_ids))
            except InvalidRequest as error:
                results[index] = error
        self._fit(jobs)
        self._run_isolated(jobs)
        for job in jobs:
            results[job.index] = job.outcome
        return results

    def _fit(self, jobs: list[_Job]) -> None:
        """Size the compact forward's slots to this batch, between batches.

        Its KV cache is a fixed number of slots of one length within a memory budget: slots of
        the model's whole context (8192 positions for the default model) leave room for a dozen
        rows, where the dialogue model's usual requests (tens of tokens, up to 32 per batch
        and W rows each) need a few hundred positions. So a slot is as long as the batch's
        longest request rounded up to a power of two (`slot_length`), and the cache is rebuilt
        (same model, same memory) when a request is longer than its slots, or when the batch
        has more rows than slots and shorter slots would hold more. A rebuild drops the prefix
        cache; Hugging Face's cache grows with its rows and needs none of this."""
        cache = getattr(self.steps, "cache", None)
        if cache is None or not jobs:
            return
        longest = max(len(j.request.prompt_ids) + j.request.max_new_tokens for j in jobs)
        rows = min(sum(j.width for j in jobs), self.config.max_streams)
        length = slot_length(longest, self.limits.context)
        too_short = longest > cache.max_len
        too_few = rows > cache.slots and length < cache.max_len
        if not (too_short or too_few):
            return
        self.config = replace(self.config, max_len=length)
        carried = Carried.of(self.steps)
        self.steps = cache = None  # nothing holds the old cache while the new one is made
        self.steps = build_steps(self.loaded, self.config, self._prefill_failed, carried)
        self._enable_drafts()

    def _enable_drafts(self) -> None:
        """Turn the steps' drafts on where speculation is; off (logged) where they cannot."""
        if self.speculative == "off":
            return
        why = self.steps.enable_drafts(self.draft_counts)
        if why is not None:
            log.info("no speculative decoding: %s", why)
            self.speculative = "off"

    def _run_isolated(self, jobs: list[_Job]) -> None:
        """Run the jobs together; if a step fails, rerun each unfinished one alone, so that only
        a failing request errs."""
        if not jobs:
            return
        try:
            with torch.inference_mode():
                self._run(jobs)
        except Exception as error:  # a bug or an allocation failure: find who fails
            self.steps.clear()
            if len(jobs) == 1:
                log.exception("generation failed")
                jobs[0].outcome = StreamingError(f"{type(error).__name__}: {error}")
                return
            for job in [job for job in jobs if job.outcome is None]:
                again = _Job.start(job.index, job.request, self.loaded.eos_ids)
                self._run_isolated([again])
                job.outcome = again.outcome

    # ---- the loop -----------------------------------------------------------------------------

    def _run(self, jobs: list[_Job]) -> None:
        """Admit what fits, prefill, step every decoding row; until every job has its outcome."""
        waiting = collections.deque(jobs)
        active: list[_Job] = []
        while waiting or active:
            self._admit(waiting, active)
            for ready in self.steps.prefill():
                self._advance(ready.streams, ready.logits)
            if self.steps.decoding():
                step = self.steps.decode()
                if step.drafts:
                    self._advance(step.streams, step.logits[step.first_rows()], step)
                else:
                    self._advance(step.streams, step.logits)
            active = [job for job in active if job.outcome is None]

    def _admit(self, waiting: collections.deque[_Job], active: list[_Job]) -> None:
        """Start the waiting jobs, in order, while the steps have room for all their rows (a job
        holds one row until its beams fork: the rest is kept for it)."""
        reserved = sum(job.width - len(job.rows) for job in active)
        sizes = ((job.width, len(job.request.prompt_ids)) for job in waiting)
        jobs = [waiting.popleft() for _ in range(admission(self.steps, sizes, reserved))]
        if jobs:
            active.extend(jobs)
            self.steps.admit([job.first_row() for job in jobs])
        elif waiting and not active:  # all the room there is, and still too little
            job = waiting.popleft()
            job.outcome = StreamingError(
                f"beam_width {job.width} needs {job.width} rows and this instance has room for "
                f"{self.steps.capacity()} at most (its KV cache's slots: raise kv_cache_memory)"
            )

    def _prefill_failed(self, rows: list[_Row], error: Exception) -> None:
        """Rows whose prefill failed alone (the steps freed them): their requests fail."""
        for job in {id(row.job): row.job for row in rows}.values():
            job.outcome = StreamingError.of(error)
            self.steps.remove([r for r in job.rows if r not in rows], keep=False)

    def _advance(self, rows: list[_Row], logits: torch.Tensor, step: Decoded | None = None) -> None:
        """Choose each job's next tokens from its rows of logits [N, V]; fork, prune, finish.
        With `step` (it verified drafts), a drafting row then takes the tokens after its
        accepted drafts (`_take_drafted`); the jobs finish once the step is settled."""
        position = {id(row): r for r, row in enumerate(rows)}
        jobs = list({id(row.job): row.job for row in rows}.values())
        finished = []
        sampled = [job for job in jobs if job.search is None]
        if sampled:
            first = [job.rows[0] for job in sampled]
            at = [position[id(row)] for row in first]
            ids, log_probs = _sample(first, logits[at], self.loaded.eos_ids)
            for job, token, log_prob in zip(sampled, ids, log_probs):
                job.take(token, log_prob)
        beams = [job for job in jobs if job.search is not None]
        if beams:
            # before the first step a job has one row (its prompt's) for its W beams
            at = [position[id(job.beam_row(i))] for job in beams for i in range(job.width)]
            log_probs = _beam_log_probs(beams, logits[at], self.loaded.eos_ids)
            for job, (sources, _) in zip(beams, step_all([j.search for j in beams], log_probs)):
                if sources:
                    self._branch(job, sources)
                else:
                    finished.append(job)
        if step is not None:
            finished += self._take_drafted(step, [job for job in jobs if job not in finished])
            self.steps.settle(step)  # before a finished row's KV is kept for the prefix cache
        for job in sampled:
            if job.done:
                finished.append(job)
        for job in finished:
            self._finish(job)

    def _take_drafted(self, step: Decoded, jobs: list[_Job]) -> list[_Job]:
        """Each drafting row's tokens past its first: while its newest token equals its next
        drafted one, the token after it, chosen from the logits after that draft as a step of
        its own would (a sampled row's next draw, a width-1 beam's step). Returns the beam jobs
        that ended so."""
        starts, index = step.first_rows(), {id(row): r for r, row in enumerate(step.streams)}
        ended = []
        for job in jobs:
            row = job.rows[0]
            r = index.get(id(row))
            drafted = step.drafts[r] if r is not None else []
            at = 0
            while at < len(drafted) and not job.done and row.output_ids[-1] == drafted[at]:
                at += 1
                logits = step.logits[starts[r] + at][None]  # [1, V]
                if job.search is None:
                    ids, log_probs = _sample([row], logits, self.loaded.eos_ids)
                    job.take(ids[0], log_probs[0])
                    continue
                log_probs = _beam_log_probs([job], logits, self.loaded.eos_ids)
                [(sources, _)] = step_all([job.search], log_probs)
                if not sources:
                    ended.append(job)
                    break
                self._branch(job, sources)
        return ended

    def _branch(self, job: _Job, sources: list[int]) -> None:
        """The job's rows after a beam step: beam i continues row sources[i] (a row continued
        twice is forked, one continued by none leaves) with the search's tokens."""
        parents = [job.beam_row(s) for s in sources]
        claimed: set[int] = set()
        rows, forks = [], []
        for parent in parents:
            if id(parent) in claimed:
                child = job.new_row()
                forks.append((parent, child))
                rows.append(child)
            else:
                claimed.add(id(parent))
                rows.append(parent)
        self.steps.remove([row for row in job.rows if id(row) not in claimed], keep=False)
        self.steps.fork(forks)  # copies of the parents' state, before they take their tokens
        for row, tokens in zip(rows, job.search.tokens):
            row.output_ids = list(tokens)
        job.rows = rows

    def _finish(self, job: _Job) -> None:
        """The job's outcome; its first row's KV stays for the prefix cache, the others go."""
        job.outcome = job.result()
        self.steps.remove(job.rows[1:], keep=False)
        self.steps.remove(job.rows[:1])


MIN_SLOT_LENGTH = 256  # positions of the shortest slots the dialogue model's cache is cut into


def slot_length(positions: int, limit: int) -> int:
    """The power of two at least `positions` (and MIN_SLOT_LENGTH), at most `limit`."""
    return min(limit, max(MIN_SLOT_LENGTH, 1 << (positions - 1).bit_length()))


# ---- one request ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Handle:
    """What the steps log of a row's request."""

    request_id: str


@dataclass(eq=False)  # rows compare by identity
class _Row:
    """One row of the steps (their `Stream`): the request's prompt and one sequence's tokens."""

    job: _Job
    prompt_ids: list[int]
    settings: SamplingSettings
    generator: torch.Generator | None  # sampling's; beams draw nothing
    output_ids: list[int] = field(default_factory=list)
    scheduled_ns: int = 0
    cached_tokens: int = 0  # prompt tokens the prefix cache gave
    grammar: None = None  # the dialogue model takes no grammar

    @property
    def handle(self) -> _Handle:
        return _Handle(f"dialogue request {self.job.index}")


@dataclass(eq=False)
class _Job:
    """A request on the steps: its rows, its beam search (None: it samples), its outcome."""

    index: int  # in the call's requests
    request: GenerationRequest
    end_ids: frozenset[int]
    search: BeamSearch | None
    generator: torch.Generator | None = None
    rows: list[_Row] = field(default_factory=list)
    cum_log_prob: float = 0.0  # a sampled sequence's
    done: bool = False  # a sampled sequence's
    outcome: GenerationResult | StreamingError | None = None

    @classmethod
    def start(cls, index: int, request: GenerationRequest, model_end_ids: frozenset[int]) -> _Job:
        end_ids = request.end_ids or model_end_ids
        if request.uses_beams:
            search = BeamSearch(
                request.beam_width, request.max_new_tokens, end_ids, request.length_penalty
            )
            return cls(index, request, end_ids, search)
        return cls(index, request, end_ids, None, sampling.new_generator(request.settings.seed))

    @property
    def width(self) -> int:
        """Rows this job holds at most."""
        return self.search.width if self.search is not None else 1

    def new_row(self) -> _Row:
        return _Row(self, list(self.request.prompt_ids), self.row_settings, self.generator)

    @property
    def row_settings(self) -> SamplingSettings:
        """Its rows' settings as the steps read them: its length as max_tokens (which bounds a
        draft), and no speculation for beams of width 2 and more (they fork at every step)."""
        settings = self.request.settings
        speculate = settings.speculate and self.width == 1
        return replace(settings, max_tokens=self.request.max_new_tokens, speculate=speculate)

    def first_row(self) -> _Row:
        """The row its prompt is prefilled in."""
        self.rows = [self.new_row()]
        return self.rows[0]

    def beam_row(self, beam: int) -> _Row:
        """The row holding beam `beam`: before the first step every beam is the prompt's row."""
        return self.rows[beam] if beam < len(self.rows) else self.rows[0]

    def take(self, token: int, log_prob: float) -> None:
        """A sampled token: appended to its row; done at an end id or the length limit."""
        tokens = self.rows[0].output_ids
        tokens.append(token)
        self.cum_log_prob += log_prob
        self.done = token in self.end_ids or len(tokens) >= self.request.max_new_tokens

    def result(self) -> GenerationResult:
        if self.search is not None:
            return GenerationResult(tuple(self.search.results()))
        tokens = tuple(self.rows[0].output_ids)
        score = self.cum_log_prob / (len(tokens) ** self.request.length_penalty)
        return GenerationResult((Hypothesis(tokens, self.cum_log_prob, score),))


# ---- choosing tokens ------------------------------------------------------------------------


def _sample(
    rows: list[_Row], logits: torch.Tensor, eos_ids: frozenset[int]
) -> tuple[list[int], list[float]]:
    """One token per sampling row (logits [N, V]) and its log-prob under the raw model."""
    choice = NextTokenChooser.for_rows(rows, eos_ids, logits.device).choose(
        logits, rows, logprobs=True
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
    jobs: list[_Job], logits: torch.Tensor, eos_ids: frozenset[int]
) -> torch.Tensor:
    """Log-softmax of the beam jobs' stacked rows [R, V], after their logits processors
    (repetition penalty)."""
    rows = [
        _BeamRow(job.request.settings, job.request.prompt_ids, tokens)
        for job in jobs
        for tokens in job.search.tokens
    ]
    chooser = NextTokenChooser.for_rows(rows, eos_ids, logits.device)
    processed, _ = chooser.process(logits.clone(), rows)  # no grammars: nothing fails
    return torch.log_softmax(processed.float(), dim=-1)
