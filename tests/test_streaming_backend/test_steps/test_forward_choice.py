"""Which forward a model runs on and why (steps/forward_choice.py), as steps/build.py picks it:
the compact forward with its kernels, else Hugging Face's with the reason."""

from __future__ import annotations

import json

import pytest
from families import tiny_config_model

from streaming_backend.configuration.models import EngineConfig
from streaming_backend.dialogue.generation import Generator
from streaming_backend.forward.family import FAMILIES, UnsupportedModel
from streaming_backend.model.loading import LoadedModel
from streaming_backend.steps.build import build_steps
from streaming_backend.steps.forward_choice import ForwardChoice
from streaming_backend.steps.hf import ASKED_FOR

OUTSIDE = "stablelm"  # a family the compact forward does not run (LayerNorm, partial RoPE)


def no_failures(streams, error):
    """on_failure for steps that never prefill here."""
    raise AssertionError(error)


@pytest.fixture(scope="module")
def outside_loaded() -> LoadedModel:
    """A tiny random model of a family outside forward/family.py's FAMILIES, on the CPU."""
    assert OUTSIDE not in FAMILIES  # else pick another family for these tests
    return tiny_config_model(OUTSIDE)


def test_the_compact_forward_names_its_weights_and_kernels(tiny_loaded):
    """A family of the compact forward runs on it: no reason to give, and the weight format,
    matmul and attention it runs with, and its KV cache (no rings: the tiny Llama has no
    sliding window; bfloat16, as auto keeps a float32 model's on our kernels), as JSON."""
    steps = build_steps(tiny_loaded, EngineConfig(quantize="int4"), no_failures)
    choice = ForwardChoice.of(steps)
    cache = steps.cache
    kv_cache = {"slots": cache.slots, "positions": cache.max_len, "dtype": "bfloat16"}
    kv_cache |= {"bytes": cache.bytes, "ring_layers": 0, "ring_rows": []}
    assert choice == ForwardChoice("compact", None, "int4", steps.matmul, steps.attention, kv_cache)
    assert choice.matmul not in ("hf", "dense") and choice.attention != "hf"
    assert json.loads(json.dumps(choice.as_dict())) == {
        "forward": "compact",
        "why": None,
        "quantize": "int4",
        "matmul": steps.matmul,
        "attention": steps.attention,
        "kv_cache": kv_cache,
        "draft_kv_cache": None,
    }


def test_a_family_outside_the_compact_forward_runs_on_hf_and_says_why(outside_loaded):
    """forward auto: a family the compact forward refuses runs on Hugging Face's, and the choice
    carries the refusal, which names the family."""
    choice = ForwardChoice.of(build_steps(outside_loaded, EngineConfig(), no_failures))
    assert choice.forward == "hf" and choice.quantize == "none"
    assert choice.matmul == choice.attention == "hf"
    assert choice.why.startswith("the compact forward supports llama")
    assert choice.why.endswith(f"not {OUTSIDE!r}")


def test_forward_hf_says_it_was_asked_for(tiny_loaded):
    """forward hf runs Hugging Face's forward even for a compact family, and says it was asked."""
    choice = ForwardChoice.of(build_steps(tiny_loaded, EngineConfig(forward="hf"), no_failures))
    assert (choice.forward, choice.why, choice.kv_cache) == ("hf", ASKED_FOR, None)


def test_forward_compact_refuses_a_family_outside_it_with_the_reason(outside_loaded):
    """forward compact asks for no fallback: both models' loads fail, naming the family."""
    expected = rf"forward compact was asked for, but the compact .* not {OUTSIDE!r}"
    with pytest.raises(UnsupportedModel, match=expected):
        build_steps(outside_loaded, EngineConfig(forward="compact"), no_failures)
    with pytest.raises(UnsupportedModel, match=expected):  # the dialogue model's, on the same steps
        Generator(outside_loaded, EngineConfig(forward="compact"), 1)
    assert Generator(outside_loaded, EngineConfig(forward="auto"), 1).name == "hf"
