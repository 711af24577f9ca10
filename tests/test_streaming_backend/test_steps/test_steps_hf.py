"""steps/hf.py, the Hugging Face forward's steps, on the tiny Llama (float32, CPU): prompts of
near lengths prefilled together, left padding that changes no row's logits, the running batch's
decode, forks and removal, and a prompt that fails alone. (length_groups' table is in
test_engine.py.)"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from streaming_backend.configuration.models import EngineConfig
from streaming_backend.sampling.settings import SamplingSettings
from streaming_backend.steps.hf import HfForward, HfSteps, cache_kwarg

ATOL = 1e-4  # float32 logits of one prompt computed alone and in a padded batch


@dataclass
class Stream:
    """What the steps read and write of an engine stream."""

    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    settings: SamplingSettings = field(default_factory=SamplingSettings)
    generator: torch.Generator = field(default_factory=torch.Generator)
    scheduled_ns: int = 0
    cached_tokens: int = 0
    handle: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(request_id="r"))


class Failures:
    """on_failure: the streams whose prefill failed, and why."""

    def __init__(self):
        self.calls: list[tuple[list, Exception]] = []

    def __call__(self, streams, error):
        self.calls.append((streams, error))


def steps_of(loaded, **config) -> tuple[HfSteps, Failures]:
    failures = Failures()
    return HfSteps(loaded, EngineConfig(forward="hf", **config), failures), failures


def alone(loaded, ids: list[int]) -> torch.Tensor:
    """Next-token logits [V] of `ids` prefilled alone (no padding)."""
    _, logits, _ = HfForward(loaded).prefill([ids])
    return logits[0]


def test_prompts_of_near_lengths_are_prefilled_together_without_changing_their_logits(
    tiny_loaded,
):
    """Lengths 3 and 4 share a pass, 12 gets its own (max_padding 0.25); each row's logits are
    its prompt's alone, the padding masked out, and every stream is marked scheduled."""
    steps, failures = steps_of(tiny_loaded, max_streams=8, max_padding=0.25)
    streams = [Stream([20, 21, 22, 23]), Stream(list(range(30, 42))), Stream([5, 6, 7])]
    steps.admit(streams)
    assert steps.live() == streams and steps.capacity() == 8 - 3 and not steps.decoding()
    done = list(steps.prefill())
    assert [[len(s.prompt_ids) for s in p.streams] for p in done] == [[3, 4], [12]]
    for prefilled in done:
        for stream, logits in zip(prefilled.streams, prefilled.logits):
            torch.testing.assert_close(
                logits, alone(tiny_loaded, stream.prompt_ids), atol=ATOL, rtol=0
            )
    assert all(s.scheduled_ns > 0 for s in streams) and failures.calls == []
    assert steps.decoding() and steps.capacity() == 5


def test_a_decode_step_continues_each_row_as_its_prompt_alone_would(tiny_loaded):
    """After a padded prefill, one decode step gives each row the logits of its prompt plus
    its latest token computed alone (the mask and positions follow the padding)."""
    steps, _ = steps_of(tiny_loaded, max_padding=10.0)  # one group: the short row is padded
    streams = [Stream([9, 8, 7, 6, 5, 4]), Stream([100, 101])]
    steps.admit(streams)
    list(steps.prefill())
    for stream, token in zip(streams, (300, 301)):
        stream.output_ids.append(token)
    decoded = steps.decode()
    assert decoded.streams == streams[::-1]  # prefilled shortest first: the batch's row order
    for stream, logits in zip(decoded.streams, decoded.logits):
        expected = alone(tiny_loaded, stream.prompt_ids + stream.output_ids)
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_a_forked_child_decodes_from_a_copy_of_its_parents_row(tiny_loaded):
    """fork: the child joins with its parent's cache row; given the same token, both get the
    same logits, and the parent's row is unchanged by the child's."""
    steps, _ = steps_of(tiny_loaded)
    parent = Stream([1, 2, 3, 4, 5])
    steps.admit([parent])
    list(steps.prefill())
    child = Stream(parent.prompt_ids)
    steps.fork([(parent, child)])
    assert steps.live() == [parent, child]
    parent.output_ids.append(50)
    child.output_ids.append(50)
    decoded = steps.decode()
    torch.testing.assert_close(decoded.logits[0], decoded.logits[1], atol=0, rtol=0)
    expected = alone(tiny_loaded, [1, 2, 3, 4, 5, 50])
    torch.testing.assert_close(decoded.logits[0], expected, atol=ATOL, rtol=0)


def test_a_prompt_that_fails_fails_alone(tiny_loaded):
    """A group whose pass raises is retried stream by stream: the bad prompt (an id past the
    vocabulary) goes to on_failure, the good one is prefilled."""
    steps, failures = steps_of(tiny_loaded, max_padding=10.0)
    vocab = tiny_loaded.model.config.vocab_size
    good, bad = Stream([10, 11, 12]), Stream([10, vocab + 5, 12])
    steps.admit([good, bad])
    done = list(steps.prefill())
    assert [p.streams for p in done] == [[good]]
    assert [streams for streams, _ in failures.calls] == [[bad]]
    assert steps.live() == [good]


def test_removed_streams_leave_and_clear_hands_back_the_rest(tiny_loaded):
    """remove drops a stream whether pending or decoding; clear returns every stream left."""
    steps, _ = steps_of(tiny_loaded)
    decoding, leaving, waiting = Stream([1, 2, 3]), Stream([4, 5, 6]), Stream([7, 8, 9])
    steps.admit([decoding, leaving])
    list(steps.prefill())
    steps.admit([waiting])
    steps.remove([leaving])
    assert steps.live() == [waiting, decoding]
    steps.remove([waiting])
    assert steps.live() == [decoding]
    assert steps.clear() == [decoding] and steps.live() == [] and not steps.decoding()


def test_what_the_steps_report():
    """The Hugging Face forward names itself hf throughout and has no preallocated cache."""
    assert (HfSteps.name, HfSteps.quantize, HfSteps.matmul, HfSteps.attention) == (
        "hf",
        "none",
        "hf",
        "hf",
    )
    assert HfSteps.kv_cache is None


class TakesCache:
    def forward(self, input_ids, cache=None): ...


class TakesPastKeyValues:
    def forward(self, input_ids, past_key_values=None): ...


@pytest.mark.parametrize(
    ("model", "name"), [(TakesCache(), "cache"), (TakesPastKeyValues(), "past_key_values")]
)
def test_the_cache_goes_under_the_name_the_model_takes(model, name):
    """A model whose forward takes `cache` gets it so; others as past_key_values."""
    assert cache_kwarg(model) == name
