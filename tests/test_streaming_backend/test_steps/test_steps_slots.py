"""The compact forward's steps through the engine: prefix reuse and chunked prefill change when
tokens are computed, never which tokens come out."""

from __future__ import annotations

import dataclasses
import functools
import threading

import pytest
from conftest import cancel_after
from families import tiny_config_model

from streaming_backend.engine import Engine, EngineConfig
from streaming_backend.events import FinishReason
from streaming_backend.forward import runner, slots
from streaming_backend.sampling.settings import SamplingSettings
from streaming_backend.steps import slots as step_slots

GREEDY = SamplingSettings(temperature=0, max_tokens=10, ignore_eos=True)
PROMPT = list(range(1000, 1040))  # 40 token ids: above the prefix cache's 16-token minimum


def _run(engine, prompt, settings=GREEDY):
    """(output ids, cached_tokens, events) of one request run to its end."""
    events = list(engine.submit(prompt, settings, logprobs=True))
    assert events[-1].finish_reason is FinishReason.LENGTH, events[-1]
    return [t for e in events for t in e.token_ids], events[0].cached_tokens, events


def _engine(loaded, **config):
    return Engine(loaded, EngineConfig(forward="compact", **config))


def _reference(loaded, prompt, settings=GREEDY):
    """Output ids and logprobs of the prompt alone, with no prefix cache and no chunking."""
    with _engine(loaded, prefix_cache="off") as engine:
        ids, cached, events = _run(engine, prompt, settings)
    assert cached == 0
    return ids, [lp for e in events for lp in e.logprobs]


def _same(events, reference) -> None:
    ids, logprobs = reference
    assert [t for e in events for t in e.token_ids] == ids
    assert [lp for e in events for lp in e.logprobs] == pytest.approx(logprobs, abs=1e-4)


def test_a_follow_up_turn_reuses_the_conversation_so_far(tiny_loaded):
    """A prompt that continues an ended request's prompt and answer prefills only the new part:
    everything but the answer's last token (whose KV was never written) is reused."""
    with _engine(tiny_loaded) as engine:
        first, cached, _ = _run(engine, PROMPT)
        assert cached == 0
        follow_up = PROMPT + first + [1100, 1101, 1102]
        _, cached, events = _run(engine, follow_up)
    assert engine.forward == "compact"
    assert cached == len(PROMPT) + len(first) - 1
    _same(events, _reference(tiny_loaded, follow_up))


def test_prompts_mode_reuses_only_what_prefill_computed(tiny_loaded):
    """prefix_cache=prompts keeps an ended stream's prompt KV, not its answer's."""
    with _engine(tiny_loaded, prefix_cache="prompts") as engine:
        first, _, _ = _run(engine, PROMPT)
        follow_up = PROMPT + first + [1100]
        _, cached, events = _run(engine, follow_up)
    assert cached == len(PROMPT)
    _same(events, _reference(tiny_loaded, follow_up))


def test_the_same_prompt_again_recomputes_only_its_last_token(tiny_loaded):
    """An identical prompt reuses all but its last token: that token's logits start the answer."""
    with _engine(tiny_loaded) as engine:
        first, _, _ = _run(engine, PROMPT)
        again, cached, _ = _run(engine, PROMPT)
    assert cached == len(PROMPT) - 1 and again == first


def test_a_running_streams_prefix_is_copied(tiny_loaded):
    """A request sharing a system prompt with a live stream copies that stream's KV prefix."""
    shared = PROMPT[:30]
    with _engine(tiny_loaded, max_streams=4) as engine:
        long = engine.submit(shared + [7, 8], SamplingSettings(max_tokens=100, ignore_eos=True))
        next(iter(long))  # its prompt is in the cache
        second = shared + [9, 10, 11]
        _, cached, events = _run(engine, second)
        long.cancel()
        list(long)
    assert cached == 30
    _same(events, _reference(tiny_loaded, second))


def test_short_shared_prefixes_are_not_reused(tiny_loaded):
    """Under 16 shared tokens a request prefills from scratch (a copy would not pay)."""
    with _engine(tiny_loaded) as engine:
        _run(engine, PROMPT)
        _, cached, _ = _run(engine, PROMPT[:10] + [5] * 30)
    assert cached == 0


def test_least_recently_used_entries_are_evicted(tiny_loaded):
    """With one stream and two slots, a new unrelated prompt evicts the oldest idle entry."""
    a, b, c = PROMPT, list(range(2000, 2040)), list(range(3000, 3040))
    with _engine(tiny_loaded, max_streams=1) as engine:  # 2 slots: 1 live + 1 idle, or 2 idle
        assert engine._steps.cache.slots == 2
        _run(engine, a)
        _run(engine, b)  # a and b idle
        _run(engine, c)  # evicts a (least recently used)
        assert _run(engine, b)[1] == len(b) - 1  # b survived
        assert _run(engine, a)[1] == 0  # a was evicted


def test_a_cancelled_streams_kv_is_reused_correctly(tiny_loaded):
    """A cancelled stream's slot is kept as an idle entry; a prompt continuing it is exact."""
    with _engine(tiny_loaded) as engine:
        settings = SamplingSettings(max_tokens=200, ignore_eos=True)
        events = cancel_after(engine.submit(PROMPT, settings), 5)
        said = [t for e in events for t in e.token_ids]
        follow_up = PROMPT + said + [42] * 3
        _, cached, after = _run(engine, follow_up)
    assert cached >= len(PROMPT) + 4
    _same(after, _reference(tiny_loaded, follow_up))


def test_sliding_window_rings_give_only_the_prefixes_they_still_hold(tiny_loaded, monkeypatch):
    """Gemma 3's sliding layer in a ring of 11 (window 8, prefill calls of at most 4 tokens): a
    follow-up turn resending the whole conversation reuses all of it; a prompt sharing 30
    tokens with a live stream 40 long, or a prompts-mode entry whose answer ran 9 positions on,
    would need positions the ring overwrote, so nothing is reused (the entry is not even kept).
    Every answer is the one without a cache."""
    chunked = functools.partial(runner.ForwardConfig, window_chunk=4)
    monkeypatch.setattr(runner, "ForwardConfig", chunked)  # steps/build.py's
    gemma = dataclasses.replace(tiny_config_model("gemma3_text"), tokenizer=tiny_loaded.tokenizer)
    prompt = list(range(100, 140))
    with _engine(gemma, max_streams=4) as engine:
        assert engine._steps.cache.rows == (11, 256)
        first, _, _ = _run(engine, prompt)
        follow_up = prompt + first + [200, 201, 202]
        _, cached, events = _run(engine, follow_up)
        assert cached == len(prompt) + len(first) - 1
        _same(events, _reference(gemma, follow_up))
        long = engine.submit(prompt, SamplingSettings(max_tokens=100, ignore_eos=True))
        next(iter(long))  # its prompt is in the cache
        second = prompt[:30] + [7, 8, 9]
        _, cached, events = _run(engine, second)
        long.cancel()
        list(long)
    assert cached == 0
    _same(events, _reference(gemma, second))
    with _engine(gemma, prefix_cache="prompts") as engine:
        first, _, _ = _run(engine, prompt)
        assert len(engine._steps.prefix) == 0  # 49 written, the prompt's 40 out of reach
        _, cached, events = _run(engine, prompt + first + [200])
    assert cached == 0
    _same(events, _reference(gemma, prompt + first + [200]))


def test_long_prompts_are_prefilled_in_chunks_between_decode_steps(tiny_loaded):
    """A 200-token prompt with 16-token chunks: the running stream gets a token each step of its
    prefill (about 13), and the long prompt's answer is what a whole prefill gives."""
    long_prompt = list(range(4000, 4200))
    with _engine(tiny_loaded, prefill_chunk_tokens=16, max_streams=4) as engine:
        running = engine.submit(PROMPT, SamplingSettings(max_tokens=120, ignore_eos=True))
        stream = iter(running)
        next(stream)
        received: list = []
        reader = threading.Thread(target=lambda: received.extend(stream))
        reader.start()
        _, _, events = _run(engine, long_prompt)
        reader.join(60)
    first = events[0]
    during = [e for e in received if first.scheduled_ns < e.emitted_ns < first.emitted_ns]
    assert len(during) >= 200 // 16 - 1
    _same(events, _reference(tiny_loaded, long_prompt))


def test_auto_chunks_follow_the_pacers_budget(tiny_loaded):
    """prefill_chunk_tokens auto: the pacer is calibrated at load, and while a stream decodes
    each step prefills exactly the pacer's budget (or what is left of the prompt)."""
    long_prompt = list(range(4000, 4200))
    with _engine(tiny_loaded, max_streams=4) as engine:
        pacer = engine._steps.pacer
        assert pacer.fixed is None and pacer.seconds_per_token and pacer.seconds_per_step
        budgets, chunks = [], []
        budget, prefill = pacer.budget, engine._steps.forward.prefill
        pacer.budget = lambda: budgets.append(budget()) or budgets[-1]
        engine._steps.forward.prefill = lambda c: chunks.append(len(c[0].tokens)) or prefill(c)
        running = iter(engine.submit(PROMPT, SamplingSettings(max_tokens=200, ignore_eos=True)))
        next(running)
        budgets.clear(), chunks.clear()
        _, _, events = _run(engine, long_prompt)
        running_events = list(running)
    assert running_events[-1].finish_reason is FinishReason.LENGTH
    assert sum(chunks) == len(long_prompt) and len(chunks) == len(budgets)
    left = len(long_prompt)
    for budget_then, chunk in zip(budgets, chunks):
        assert chunk == min(budget_then, left)
        left -= chunk
    _same(events, _reference(tiny_loaded, long_prompt))


def test_calibration_without_a_slope_starts_from_a_bound(tiny_loaded, monkeypatch):
    """A calibration whose prefills give no positive per-token cost, round after round (as a
    tiny model's can: its per-token cost is below the timer's noise), still leaves a
    per-token cost: the fastest larger prefill's average, so the budget is sized in time."""
    timed_sizes = []

    def flat(self, slot, size):  # a larger chunk never costs more: no positive slope
        timed_sizes.append(size)
        return size, 0.010 - size * 1e-6

    monkeypatch.setattr(step_slots.SlotSteps, "_time_prefill", flat)
    with _engine(tiny_loaded, max_streams=4) as engine:
        pacer = engine._steps.pacer
        assert pacer.seconds_per_token == pytest.approx((0.010 - 160e-6) / 160)
        assert pacer.seconds_per_step and pacer.budget() >= 16
    assert len(timed_sizes) == 1 + 3 * 4  # the untimed first, then three rounds of four


def test_hf_forward_has_no_prefix_reuse(tiny_loaded):
    """forward=hf is the baseline: every prompt is prefilled whole, cached_tokens stays 0."""
    with Engine(tiny_loaded, EngineConfig(forward="hf")) as engine:
        first, _, _ = _run(engine, PROMPT)
        assert _run(engine, PROMPT + first)[1] == 0
        assert engine.forward == "hf"


def test_the_memory_report_follows_the_positions_written(tiny_loaded, monkeypatch):
    """With the KV cache a lazily zeroed mapping (as a large one is; slots.LAZY_ZERO_BYTES),
    the engine's memory report, read now each time, counts more of it touched after a long
    prompt than after a short one, never more than is reserved; the weights it reports are
    those of the forward (the tiny model's in memory: private)."""
    monkeypatch.setattr(slots, "LAZY_ZERO_BYTES", 0)
    # float32: the tiny model's positions are few bytes, and in bfloat16 both prompts' can lie
    # in the pages the first touched
    with _engine(tiny_loaded, max_streams=2, kv_cache_dtype="float32") as engine:
        _run(engine, PROMPT)
        before = engine.memory_report()
        _run(engine, list(range(1000, 1200)), dataclasses.replace(GREEDY, max_tokens=2))
        after = engine.memory_report()
    assert before.kv_cache.reserved == after.kv_cache.reserved == engine._steps.cache.bytes
    assert 0 < before.kv_cache.resident < after.kv_cache.resident <= after.kv_cache.reserved
    assert after.weights.shared == 0 < after.weights.private == after.weights.reserved
