"""Sliding-window layers in rings (forward/slots.py): the compact forward keeps a windowed layer's
window plus a prefill call's spare, position p in row p mod rows, and still gives Hugging Face's
logits on every path, for prompts and answers many windows long, prefilled whole or in chunks,
continued from a reused or copied slot; a reuse whose window a ring no longer holds is refused."""

from __future__ import annotations

import pytest
import torch
from families import tiny_config_model

from streaming_backend.forward.runner import ForwardConfig, PromptChunk, SlotForward
from streaming_backend.forward.slots import CacheBudget

FP32_ATOL = 1e-4  # as test_forward_llama's: logits of the tiny models are O(1)
WINDOW = 8  # the tiny gemma2 and gemma3_text models' (tests/families.py), and mistral's here
WINDOWED = {  # a sliding layer and a full one (Gemma); every layer sliding (Mistral)
    "gemma2": {},
    "gemma3_text": {},
    "mistral": {"sliding_window": WINDOW},
}
PROMPT, ANSWER = 40, 30  # 5 windows of prompt; 30 decode steps wrap a ring of 10 three times


def ring_forward(loaded, chunk: int, **config) -> SlotForward:
    """The compact forward with sliding-window layers in rings of WINDOW + chunk - 1 rows."""
    config = ForwardConfig(
        CacheBudget(bytes=64 << 20), max_len=128, max_slots=4, window_chunk=chunk, **config
    )
    forward = SlotForward.create(loaded, config)
    assert WINDOW + chunk - 1 in forward.cache.rows and forward.cache.chunk_limit == chunk
    return forward


def ids(n: int, seed: int = 0) -> list[int]:
    """Random token ids."""
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def hf_logits(loaded, tokens: list[int]) -> torch.Tensor:
    """Hugging Face's logits [len(tokens), V] (fp32) of one sequence."""
    return loaded.model(input_ids=torch.tensor([tokens])).logits[0].float()


def decode_greedy(forward: SlotForward, slots: list[int], first: list[int], steps: int):
    """`steps` greedy decode steps of `slots` -> (tokens fed per slot, logits [steps, B, V])."""
    fed, seen, tokens = [[] for _ in slots], [], first
    for _ in range(steps):
        for row, token in enumerate(tokens):
            fed[row].append(token)
        seen.append(forward.decode(slots, tokens))
        tokens = seen[-1].argmax(-1).tolist()
    return fed, torch.stack(seen)


def assert_decoded_as_hf(loaded, prompts: list[list[int]], fed, logits) -> None:
    """Each row's decode logits are Hugging Face's at the same positions."""
    for row, prompt in enumerate(prompts):
        reference = hf_logits(loaded, prompt + fed[row])[len(prompt) :]
        torch.testing.assert_close(logits[:, row], reference, atol=FP32_ATOL, rtol=0)


@pytest.mark.parametrize("split", ["whole", 5, 13])
@pytest.mark.parametrize("chunk", [3, 8])
@pytest.mark.parametrize("kind", WINDOWED)
def test_prompts_and_answers_many_windows_long_match_hf(kind, chunk, split):
    """A prompt of 5 windows prefilled whole (run as calls of `chunk` tokens) or in chunks
    smaller and larger than the window, then 30 decode steps past several wraps of the ring:
    every logit is Hugging Face's."""
    loaded = tiny_config_model(kind, **WINDOWED[kind])
    forward = ring_forward(loaded, chunk)
    prompt = ids(PROMPT)
    reference = hf_logits(loaded, prompt)
    slot = forward.cache.allocate()
    size = PROMPT if split == "whole" else split
    for start in range(0, PROMPT, size):
        end = min(start + size, PROMPT)
        logits = forward.prefill([PromptChunk(slot, prompt[start:end])])
        torch.testing.assert_close(logits[0], reference[end - 1], atol=FP32_ATOL, rtol=0)
    fed, logits = decode_greedy(forward, [slot], logits.argmax(-1).tolist(), ANSWER)
    assert_decoded_as_hf(loaded, [prompt], fed, logits)


@pytest.mark.parametrize("path", ["torch", "fixed_shapes"])
@pytest.mark.parametrize("kind", WINDOWED)
def test_the_torch_paths_read_rings_as_hf(kind, path):
    """Without the C kernel (torch's attention, token by token) and on the decode step of
    fixed shapes that torch.compile and CUDA graphs run (each row over its slot's rows with a
    mask), two rows of different lengths in one call match Hugging Face through the wraps."""
    loaded = tiny_config_model(kind, **WINDOWED[kind])
    forward = ring_forward(loaded, 3)
    if path == "torch":
        forward.model.kernel, forward.model.attention = None, "torch"
    else:  # what compiled.py compiles or captures, run eagerly
        forward._decode_fn = lambda k, v, rows, window: forward.model(k, v, rows, window)
    prompts = [ids(PROMPT, seed=1), ids(23, seed=2)]
    slots = [forward.cache.allocate() for _ in prompts]
    first = forward.prefill([PromptChunk(s, p) for s, p in zip(slots, prompts)])
    for row, prompt in enumerate(prompts):
        expected = hf_logits(loaded, prompt)[-1]
        torch.testing.assert_close(first[row], expected, atol=FP32_ATOL, rtol=0)
    fed, logits = decode_greedy(forward, slots, first.argmax(-1).tolist(), ANSWER)
    assert_decoded_as_hf(loaded, prompts, fed, logits)


@pytest.mark.parametrize("kind", WINDOWED)
def test_the_native_layers_over_rings_give_what_they_give_over_the_whole_context(kind):
    """With int4 weights (every layer in C calls) a ring of 10 gives the logits of the same
    forward keeping every position, within float32 rounding (a wrapped window is summed in two
    pieces), prefill and decode alike."""
    loaded = tiny_config_model(kind, **WINDOWED[kind])
    logits = {}
    for chunk in (3, 512):  # 512: the ring is no shorter than the context, so no ring
        forward = SlotForward.create(
            loaded,
            ForwardConfig(
                CacheBudget(bytes=64 << 20), max_len=128, max_slots=4, quantize="int4",
                window_chunk=chunk,
            ),
        )  # fmt: skip
        assert forward.model.native
        slot = forward.cache.allocate()
        prefilled = forward.prefill([PromptChunk(slot, ids(PROMPT))])
        _, decoded = decode_greedy(forward, [slot], [5], ANSWER)
        logits[chunk] = torch.cat([prefilled, decoded[:, 0]])
    assert forward.cache.chunk_limit is None
    # the two sums of a wrapped window round apart, which can move a quantized activation a level
    # (of 2032 per block): measured up to 4.2e-4 (gemma2); a wrong ring is off by O(1)
    torch.testing.assert_close(logits[3], logits[512], atol=1e-3, rtol=0)


@pytest.mark.parametrize("kind", WINDOWED)
def test_a_slot_continued_within_its_ring_matches_hf(kind):
    """A slot of 45 positions (prompt and answer) whose ring of 10 has wrapped: copied at 44 (a
    live stream's prefix), forked whole (a beam), and the copy, 56 long, taken back to 53 (an idle
    prefix cache entry, truncated), each continues as Hugging Face does from those tokens."""
    loaded = tiny_config_model(kind, **WINDOWED[kind])
    forward = ring_forward(loaded, 3)
    cache = forward.cache
    donor, copy, fork = (cache.allocate() for _ in range(3))
    prompt = ids(PROMPT)
    first = forward.prefill([PromptChunk(donor, prompt)]).argmax(-1).tolist()
    fed, _ = decode_greedy(forward, [donor], first, 5)
    written = prompt + fed[0]  # 45 positions in the slot
    assert cache.lengths[donor] == 45 and cache.reusable(donor, 43) == 43
    cache.copy_prefix(donor, copy, 44)
    more = ids(12, seed=3)
    got = forward.prefill([PromptChunk(copy, more)])[0]
    torch.testing.assert_close(
        got, hf_logits(loaded, written[:44] + more)[-1], atol=FP32_ATOL, rtol=0
    )
    cache.copy_prefix(donor, fork, 45)
    fed, logits = decode_greedy(forward, [donor, fork], [7, 8], 12)  # the two beams part
    assert_decoded_as_hf(loaded, [written, written], fed, logits)
    cache.truncate(copy, 53)  # 56 written: 3 back is as far as a ring of 10 allows
    fed, logits = decode_greedy(forward, [copy], [9], 4)
    assert_decoded_as_hf(loaded, [written[:44] + more[:9]], fed, logits)


def test_a_reuse_whose_window_is_gone_is_refused():
    """The same slot cannot give 40 of its 45 positions: its ring of 10 holds positions 35 to
    44, and position 40 needs 33 on. reusable says 0 (nothing shorter works either), and
    copy_prefix and truncate refuse, leaving both slots as they were."""
    loaded = tiny_config_model("gemma3_text")
    forward = ring_forward(loaded, 3)
    cache = forward.cache
    donor, other = cache.allocate(), cache.allocate()
    forward.prefill([PromptChunk(donor, ids(45))])
    assert [cache.reusable(donor, n) for n in (45, 42, 41, 40, 20)] == [45, 42, 0, 0, 0]
    with pytest.raises(ValueError, match="window before position 40"):
        cache.copy_prefix(donor, other, 40)
    with pytest.raises(ValueError, match="window before position 40"):
        cache.truncate(donor, 40)
    assert cache.lengths[donor] == 45 and cache.lengths[other] == 0


def test_the_compiled_step_reads_rings_as_hf(caplog):
    """The decode step through torch.compile (traced by dynamo; the eager backend, so that no
    C++ compiles) with rings in the cache: warmed up, it decodes two rows past several wraps as
    Hugging Face does, without falling back to the eager step."""
    from streaming_backend.forward import compiled

    loaded = tiny_config_model("gemma3_text")
    forward = ring_forward(loaded, 3)
    step, seconds = compiled.compile_decode(
        forward.model, forward.cache, forward.scratch_rows, backend="eager"
    )
    assert seconds is not None and step is not forward.model
    forward._decode_fn = step
    prompts = [ids(PROMPT, seed=1), ids(23, seed=2)]
    slots = [forward.cache.allocate() for _ in prompts]
    first = forward.prefill([PromptChunk(s, p) for s, p in zip(slots, prompts)])
    fed, logits = decode_greedy(forward, slots, first.argmax(-1).tolist(), ANSWER)
    assert_decoded_as_hf(loaded, prompts, fed, logits)
    assert step.fast is not None and "eagerly" not in caplog.text
