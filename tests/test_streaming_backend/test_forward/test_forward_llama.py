"""The compact forward over the slot cache gives the Hugging Face forward's logits."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from families import COMPACT_FAMILIES, LONGROPE, PARTIAL_ROPE, SLIDING, tiny_config_model

from streaming_backend.forward.family import FAMILIES
from streaming_backend.forward.runner import ForwardConfig, PromptChunk, SlotForward
from streaming_backend.forward.slots import CacheBudget
from streaming_backend.model.loading import LoadedModel, _context_length, load_model

# bf16 logits of the default model are 17-36 in size, where bf16 steps by 0.125-0.25; measured
# differences from Hugging Face reached 0.72 (3 prompts x 9 steps, 2025-11-30)
BF16_ATOL = 1.0
# How much further from the float32 model ours in bf16 may be than Hugging Face's in bf16 (root
# mean square over all logits of 3 prompts x 9 steps): measured 0.21 against 0.18 (1.18x), and
# 0.16 with torch's attention; bf16 rounding of 30 layers, not one path's bias, decides which
# is nearer on a given prompt (2026-12-02)
BF16_RMS_RATIO = 1.5
FP32_ATOL = 1e-4  # logits of the tiny model are O(1); fp32 reduction order differs a little
CONFIG = ForwardConfig(CacheBudget(bytes=64 << 20), max_len=128, max_slots=4, compile=False)


@pytest.fixture
def tiny(tiny_model_dir) -> LoadedModel:
    """A fresh copy of the tiny Llama (the forward re-points its weights at fused tensors)."""
    return load_model(str(tiny_model_dir), dtype="float32", device="cpu")


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Random token ids of the given lengths."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1000, (n,), generator=generator).tolist() for n in lengths]


@torch.inference_mode()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """Hugging Face logits [len(ids), V] (fp32) of one sequence, no cache, no padding."""
    return model(input_ids=torch.tensor([ids])).logits[0].float()


def test_prefill_of_rows_of_different_lengths_matches_hf(tiny):
    """One prefill of three prompts of different lengths gives each prompt's own last logits."""
    forward = SlotForward.create(tiny, CONFIG)
    rows = prompts([5, 17, 9])
    slots = [forward.cache.allocate() for _ in rows]
    logits = forward.prefill([PromptChunk(s, p) for s, p in zip(slots, rows)])
    assert logits.shape == (3, tiny.model.config.vocab_size) and logits.dtype == torch.float32
    for row, ids in enumerate(rows):
        torch.testing.assert_close(
            logits[row], hf_logits(tiny.model, ids)[-1], atol=FP32_ATOL, rtol=0
        )
    assert [forward.cache.lengths[s] for s in slots] == [5, 17, 9]


def greedy_run(forward: SlotForward, slots: list[int], steps: int, first: torch.Tensor):
    """Decode `steps` greedy tokens for `slots` -> (tokens per row, logits per step)."""
    token, tokens, logits_seen = first, [], []
    for _ in range(steps):
        tokens.append(token)
        logits = forward.decode(slots, token.tolist())
        logits_seen.append(logits)
        token = logits.argmax(-1)
    return torch.stack(tokens, dim=1).tolist(), logits_seen


def test_decode_steps_match_hf(tiny):
    """Decode steps of rows at different positions match Hugging Face on the whole sequence."""
    forward = SlotForward.create(tiny, CONFIG)
    rows = prompts([3, 12, 7], seed=1)
    slots = [forward.cache.allocate() for _ in rows]
    first = forward.prefill([PromptChunk(s, p) for s, p in zip(slots, rows)]).argmax(-1)
    generated, step_logits = greedy_run(forward, slots, 6, first)
    for row, ids in enumerate(rows):
        reference = hf_logits(tiny.model, ids + generated[row])  # [len + 6, V]
        for step, logits in enumerate(step_logits):
            expected = reference[len(ids) + step]
            torch.testing.assert_close(logits[row], expected, atol=FP32_ATOL, rtol=0)


def test_freed_slot_is_reused_without_its_old_keys(tiny):
    """A slot freed after a long prompt serves a short one as if it were new."""
    forward = SlotForward.create(tiny, CONFIG)
    slot = forward.cache.allocate()
    forward.prefill([PromptChunk(slot, prompts([60], seed=2)[0])])
    forward.decode([slot], [5])
    forward.cache.free(slot)
    again = forward.cache.allocate()
    assert again == slot and forward.cache.lengths[again] == 0
    short = prompts([4], seed=3)[0]
    first = forward.prefill([PromptChunk(again, short)]).argmax(-1)
    generated, step_logits = greedy_run(forward, [again], 3, first)
    reference = hf_logits(tiny.model, short + generated[0])
    for step, logits in enumerate(step_logits):
        torch.testing.assert_close(logits[0], reference[4 + step], atol=FP32_ATOL, rtol=0)


@pytest.fixture(params=COMPACT_FAMILIES)
def family_model(request, tiny) -> LoadedModel:
    """The tiny Llama, and a tiny model of every other family on the compact forward."""
    return tiny if request.param == "llama" else tiny_config_model(request.param)


def test_chunked_prefill_equals_whole_prefill(family_model):
    """A prompt prefilled in chunks (sharing calls with another slot) ends as a whole one."""
    tiny = family_model
    forward = SlotForward.create(tiny, CONFIG)
    prompt, other = prompts([30, 11], seed=4)
    whole, chunked, neighbour = (forward.cache.allocate() for _ in range(3))
    expected = forward.prefill([PromptChunk(whole, prompt)])
    forward.prefill([PromptChunk(chunked, prompt[:7]), PromptChunk(neighbour, other[:5])])
    forward.prefill([PromptChunk(neighbour, other[5:]), PromptChunk(chunked, prompt[7:20])])
    logits = forward.prefill([PromptChunk(chunked, prompt[20:])])
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
    step = forward.decode([whole, chunked, neighbour], [9, 9, 9])
    torch.testing.assert_close(step[1], step[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(
        step[2], hf_logits(tiny.model, other + [9])[-1], atol=FP32_ATOL, rtol=0
    )


def test_prefill_after_a_copied_prefix_equals_whole_prefill(family_model):
    """A slot given another slot's first positions (as a prefix cache would) continues from them."""
    forward = SlotForward.create(family_model, CONFIG)
    first, second = prompts([25, 8], seed=7)
    donor, whole, reuser = (forward.cache.allocate() for _ in range(3))
    forward.prefill([PromptChunk(donor, first)])
    expected = forward.prefill([PromptChunk(whole, first[:20] + second)])
    forward.cache.copy_prefix(donor, reuser, 20)
    torch.testing.assert_close(
        forward.prefill([PromptChunk(reuser, second)]), expected, atol=1e-5, rtol=0
    )
    assert forward.cache.lengths[reuser] == 28


# every family beyond Llama as its tiny model shows it, and the RoPE and window variants
FAMILY_CASES = [
    ("qwen2", SLIDING),
    ("mistral", {"sliding_window": 8}),
    ("qwen3", {}),
    ("granite", {}),
    ("olmo2", {}),
    ("smollm3", {}),
    ("phi3", LONGROPE),
    ("phi3", PARTIAL_ROPE),
    ("gemma2", {}),
    ("gemma3_text", {}),
    ("qwen3_moe", {}),
    ("olmoe", {}),
]


@pytest.mark.parametrize(
    "kind, overrides",
    [*FAMILY_CASES, ("qwen2", {}), ("qwen3", SLIDING), ("phi3", {"sliding_window": 8})],
)
def test_other_families_match_hf(kind, overrides):
    """Every family's differences from Llama (FAMILIES; tests/families.py makes each visible in
    a tiny model), and sliding windows, LongRoPE, match Hugging Face."""
    loaded = tiny_config_model(kind, **overrides)
    forward = SlotForward.create(loaded, CONFIG)
    rows = prompts([20, 6], seed=5)
    slots = [forward.cache.allocate() for _ in rows]
    first = forward.prefill([PromptChunk(s, p) for s, p in zip(slots, rows)]).argmax(-1)
    generated, step_logits = greedy_run(forward, slots, 4, first)
    for row, ids in enumerate(rows):
        reference = hf_logits(loaded.model, ids + generated[row])
        for step, logits in enumerate(step_logits):
            torch.testing.assert_close(
                logits[row], reference[len(ids) + step], atol=FP32_ATOL, rtol=0
            )


@pytest.mark.parametrize("kind, overrides", [("llama", None), *FAMILY_CASES])
def test_one_stream_decodes_as_hf_and_as_a_batch_row(kind, overrides, tiny):
    """A slot decoding alone (the single-row step: keys viewed in place, no mask) matches
    Hugging Face, sliding windows included, and the same slot decoded beside another."""
    loaded = tiny if overrides is None else tiny_config_model(kind, **overrides)
    forward = SlotForward.create(loaded, CONFIG)
    ids = prompts([20], seed=6)[0]
    alone, partner = forward.cache.allocate(), forward.cache.allocate()
    first = forward.prefill([PromptChunk(alone, ids)]).argmax(-1)
    generated, alone_logits = greedy_run(forward, [alone], 12, first)
    reference = hf_logits(loaded.model, ids + generated[0])
    forward.cache.truncate(alone, len(ids))  # the same steps again, now as row 0 of two
    forward.prefill([PromptChunk(partner, prompts([9], seed=7)[0])])
    for step, logits in enumerate(alone_logits):
        expected = reference[len(ids) + step]
        torch.testing.assert_close(logits[0], expected, atol=FP32_ATOL, rtol=0)
        together = forward.decode([alone, partner], [generated[0][step], 3])[0]
        torch.testing.assert_close(together, logits[0], atol=FP32_ATOL, rtol=0)


@pytest.mark.parametrize(
    "kind, overrides",
    [
        ("llama", None),
        ("qwen2", SLIDING),
        ("qwen3", {}),
    ],
)
def test_decode_of_scattered_slots_matches_hf(kind, overrides, tiny):
    """A step of slots further back in the cache, in any order, matches Hugging Face, and so do
    the slots before them, stepped next."""
    loaded = tiny if overrides is None else tiny_config_model(kind, **overrides)
    forward = SlotForward.create(loaded, CONFIG)
    rows = prompts([6, 14, 3, 11], seed=8)
    slots = [forward.cache.allocate() for _ in rows]
    first = forward.prefill([PromptChunk(s, p) for s, p in zip(slots, rows)]).argmax(-1)
    picked = [3, 1]  # slots 3 and 1, in that order: slot 3 swaps with slot 0
    generated, step_logits = greedy_run(forward, [slots[r] for r in picked], 5, first[picked])
    for column, row in enumerate(picked):
        reference = hf_logits(loaded.model, rows[row] + generated[column])
        for step, logits in enumerate(step_logits):
            expected = reference[len(rows[row]) + step]
            torch.testing.assert_close(logits[column], expected, atol=FP32_ATOL, rtol=0)
    generated, step_logits = greedy_run(forward, [slots[0], slots[2]], 4, first[[0, 2]])
    for column, row in enumerate([0, 2]):
        reference = hf_logits(loaded.model, rows[row] + generated[column])
        for step, logits in enumerate(step_logits):
            expected = reference[len(rows[row]) + step]
            torch.testing.assert_close(logits[column], expected, atol=FP32_ATOL, rtol=0)


# bfloat16, every family: our logits against Hugging Face's in bfloat16, as a fraction of the
# largest logit; measured 0.04-0.9 % (2026-12-03), where one bfloat16 step is 0.4 %
BF16_FAMILY_TOLERANCE = 0.02


@pytest.mark.parametrize("kind", COMPACT_FAMILIES)
def test_every_family_in_bf16_matches_hf(kind):
    """In bfloat16, a prompt's logits stay within BF16_FAMILY_TOLERANCE of Hugging Face's."""
    loaded = tiny_config_model(kind, torch.bfloat16)
    forward = SlotForward.create(loaded, CONFIG)
    assert set(FAMILIES) == set(COMPACT_FAMILIES)
    ids = prompts([20], seed=9)[0]
    ours = forward.prefill([PromptChunk(forward.cache.allocate(), ids)])[0]
    theirs = hf_logits(loaded.model, ids)[-1]
    assert (ours - theirs).abs().max() <= BF16_FAMILY_TOLERANCE * theirs.abs().max()


def test_longrope_bounds_the_context_to_its_original_one():
    """A LongRoPE model (Phi-3/4) serves the positions of its original context, where its
    tables are fixed; its forward, its cache and the engine's context all stop there."""
    loaded = tiny_config_model("phi3", **LONGROPE)
    forward = SlotForward.create(loaded, dataclasses.replace(CONFIG, max_len=None))
    assert forward.model.shape.max_positions == forward.cache.max_len == 64
    assert _context_length(loaded.model, None) == 64
    assert _context_length(tiny_config_model("phi3").model, None) == 256


def test_bad_calls_are_refused(tiny):
    """Empty chunks, a slot twice in one step, and running past the context raise ValueError."""
    forward = SlotForward.create(tiny, CONFIG)
    slot = forward.cache.allocate()
    with pytest.raises(ValueError, match="empty"):
        forward.prefill([PromptChunk(slot, [])])
    with pytest.raises(ValueError, match="twice"):
        forward.decode([slot, slot], [1, 2])
    with pytest.raises(ValueError, match="context of 128"):
        forward.prefill([PromptChunk(slot, [1] * 129)])
    assert forward.cache.lengths[slot] == 0


@pytest.mark.slow  # compiling takes one to several minutes on a small CPU
def test_compiled_decode_matches_eager(tiny, caplog):
    """The torch.compile'd decode step gives the eager step's logits, and logs its compile time."""
    caplog.set_level(logging.INFO, logger="streaming_backend.forward.compiled")
    compiled = SlotForward.create(tiny, ForwardConfig(CONFIG.budget, 128, 4, compile=True))
    eager = SlotForward.create(tiny, CONFIG)
    assert compiled.compile_seconds is not None and "compiled the decode step" in caplog.text
    rows = prompts([9, 3, 14], seed=6)
    outputs = []
    for forward in (eager, compiled):
        slots = [forward.cache.allocate() for _ in rows]
        first = forward.prefill([PromptChunk(s, p) for s, p in zip(slots, rows)]).argmax(-1)
        outputs.append(greedy_run(forward, slots, 5, first))
    assert outputs[0][0] == outputs[1][0]
    for expected, logits in zip(outputs[0][1], outputs[1][1]):
        torch.testing.assert_close(logits, expected, atol=FP32_ATOL, rtol=0)


def test_failed_compilation_falls_back_to_eager(tiny, caplog):
    """A torch.compile backend that fails leaves the eager step and a warning."""
    from streaming_backend.forward import compiled

    def broken_backend(graph, example_inputs):
        raise RuntimeError("no compiler here")

    forward = SlotForward.create(tiny, CONFIG)
    step, seconds = compiled.compile_decode(
        forward.model, forward.cache, forward.scratch_rows, backend=broken_backend
    )
    assert step is forward.model and seconds is None
    assert "decoding eagerly" in caplog.text


@torch.inference_mode()
def hf_greedy_steps(model, ids: list[int], steps: int) -> list[torch.Tensor]:
    """Hugging Face's own incremental decode (DynamicCache): next-token logits [V] per step."""
    from transformers import DynamicCache

    cache = DynamicCache()
    out = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
    logits = [out.logits[0, -1].float()]
    for _ in range(steps):
        token = logits[-1].argmax()
        out = model(input_ids=token.view(1, 1), cache=cache, use_cache=True)
        logits.append(out.logits[0, -1].float())
    return logits


@torch.inference_mode()
def hf_forced_steps(model, ids: list[int], tokens: list[torch.Tensor]) -> list[torch.Tensor]:
    """Hugging Face's incremental decode fed `tokens`: next-token logits [V] (fp32) per step."""
    from transformers import DynamicCache

    cache = DynamicCache()
    out = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
    logits = [out.logits[0, -1].float()]
    for token in tokens:
        out = model(input_ids=token.view(1, 1), cache=cache, use_cache=True)
        logits.append(out.logits[0, -1].float())
    return logits


def rms(differences: list[torch.Tensor]) -> float:
    """Root mean square over every value of some tensors."""
    return torch.stack(differences).pow(2).mean().sqrt().item()


@pytest.mark.slow
def test_default_model_in_bf16_matches_hf(default_model_dir):
    """On the default model in bf16, prefill and decode logits stay as near the float32 model
    as Hugging Face's own bf16 forward does, and every greedy token is the float32 model's or
    one it rates within bf16 noise of it."""
    from conftest import chat_prompts

    from streaming_backend.prompts import encode_prompt

    exact = load_model(str(default_model_dir), dtype="float32", device="cpu")
    loaded = load_model(str(default_model_dir), dtype="bfloat16", device="cpu")
    prompts_ids = [encode_prompt(loaded.tokenizer, messages=m) for m in chat_prompts()[:3]]
    references = [hf_greedy_steps(exact.model, ids, 8) for ids in prompts_ids]  # float32
    tokens = [[logits.argmax() for logits in ref[:-1]] for ref in references]
    hf_bf16 = [hf_forced_steps(loaded.model, ids, t) for ids, t in zip(prompts_ids, tokens)]
    forward = SlotForward.create(loaded, ForwardConfig(CONFIG.budget, 512, 4, compile=False))
    slots = [forward.cache.allocate() for _ in prompts_ids]
    logits = forward.prefill([PromptChunk(s, ids) for s, ids in zip(slots, prompts_ids)])
    ours = [logits]
    for step in range(8):  # the float32 model's greedy tokens, so every side sees one sequence
        ours.append(forward.decode(slots, [t[step].item() for t in tokens]))
    ours_off, hf_off = [], []
    for step, logits in enumerate(ours):
        for row, ref in enumerate(references):
            ours_off.append(logits[row] - ref[step])
            hf_off.append(hf_bf16[row][step] - ref[step])
            assert ours_off[-1].abs().max() < 2 * BF16_ATOL, (step, row)
            chosen = logits[row].argmax()
            assert ref[step][chosen] >= ref[step].max() - BF16_ATOL, (step, row)
    assert rms(ours_off) <= BF16_RMS_RATIO * rms(hf_off), (rms(ours_off), rms(hf_off))
