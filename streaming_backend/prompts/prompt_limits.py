"""A prompt checked against the model that runs it, one check for both models: its ids in the
model's vocabulary, and the prompt with its new tokens within the model's context."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from streaming_backend.errors import InvalidRequest
from streaming_backend.model.loading import LoadedModel
from streaming_backend.wire import INPUT_IDS


@dataclass(frozen=True)
class PromptLimits:
    """What a model takes: token ids in [0, vocab); prompt and new tokens within `context`."""

    vocab: int
    context: int

    @classmethod
    def of(cls, loaded: LoadedModel) -> PromptLimits:
        """The limits of a loaded model (its vocabulary: the input embedding's rows)."""
        vocab = int(loaded.model.get_input_embeddings().weight.shape[0])
        return cls(vocab, loaded.context_length)

    def check_ids(self, prompt_ids: Sequence[int], name: str = "the prompt") -> None:
        """Raise InvalidRequest if the prompt (`name` in the message) is empty or holds an id
        outside the vocabulary."""
        if not prompt_ids:
            raise InvalidRequest(f"{name} is empty")
        self.check_in_vocab(prompt_ids, INPUT_IDS)  # both models' tensor

    def check_in_vocab(self, ids: Sequence[int], name: str) -> None:
        """Raise InvalidRequest naming `name` if an id is outside [0, vocab)."""
        bad = [i for i in ids if not 0 <= i < self.vocab]
        if bad:
            raise InvalidRequest(f"{name} must be in [0, {self.vocab}); got {bad[:5]}")

    def room(self, prompt_ids: Sequence[int]) -> int:
        """How many new tokens fit after the prompt; InvalidRequest if not even one."""
        room = self.context - len(prompt_ids)
        if room < 1:
            raise InvalidRequest(
                f"the prompt has {len(prompt_ids)} tokens; the model's context is {self.context}"
            )
        return room

    def check_room(self, prompt_ids: Sequence[int], new_tokens: int, name: str) -> None:
        """Raise InvalidRequest if `new_tokens` (the request's `name`) do not fit after the
        prompt."""
        if len(prompt_ids) + new_tokens > self.context:
            raise InvalidRequest(
                f"the prompt has {len(prompt_ids)} tokens and {name} is {new_tokens}; "
                f"together they exceed the model's context of {self.context}"
            )
