"""forward/runner.py, the engine's entry points to the compact forward: what prefill, score and
decode write where, what they return, and what they refuse, on the tiny Llama (float32, CPU).
Its logits against Hugging Face's are test_forward_llama.py's."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from streaming_backend.forward.runner import ForwardConfig, PromptChunk, SlotForward, cache_dtype
from streaming_backend.forward.slots import CacheBudget

CONFIG = ForwardConfig(CacheBudget(bytes=64 << 20), max_len=64, max_slots=4)
PROMPT = [5, 17, 300, 41, 9, 1200, 77]


@pytest.fixture
def forward(tiny_loaded) -> SlotForward:
    return SlotForward.create(tiny_loaded, CONFIG)


def written(forward: SlotForward, slot: int) -> int:
    """How many leading positions of `slot` hold a key in the first layer (non-zero rows)."""
    keys = forward.cache.k[0][forward.cache.physical[slot]]  # [kv_heads, rows, head_dim]
    used = keys.abs().sum(dim=(0, 2)) != 0  # [rows]
    return int(used.nonzero().max()) + 1 if used.any() else 0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [({"quantize": "int3"}, "int3"), ({"matmul": "blas"}, "blas")],
)
def test_a_config_names_only_known_formats(overrides, message):
    """A weight format or matmul it does not know is refused where the config is made."""
    with pytest.raises(ValueError, match=message):
        ForwardConfig(**overrides)


def test_without_compile_the_decode_step_is_eager(forward):
    """compile off: no compile time, and the decode step is the model's own."""
    assert forward.compile_seconds is None and forward._decode_fn is forward.model


def test_prefill_writes_each_prompt_at_its_slots_positions_and_padding_in_scratch(forward):
    """Two prompts of different lengths in one call: each slot's length becomes its prompt's,
    its keys fill exactly those positions, and the shorter row's padding writes only to the
    scratch slot."""
    short, long = forward.cache.allocate(), forward.cache.allocate()
    logits = forward.prefill([PromptChunk(short, PROMPT[:3]), PromptChunk(long, PROMPT)])
    assert logits.shape == (2, forward.model.shape.vocab) and logits.dtype == torch.float32
    assert forward.cache.lengths[short] == 3 and forward.cache.lengths[long] == len(PROMPT)
    assert written(forward, short) == 3 and written(forward, long) == len(PROMPT)
    assert written(forward, forward.cache.scratch) > 0


def test_a_prompt_in_two_chunks_gives_the_logits_of_one(forward):
    """Chunks are appended at the slot's next positions: two chunks end where one would."""
    whole, split = forward.cache.allocate(), forward.cache.allocate()
    expected = forward.prefill([PromptChunk(whole, PROMPT)])
    forward.prefill([PromptChunk(split, PROMPT[:4])])
    got = forward.prefill([PromptChunk(split, PROMPT[4:])])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert forward.cache.lengths[split] == forward.cache.lengths[whole] == len(PROMPT)


def test_score_gives_every_positions_next_token_logits(forward):
    """score's row i is what a prefill of the prompt's first i + 1 tokens returns."""
    scored = forward.cache.allocate()
    rows = forward.score(PromptChunk(scored, PROMPT))
    assert rows.shape == (len(PROMPT), forward.model.shape.vocab)
    assert forward.cache.lengths[scored] == len(PROMPT)
    for end in (1, 4, len(PROMPT)):
        slot = forward.cache.allocate()
        prefix = forward.prefill([PromptChunk(slot, PROMPT[:end])])[0]
        torch.testing.assert_close(rows[end - 1], prefix, atol=1e-5, rtol=0)
        forward.cache.free(slot)


def test_decode_appends_one_position_per_slot(forward):
    """A decode step writes each slot's token at its next position and returns its logits; its
    rows are those of the same token prefilled."""
    a, b = forward.cache.allocate(), forward.cache.allocate()
    forward.prefill([PromptChunk(a, PROMPT[:5]), PromptChunk(b, PROMPT[:2])])
    logits = forward.decode([b, a], [700, 701])
    assert [forward.cache.lengths[s] for s in (a, b)] == [6, 3]
    reference = forward.cache.allocate()
    expected = forward.prefill([PromptChunk(reference, [*PROMPT[:2], 700])])[0]
    torch.testing.assert_close(logits[0], expected, atol=1e-5, rtol=0)


def test_the_decode_index_is_one_tensor_of_tokens_slots_and_positions(forward):
    """decode_index: [3, B] long (the step's one host-to-device copy); decode_rows views it."""
    index = forward.decode_index([7, 8], [2, 0], [10, 3])
    assert index.dtype == torch.long and index.tolist() == [[7, 8], [2, 0], [10, 3]]
    rows = forward.decode_rows(index)
    assert rows.tokens.tolist() == [[7], [8]] and rows.positions.tolist() == [[10], [3]]
    assert rows.write_slots.tolist() == [[2], [0]] and rows.read_slots.tolist() == [2, 0]


def test_scratch_rows_touch_only_the_scratch_slot(forward):
    """Warm-up rows write the scratch slot at position 0 and leave every stream's keys alone."""
    slot = forward.cache.allocate()
    forward.prefill([PromptChunk(slot, PROMPT)])
    before = [k.clone() for k in forward.cache.k]
    rows = forward.scratch_rows(3)
    assert set(rows.write_slots.flatten().tolist()) == {forward.cache.scratch}
    forward.model(forward.cache.k, forward.cache.v, rows, forward.cache.max_len)
    place = forward.cache.physical[slot]
    for old, new in zip(before, forward.cache.k):
        assert torch.equal(old[place], new[place])


def test_bad_calls_are_refused_and_change_nothing(forward):
    """No chunks, tokens that do not match the slots, or a step past the context raise
    ValueError before anything is written."""
    slot = forward.cache.allocate()
    forward.prefill([PromptChunk(slot, PROMPT)])
    with pytest.raises(ValueError, match="at least one chunk"):
        forward.prefill([])
    with pytest.raises(ValueError, match="1 slots but 2 tokens"):
        forward.decode([slot], [1, 2])
    with pytest.raises(ValueError, match="twice"):
        forward.prefill([PromptChunk(slot, [1]), PromptChunk(slot, [2])])
    with pytest.raises(ValueError, match="context of 64"):
        forward.prefill([PromptChunk(slot, [1] * (64 - len(PROMPT) + 1))])
    with pytest.raises(ValueError, match="empty"):
        forward.score(PromptChunk(slot, []))
    assert forward.cache.lengths[slot] == len(PROMPT)


@pytest.mark.parametrize("quantize", ["none", "int8", "int4"])
def test_verify_gives_each_tokens_decode_logits_bit_for_bit(tiny_loaded, quantize):
    """One verify call of a slot's latest token and 4 drafted after it, beside another slot's
    lone token: every token's logits are exactly those of decode steps one token at a time,
    and each slot's length grows by its tokens (speculative decoding's verification)."""
    forward = SlotForward.create(
        tiny_loaded, ForwardConfig(**{**CONFIG.__dict__, "quantize": quantize})
    )
    one, two = forward.cache.allocate(), forward.cache.allocate()
    forward.prefill([PromptChunk(one, PROMPT), PromptChunk(two, PROMPT[:4])])
    tokens = [11, 2000, 3, 45, 678]
    stepped = [forward.decode([one, two], [token, 99]) for token in tokens]
    forward.cache.truncate(one, len(PROMPT))
    forward.cache.truncate(two, 4)
    logits = forward.verify([one, two], [tokens, [99]])
    assert logits.shape == (6, forward.model.shape.vocab)
    for at, step in enumerate(stepped):
        assert torch.equal(logits[at], step[0]), at
    assert torch.equal(logits[5], stepped[0][1])
    assert forward.cache.lengths[one] == len(PROMPT) + 5 and forward.cache.lengths[two] == 5


def test_bad_verify_calls_are_refused(forward):
    """A slot without tokens, lists that do not match the slots, a slot named twice, tokens
    past the slot's room: refused with a message."""
    slot = forward.cache.allocate()
    forward.prefill([PromptChunk(slot, PROMPT)])
    with pytest.raises(ValueError, match="no token"):
        forward.verify([slot], [[]])
    with pytest.raises(ValueError, match="token lists"):
        forward.verify([slot], [[1], [2]])
    with pytest.raises(ValueError, match="twice"):
        forward.verify([slot, slot], [[1], [2]])
    with pytest.raises(ValueError, match="exceed"):
        forward.verify([slot], [[1] * 64])
    assert forward.cache.lengths[slot] == len(PROMPT)


@pytest.mark.cpu_kinds  # what auto picks: the C attention kernels' build on this CPU
def test_auto_keeps_a_float32_models_cache_in_bfloat16_on_the_kernels(tiny_loaded):
    """A float32 model on the C kernels (int4, as served): auto keeps keys and values in
    bfloat16 (half the bytes of float32 for the same slots), float32 keeps them as they are,
    and the logits of the two stay close (keys and values rounded once)."""
    int4 = replace(CONFIG, quantize="int4")
    forwards = {
        choice: SlotForward.create(tiny_loaded, replace(int4, kv_cache_dtype=choice))
        for choice in ("auto", "float32", "bfloat16")
    }
    assert forwards["auto"].model.native
    dtypes = {choice: f.cache.dtype for choice, f in forwards.items()}
    assert dtypes == {"auto": torch.bfloat16, "float32": torch.float32, "bfloat16": torch.bfloat16}
    assert 2 * forwards["auto"].cache.bytes == forwards["float32"].cache.bytes
    assert forwards["auto"].cache.report()["dtype"] == "bfloat16"
    logits = {}
    for choice in ("auto", "float32"):
        forward = forwards[choice]
        slot = forward.cache.allocate()
        steps = [forward.prefill([PromptChunk(slot, PROMPT)])]
        steps += [forward.decode([slot], [token]) for token in (20, 30, 40)]
        logits[choice] = torch.cat(steps)
    ours, exact = logits["auto"], logits["float32"]
    assert not torch.equal(ours, exact)  # the cache's rounding reaches the logits
    close = torch.nn.functional.cosine_similarity(ours, exact, dim=-1)
    assert close.min() > 0.999, close


def test_a_cache_in_another_dtype_where_torch_reads_it_is_refused(tiny_loaded):
    """Where torch's attention reads the cache (unquantized or on torch's weight-only matmuls
    the native layers are off; a compiled step), auto keeps the model's dtype and bfloat16 is
    refused, naming why; float32, the model's own, is taken."""
    assert SlotForward.create(tiny_loaded, CONFIG).cache.dtype == torch.float32  # unquantized
    aten = replace(CONFIG, quantize="int8", matmul="aten")
    assert SlotForward.create(tiny_loaded, aten).cache.dtype == torch.float32
    with pytest.raises(ValueError, match="kv_cache_dtype bfloat16: .*C attention kernels"):
        SlotForward.create(tiny_loaded, replace(aten, kv_cache_dtype="bfloat16"))
    model = SlotForward.create(tiny_loaded, replace(CONFIG, quantize="int4")).model
    assert model.native
    compiled = replace(CONFIG, quantize="int4", compile=True)
    assert cache_dtype(compiled, torch.float32, model) == torch.float32
    with pytest.raises(ValueError, match="use kv_cache_dtype auto"):
        cache_dtype(replace(compiled, kv_cache_dtype="bfloat16"), torch.float32, model)
    assert cache_dtype(replace(compiled, kv_cache_dtype="float32"), torch.float32, model) == (
        torch.float32
    )
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, bfloat16"):
        cache_dtype(replace(CONFIG, kv_cache_dtype="fp8"), torch.float32, model)
