"""Does a quantized forward keep the model's quality? Teacher-forced greedy agreement and
perplexity against the unquantized forward, on the shipped chats.

    texts = reference_texts(plain, prompts, new_tokens=64, eos_ids=loaded.eos_ids)
    quality = compare(plain, quantized, texts, kind="int8")
    quality.passes()   # agreement >= 95 % and perplexity within 2 %

Each text is a chat prompt followed by the unquantized model's own greedy answer (what a
temperature-0 request would stream). Both forwards then read every text once (teacher forcing):
agreement is the share of positions where both would pick the same next token; perplexity is
over every next token of the texts. `compare_scorers` does the same for any two scorers (a text ->
its teacher-forced logits), e.g. Hugging Face's forward against ours, over each text's answer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from streaming_backend.forward.runner import PromptChunk, SlotForward

MIN_AGREEMENT = 0.95
MAX_PERPLEXITY_CHANGE = 0.02

# a text -> the logits [len - 1, V] (fp32) predicting its tokens 1.. (teacher_forced on a forward)
Scorer = Callable[[list[int]], torch.Tensor]


@dataclass(frozen=True)
class Quality:
    """One quantization's figures against the unquantized forward."""

    kind: str
    positions: int  # next-token predictions compared
    agreement: float  # share of positions with the same greedy token
    perplexity: float
    reference_perplexity: float

    @property
    def perplexity_change(self) -> float:
        """Relative change of perplexity (0.01: 1 % higher than unquantized)."""
        return self.perplexity / self.reference_perplexity - 1

    def passes(
        self, min_agreement: float = MIN_AGREEMENT, max_change: float = MAX_PERPLEXITY_CHANGE
    ) -> bool:
        """Agreement at least `min_agreement`, perplexity at most `max_change` higher."""
        return self.agreement >= min_agreement and self.perplexity_change <= max_change


def reference_texts(
    forward: SlotForward, prompts: Sequence[list[int]], new_tokens: int, eos_ids: frozenset[int]
) -> list[list[int]]:
    """Each prompt followed by `forward`'s greedy continuation (up to EOS or `new_tokens`)."""
    texts = []
    for prompt in prompts:
        slot = forward.cache.allocate()
        try:
            answer = [int(forward.prefill([PromptChunk(slot, prompt)]).argmax(-1))]
            while len(answer) < new_tokens and answer[-1] not in eos_ids:
                answer.append(int(forward.decode([slot], answer[-1:]).argmax(-1)))
        finally:
            forward.cache.free(slot)
        texts.append(list(prompt) + answer)
    return texts


def teacher_forced(forward: SlotForward, text: list[int]) -> torch.Tensor:
    """Logits [len - 1, V] (fp32) predicting tokens 1.. of `text`, read in one pass."""
    slot = forward.cache.allocate()
    try:
        return forward.score(PromptChunk(slot, text[:-1]))
    finally:
        forward.cache.free(slot)


def compare(
    reference: SlotForward, candidate: SlotForward, texts: Sequence[list[int]], kind: str
) -> Quality:
    """Agreement and perplexities of `candidate` against `reference` over `texts`."""
    return compare_scorers(
        partial(teacher_forced, reference), partial(teacher_forced, candidate), texts, kind
    )


def compare_scorers(
    reference: Scorer, candidate: Scorer, texts: Sequence[list[int]], kind: str, start: int = 1
) -> Quality:
    """Agreement and perplexities of `candidate` against `reference` over the tokens of each text
    from index `start` on (1: all but the first; the prompt's length: the answer only)."""
    same = positions = 0
    nll = {"reference": 0.0, "candidate": 0.0}
    for text in texts:
        targets = torch.tensor(text[start:])  # [T]
        logits = {"reference": reference(text)[start - 1 :]}  # [T, V]
        logits["candidate"] = candidate(text)[start - 1 :]
        same += int((logits["reference"].argmax(-1) == logits["candidate"].argmax(-1)).sum())
        positions += len(targets)
        for name, values in logits.items():
            nll[name] += float(torch.nn.functional.cross_entropy(values, targets, reduction="sum"))
    return Quality(
        kind=kind,
        positions=positions,
        agreement=same / positions,
        perplexity=math.exp(nll["candidate"] / positions),
        reference_perplexity=math.exp(nll["reference"] / positions),
    )
