"""The one prompt check of both models (streaming_backend.prompts.prompt_limits), as a table."""

import pytest

from streaming_backend.errors import InvalidRequest
from streaming_backend.prompts.prompt_limits import PromptLimits

LIMITS = PromptLimits(vocab=100, context=8)


@pytest.mark.parametrize(
    "check, message",
    [
        (lambda: LIMITS.check_ids([]), "the prompt is empty"),
        (lambda: LIMITS.check_ids([], "input_ids"), "input_ids is empty"),
        (
            lambda: LIMITS.check_ids([1, 100, -1]),
            r"input_ids must be in \[0, 100\); got \[100, -1\]",
        ),
        (lambda: LIMITS.check_in_vocab([7, 300], "end_id"), r"end_id must be in \[0, 100\)"),
        (lambda: LIMITS.room([1] * 8), "the prompt has 8 tokens; the model's context is 8"),
        (
            lambda: LIMITS.check_room([1] * 5, 4, "max_tokens"),
            "max_tokens is 4; together they exceed the model's context of 8",
        ),
    ],
)
def test_a_prompt_the_model_cannot_take_is_refused_with_the_reason(check, message):
    """Empty prompts, ids outside the vocabulary and too many tokens are refused, named."""
    with pytest.raises(InvalidRequest, match=message):
        check()


def test_a_prompt_within_the_limits_passes_and_leaves_room():
    """A prompt of ids in the vocabulary passes; room is what the context has left."""
    LIMITS.check_ids([0, 99])
    LIMITS.check_room([1] * 5, 3, "max_tokens")
    assert LIMITS.room([1] * 5) == 3


def test_the_limits_of_a_loaded_model(tiny_loaded):
    """A loaded model's limits: its embedding's rows and its context."""
    limits = PromptLimits.of(tiny_loaded)
    assert limits.vocab == tiny_loaded.model.get_input_embeddings().weight.shape[0]
    assert limits.context == tiny_loaded.context_length
