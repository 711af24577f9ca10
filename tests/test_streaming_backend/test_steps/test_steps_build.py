"""steps/build.py: the compact forward's steps sized from the engine's settings, rebuilt with
another slot length from what they carry (no conversion, no calibration), and the load log's
memory line. Which forward runs, and why, is test_forward_choice.py's."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from streaming_backend.configuration.models import EngineConfig
from streaming_backend.model.numerics import describe
from streaming_backend.steps import slots as slot_steps
from streaming_backend.steps.build import (
    PREFIX_ENTRIES_PER_STREAM,
    Carried,
    build_steps,
)
from streaming_backend.steps.forward_choice import ForwardChoice
from streaming_backend.steps.hf import HfSteps


def no_failures(streams, error):
    raise AssertionError(error)


def compact(loaded, **config):
    return build_steps(loaded, EngineConfig(forward="compact", **config), no_failures)


def test_slots_are_at_most_two_per_stream_at_the_length_asked(tiny_loaded):
    """A budget that holds many slots still gives each live stream one idle prefix entry at
    most: 2 x max_streams slots, each of max_len positions."""
    steps = compact(tiny_loaded, max_streams=3, max_len=64, kv_cache_memory="64MiB")
    assert steps.cache.slots == PREFIX_ENTRIES_PER_STREAM * 3
    assert steps.cache.max_len == 64


def test_a_byte_budget_bounds_the_cache(tiny_loaded):
    """kv_cache_memory as bytes: the cache (scratch slot included) fits in it; twice the budget
    holds more slots."""
    small = compact(tiny_loaded, max_streams=64, max_len=256, kv_cache_memory="1MiB")
    large = compact(tiny_loaded, max_streams=64, max_len=256, kv_cache_memory="2MiB")
    assert 1 <= small.cache.slots < large.cache.slots
    assert small.cache.bytes <= 2**20 and large.cache.bytes <= 2**21


def test_rebuilt_steps_keep_the_model_and_pacing_of_the_carried_ones(tiny_loaded, monkeypatch):
    """Carried: another slot length over the same compact model (no weights converted again),
    the same pacer (no calibration) and no more cache memory than before."""
    config = EngineConfig(forward="compact", max_streams=2, max_len=128, kv_cache_memory="4MiB")
    first = build_steps(tiny_loaded, config, no_failures)
    carried = Carried.of(first)
    assert carried.cache_bytes == (first.cache.slots + 1) * first.cache.slot_bytes

    def no_calibration(self):
        raise AssertionError("carried steps were calibrated again")

    monkeypatch.setattr(slot_steps.SlotSteps, "calibrate", no_calibration)
    again = build_steps(tiny_loaded, dataclasses.replace(config, max_len=32), no_failures, carried)
    assert again.forward.model is first.forward.model and again.pacer is first.pacer
    assert again.cache.max_len == 32 and again.cache.bytes <= carried.cache_bytes


def test_the_memory_line_counts_weights_and_the_kv_cache(tiny_loaded):
    """The steps' memory report: the weights shared through a file and private (the tiny
    model's in memory: none shared), the KV cache reserved (its whole allocation) and touched
    (the calibration wrote a few positions); its log line says the same."""
    steps = compact(tiny_loaded, max_streams=2, max_len=64, kv_cache_memory="8MiB")
    report = steps.memory()
    figures = report.as_dict()
    assert figures["weights"]["shared_bytes"] == 0 < figures["weights"]["private_bytes"]
    assert figures["kv_cache"]["reserved_bytes"] == steps.cache.bytes
    assert 0 < figures["kv_cache"]["touched_bytes"] <= steps.cache.bytes
    pattern = (
        r"memory: weights (\d+) MB shared through a file, (\d+) MB private; "
        r"KV cache (\d+) MiB reserved, (\d+) MiB touched \(resident as positions are written\)"
    )
    line = re.fullmatch(pattern, report.describe())
    shared, private, reserved, _touched = map(int, line.groups())
    assert shared == 0 and private == round(figures["weights"]["private_bytes"] / 1e6)
    assert reserved == pytest.approx(steps.cache.bytes / 2**20, abs=0.5)


def test_a_draft_models_kv_cache_is_counted_in_the_budget(tiny_loaded, tiny_model_dir, caplog):
    """speculative=draft: kv_cache_memory bounds the model's cache and the draft model's
    together (scratch slots included), the draft getting a slot for each of the model's up to
    one a stream; the model has fewer slots than it would alone. The load log and /status's
    forward report name both caches."""
    budget = 2**20
    alone = compact(tiny_loaded, max_streams=64, max_len=256, kv_cache_memory="1MiB")
    with caplog.at_level("INFO", logger="streaming_backend.steps.build"):
        steps = compact(
            tiny_loaded,
            max_streams=64,
            max_len=256,
            kv_cache_memory="1MiB",
            speculative="draft",
            draft_model=str(tiny_model_dir),
        )
    cache, draft = steps.cache, steps.draft_model.cache
    assert cache.bytes + draft.bytes <= budget
    assert 1 <= draft.slots <= cache.slots < alone.cache.slots
    assert draft.max_len == cache.max_len == 256
    choice = ForwardChoice.of(steps)
    assert choice.kv_cache == cache.report() and choice.draft_kv_cache == draft.report()
    assert steps.memory().kv_cache.reserved == cache.bytes + draft.bytes
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compact")]
    assert f"{cache.slots} KV cache slots of 256 positions" in line
    assert f"draft model {steps.draft_model.name}: {draft.slots} KV cache slots of 256" in line


def test_an_ample_budget_gives_the_draft_model_a_slot_a_stream(tiny_loaded, tiny_model_dir):
    """A budget that holds more: one draft slot per stream, the model its two per stream; rebuilt
    with another slot length (the dialogue model's), the same draft weights and no more memory
    for both caches than before."""
    config = EngineConfig(
        forward="compact",
        max_streams=3,
        max_len=128,
        kv_cache_memory="64MiB",
        speculative="draft",
        draft_model=str(tiny_model_dir),
    )
    steps = build_steps(tiny_loaded, config, no_failures)
    assert steps.draft_model.cache.slots == 3
    assert steps.cache.slots == PREFIX_ENTRIES_PER_STREAM * 3
    carried = Carried.of(steps)
    used = (steps.cache.slots + 1) * steps.cache.slot_bytes + steps.draft_model.cache.bytes
    assert carried.cache_bytes == used
    again = build_steps(tiny_loaded, dataclasses.replace(config, max_len=64), no_failures, carried)
    assert again.draft_model.forward.model is steps.draft_model.forward.model
    assert again.draft_model.cache.max_len == again.cache.max_len == 64
    assert again.cache.bytes + again.draft_model.cache.bytes <= carried.cache_bytes


def test_forward_hf_builds_hugging_faces_steps_with_the_prompt_cap(tiny_loaded):
    """forward hf: HfSteps, admitting at most max_prefill_tokens prompt tokens a step."""
    steps = build_steps(
        tiny_loaded, EngineConfig(forward="hf", max_prefill_tokens=300), no_failures
    )
    assert isinstance(steps, HfSteps) and steps.prompt_tokens_per_step == 300


@pytest.mark.cpu_kinds  # what auto picks: our kernels on this CPU
def test_the_kv_cache_dtype_reaches_both_caches_and_the_numerics(tiny_loaded, tiny_model_dir):
    """kv_cache_dtype auto keeps the float32 tiny model's cache (int4 on our kernels, as auto
    quantizes it here) and a draft model's in bfloat16, float32 keeps both in float32; the
    numerics name it, so the fingerprints differ. The Hugging Face forward keeps its cache in
    the model's dtype: bfloat16 is refused with the reason, auto and float32 are taken."""
    draft = {"speculative": "draft", "draft_model": str(tiny_model_dir)}
    built = {
        choice: compact(tiny_loaded, max_len=64, kv_cache_dtype=choice, **draft)
        for choice in ("auto", "float32")
    }
    for choice, dtype in (("auto", torch.bfloat16), ("float32", torch.float32)):
        steps = built[choice]
        assert steps.cache.dtype == steps.draft_model.cache.dtype == dtype
        assert steps.kv_cache_dtype == str(dtype).removeprefix("torch.")
    facts = {choice: describe(tiny_loaded, steps) for choice, steps in built.items()}
    assert (facts["auto"].kv_cache, facts["float32"].kv_cache) == ("bfloat16", "float32")
    assert facts["auto"].fingerprint != facts["float32"].fingerprint
    with pytest.raises(ValueError, match="the Hugging Face forward keeps its KV cache"):
        build_steps(tiny_loaded, EngineConfig(forward="hf", kv_cache_dtype="bfloat16"), no_failures)
    for choice in ("auto", "float32"):
        hf = build_steps(
            tiny_loaded, EngineConfig(forward="hf", kv_cache_dtype=choice), no_failures
        )
        assert hf.kv_cache_dtype == "float32"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, bfloat16"):
        EngineConfig(kv_cache_dtype="fp8")
