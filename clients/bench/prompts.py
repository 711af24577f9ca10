"""Prompts and sampling settings of a benchmark workload."""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clients.bench.transports import Prompt
from streaming_backend.prompts import DEFAULT_PROMPTS_FILE
from streaming_backend.sampling.request_keys import (
    IGNORE_EOS,
    MAX_TOKENS,
    MIN_TOKENS,
    SEED,
    TEMPERATURE,
    TOP_K,
    TOP_P,
)

DEFAULT_PROMPTS = DEFAULT_PROMPTS_FILE  # the chats shipped in the package

# Common English words that are one token each (with their leading space) in BPE vocabularies
# such as SmolLM2's and Llama's, so N words make a prompt of about N tokens. The server reports
# the exact count (num_input_tokens), which the benchmark records.
WORDS = (
    "the of and to in is was for on that with as by at from his her they this have had not are "
    "but one all were which when there can an their has been more would who will out so up said "
    "what about time into than them only other new some could these two may first then do any "
    "like my now over such our man me even most made after also did many before must through "
    "back years where much your way well down should because each just those people how too "
    "little state good very make world still own see men work long get here between both life "
    "being under never day same another know while last might us great old year off come since "
    "against go came right used take three"
).split()


def load_prompts(path: Path) -> list[Prompt]:
    """Prompts from a JSONL file: {"messages": [...]} per line, or {"prompt": "..."}."""
    prompts = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        obj = json.loads(line)
        if "messages" in obj:
            prompts.append(Prompt(messages=tuple(obj["messages"])))
        elif isinstance(obj.get("prompt") or obj.get("text"), str):
            prompts.append(Prompt(text=obj.get("prompt") or obj.get("text")))
        else:
            raise ValueError(f"{path}:{n}: expected a 'messages' list or a 'prompt' string")
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def synthetic_prompts(tokens: int, count: int, seed: int) -> list[Prompt]:
    """`count` plain-text prompts of about `tokens` tokens each, from a seeded word stream."""
    rng = random.Random(seed)
    return [Prompt(text=" ".join(rng.choice(WORDS) for _ in range(tokens))) for _ in range(count)]


@dataclass(frozen=True)
class Sampling:
    """Sampling settings sent with every request."""

    output_tokens: int | None = None  # fixed length: ignore_eos + min_tokens = max_tokens
    max_tokens: int = 128  # the cap when the length is free
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None  # request i uses seed + i: reproducible, yet not all alike
    extra: Mapping[str, Any] = field(default_factory=dict)  # sent as given, over the rest

    def params(self, index: int) -> dict:
        """The `sampling_parameters` object of request `index`."""
        p: dict = {}
        if self.output_tokens is not None:
            n = self.output_tokens
            p.update({MAX_TOKENS: n, MIN_TOKENS: n, IGNORE_EOS: True})
        else:
            p[MAX_TOKENS] = self.max_tokens
        optional = ((TEMPERATURE, self.temperature), (TOP_P, self.top_p), (TOP_K, self.top_k))
        for key, value in optional:
            if value is not None:
                p[key] = value
        if self.seed is not None:
            p[SEED] = self.seed + index
        return p | dict(self.extra)
