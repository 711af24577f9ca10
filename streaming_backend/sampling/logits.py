"""The logits pipeline of one batch: from a step's logits [B, V] to one chosen token per row.

`NextTokenChooser` is built once per batch composition (the running batch caches it and builds a
new one when rows join or leave) and holds the rows' sampling settings as tensors. Each step it
runs the same stages for every caller, the streaming engine and the dialogue model alike:

    finite check -> repetition penalty -> EOS ban before min_tokens -> grammar mask (guided_*)
    -> temperature, top-k, top-p -> the draw (one uniform per row from the row's own generator)
    -> logprobs of the choice and its top alternatives

and brings the ids, finite flags and logprobs to the host in one transfer. A row that needs no
stage (penalty 1, min_tokens reached, no grammar) costs that stage nothing; a batch in which no
row has a grammar never touches the grammar code.

Logprobs are of the distribution the sampler starts from: after the penalty, the EOS ban and
the grammar mask, before temperature, top-k and top-p. Without those they are the model's own
log-softmax.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy
import torch

from streaming_backend.errors import MaskFailed
from streaming_backend.kernels import greedy
from streaming_backend.sampling import logprobs as lp
from streaming_backend.sampling import sampling
from streaming_backend.sampling.grammar import GrammarMatcher, apply_grammar_masks
from streaming_backend.sampling.settings import SamplingSettings

TopLogprobs = tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


class Row(Protocol):
    """What the pipeline reads of a row: its settings, generator, tokens so far and grammar."""

    settings: SamplingSettings
    generator: torch.Generator
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    grammar: GrammarMatcher | None  # None: unconstrained


@dataclass(frozen=True)
class Choice:
    """One step's chosen token per row, on the host."""

    ids: list[int]
    finite: list[bool]  # False: the row's logits held NaN or inf (it was drawn from zeros)
    # per row (the choice's logprob, its top_logprobs alternatives), when asked for
    logprobs: list[tuple[float, TopLogprobs]] | None
    # rows whose grammar mask failed (their token was drawn unmasked): the stream ends with it
    failed: dict[int, MaskFailed] = field(default_factory=dict)


class NextTokenChooser:
    """The sampling settings of one batch's rows, and the pipeline that applies them."""

    def __init__(
        self,
        settings: Sequence[SamplingSettings],
        eos_ids: Collection[int],
        device: torch.device | str = "cpu",
    ):
        self.params = sampling.BatchSampling.from_settings(settings, device)
        self.penalties = [s.repetition_penalty for s in settings]
        self.min_tokens = [s.min_tokens for s in settings]
        # (row, min_p, temperature) of the sampled rows that set min_p
        self.min_p = [
            (r, s.min_p, s.temperature) for r, s in enumerate(settings) if s.min_p and not s.greedy
        ]
        self.eos_ids = sorted(eos_ids)
        # every row greedy with no penalty or min_p: a step whose rows need no EOS ban or grammar
        # either takes each row's likeliest token as the logits hold it (`_greedy`)
        self.greedy_only = (
            self.params.all_greedy and not self.min_p and all(p == 1.0 for p in self.penalties)
        )

    @classmethod
    def for_rows(
        cls, rows: Sequence[Row], eos_ids: Collection[int], device: torch.device | str = "cpu"
    ) -> NextTokenChooser:
        """The chooser of these rows, in this order."""
        return cls([row.settings for row in rows], eos_ids, device)

    def __len__(self) -> int:
        return len(self.penalties)

    def process(
        self, logits: torch.Tensor, rows: Sequence[Row]
    ) -> tuple[torch.Tensor, dict[int, MaskFailed]]:
        """The logits processors, in place where possible: repetition penalty, min_p, EOS
        banned on rows short of min_tokens, then each grammar's mask -> (logits [B, V], the
        rows whose grammar mask failed, with the error their streams must end with)."""
        self._check(rows)
        penalised = [
            (r, penalty, _seen(row))
            for r, (row, penalty) in enumerate(zip(rows, self.penalties))
            if penalty != 1.0
        ]
        logits = sampling.apply_repetition_penalty(logits, penalised)
        logits = sampling.apply_min_p(logits, self.min_p)
        early = [
            r
            for r, (row, least) in enumerate(zip(rows, self.min_tokens))
            if len(row.output_ids) < least
        ]
        logits = sampling.suppress_tokens(logits, early, self.eos_ids)
        return logits, apply_grammar_masks(logits, [row.grammar for row in rows])

    def choose(
        self,
        logits: torch.Tensor,
        rows: Sequence[Row],
        logprobs: bool = False,
        top_logprobs: int = 0,
    ) -> Choice:
        """One token per row of logits [B, V]: the whole pipeline and one host transfer; with
        `logprobs`, each choice's logprob and the `top_logprobs` most likely alternatives."""
        if not logprobs and self._plain_greedy(rows):
            choice = self._greedy(logits, rows)
            if choice is not None:
                return choice
        # NaN or inf (fp16 overflow, a broken device) would be sampled as some token: such a row
        # is drawn from zeros instead and reported, so its stream can fail alone. Its sum is NaN
        # or inf then (or past float's range, itself a broken row): one pass, where isfinite and
        # all took 7x as long on a CPU (64 against 9 us for 49152 logits)
        finite = torch.isfinite(logits.sum(-1))  # [B]
        logits, failed = self.process(torch.where(finite[:, None], logits, 0.0), rows)
        uniforms = sampling.draw_uniforms([row.generator for row in rows])
        chosen = sampling.sample(logits, self.params, uniforms)  # [B] on the device
        # float64 holds every id exactly: ids, flags and logprobs come back in one copy
        columns = [chosen.double(), finite.double()]
        if logprobs:
            picked = lp.chosen_and_top(logits, chosen, top_logprobs)
            columns += [c.double() for c in lp.host_columns(*picked)]
        host = torch.stack(columns).tolist()
        return Choice(
            ids=[int(i) for i in host[0]],
            finite=[bool(f) for f in host[1]],
            logprobs=lp.rows_from_host(host, 2, top_logprobs) if logprobs else None,
            failed=failed,
        )

    def _plain_greedy(self, rows: Sequence[Row]) -> bool:
        """Whether every row takes its likeliest token from the logits as they are, or EOS
        banned: greedy, with no repetition penalty, min_p or grammar."""
        self._check(rows)
        return self.greedy_only and all(row.grammar is None for row in rows)

    def _greedy(self, logits: torch.Tensor, rows: Sequence[Row]) -> Choice | None:
        """`choose` for plainly greedy rows (`_plain_greedy`): each row's first largest logit,
        where its finite check holds, so the same ids and flags as the whole pipeline gives.
        None (the pipeline's turn) when a row is not finite. A row short of min_tokens whose
        likeliest is EOS takes its likeliest other token, the EOS ids put out of reach as the
        pipeline does (a fixed-length benchmark, ignore_eos, bans EOS on every row; when one row
        of 16 wanted it, the whole batch went through the pipeline). On a CPU one call of our C
        kernels takes both (`kernels.greedy.GreedyKernel`: a row it is not certain of goes to the
        pipeline); without them, the pipeline's finite check and numpy's argmax. After a forward
        has left the caches cold every tensor operation costs tens of microseconds: in a 3.3 ms
        decode step of the default model the pipeline's took about 190 us, torch's finite check
        with numpy's argmax about 105, the C call's way about 37 (docs/performance.md)."""
        picked = _native_greedy(logits)
        if picked is not None:
            ids, sure = picked
            if not all(sure):
                return None
            finite = sure
        else:
            finite = torch.isfinite(logits.sum(-1)).tolist()
            if not all(finite):
                return None
            if logits.device.type == "cpu" and logits.dtype == torch.float32:
                ids = numpy.argmax(logits.detach().numpy(), axis=-1).tolist()
            else:
                ids = logits.max(-1).indices.tolist()
        banned = [
            r
            for r, (token, row, least) in enumerate(zip(ids, rows, self.min_tokens))
            if token in self.eos_ids and len(row.output_ids) < least
        ]
        if banned:  # those rows' likeliest but EOS, as the pipeline's ban and argmax find it
            redo = sampling.suppress_tokens(
                logits[banned].clone(), range(len(banned)), self.eos_ids
            )
            for r, token in zip(banned, redo.max(-1).indices.tolist()):
                ids[r] = token
        return Choice(ids=ids, finite=finite, logprobs=None)

    def _check(self, rows: Sequence[Row]) -> None:
        if len(rows) != len(self):
            raise ValueError(f"a chooser of {len(self)} rows was given {len(rows)}")


def _native_greedy(logits: torch.Tensor) -> tuple[list[int], list[bool]] | None:
    """`kernels.greedy.GreedyKernel` on CPU float32 logits [B, V]; None where it does not apply
    (another device or dtype, or no C kernels)."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2:
        return None
    kernel = greedy.greedy_kernel()
    return None if kernel is None else kernel(logits.contiguous())


def _seen(row: Row) -> list[int]:
    """The tokens a repetition penalty counts: the prompt and the output so far."""
    return [*row.prompt_ids, *row.output_ids]
