"""One model whatever the load: a row's numbers do not depend on what shares its call.

Every comparison here is exact (torch.equal), not within a tolerance: a row that differs in the
last bit alone or in a crowd can give another token, greedy or sampled. These tests run twice in
CI, natively and under the AVX2 caps (marker `cpu_kinds`), since the kernels that decide them are
the CPU kind's.
"""

from __future__ import annotations

import pytest
import torch
from families import tiny_config_model

from streaming_backend.forward import quant
from streaming_backend.forward.runner import ForwardConfig, PromptChunk, SlotForward
from streaming_backend.forward.slots import CacheBudget
from streaming_backend.model.loading import load_model

pytestmark = pytest.mark.cpu_kinds

KINDS = ("none", "int8", "int4")
DTYPES = ("float32", "bfloat16")
# the default model's linear shapes (in -> out): q/k/v fused, o, gate/up fused, down, the head
SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152))
ROWS = (*range(1, 18), 31, 32, 33, 64, 100)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_a_linear_row_is_the_same_in_a_call_of_any_size(kind, dtype):
    """quant.linear of the first m rows equals the first m rows of one call over all of them,
    at the default model's shapes, for every weight format: the kernels this CPU runs compute
    each row the same way whatever the call's size (the dense one thanks to its row padding)."""
    generator = torch.Generator().manual_seed(3)
    for inputs, outputs in SHAPES:
        if kind == "int4" and outputs == 49152:
            continue  # the head is never int4 (quant.HEAD_KIND)
        w = (torch.randn(outputs, inputs, generator=generator) * 0.05).to(getattr(torch, dtype))
        weight = quant.quantize_weight(w, kind)
        x = torch.randn(max(ROWS), inputs, generator=generator).to(w.dtype)
        with torch.inference_mode():
            whole = quant.linear(x, weight)
            for rows in ROWS:
                part = quant.linear(x[:rows], weight)
                assert torch.equal(part, whole[:rows]), (inputs, outputs, rows)
                alone = quant.linear(x[rows - 1 : rows], weight)  # the row at offset 0
                assert torch.equal(alone[0], whole[rows - 1]), (inputs, outputs, rows)


def test_dense_is_torchs_matmul_within_rounding():
    """quant.dense (our C kernel on this CPU) computes F.linear, for 2-D and [N, T, in] inputs,
    bias included, any input count (here 100: a tail after its lanes of 8), in both dtypes."""
    generator = torch.Generator().manual_seed(5)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        w = (torch.randn(40, 100, generator=generator) * 0.1).to(dtype)
        bias = torch.randn(40, generator=generator).to(dtype)
        for shape in ((3, 100), (2, 5, 100), (0, 100)):
            x = torch.randn(*shape, generator=generator).to(dtype)
            y = quant.dense(x, w, bias)
            assert y.shape == (*shape[:-1], 40) and y.dtype == dtype
            expected = torch.nn.functional.linear(x.double(), w.double(), bias.double())
            torch.testing.assert_close(y.double(), expected, atol=tolerance, rtol=tolerance)


class Probe:
    """One prompt and the tokens fed after it, run through a forward in several company."""

    def __init__(self, forward: SlotForward, seed: int = 0):
        self.forward = forward
        generator = torch.Generator().manual_seed(seed)
        ids = lambda n: torch.randint(0, 1000, (n,), generator=generator).tolist()  # noqa: E731
        self.prompt = ids(60)
        self.others = [ids(n) for n in (90, 33, 120, 5)]
        self.fed = ids(12)

    def run(self, prefill: str, mates: int) -> torch.Tensor:
        """Logits [1 + fed, V]: after the prompt, then after each fed token. prefill: "alone",
        "crowd" (one call with other prompts, shorter and longer) or "chunkN" (N tokens a
        call); mates: streams of other lengths decoding in the same steps."""
        cache = self.forward.cache
        cache.reset()
        slot = cache.allocate()
        rows = [self._prefill(slot, prefill)]
        company = []
        for number in range(mates):
            mate = cache.allocate()
            self.forward.prefill([PromptChunk(mate, self.others[number % 4][: 3 + 7 * number])])
            company.append(mate)
        for token in self.fed:
            middle = len(company) // 2  # the probe's row sits among its mates
            slots = [*company[:middle], slot, *company[middle:]]
            rows.append(self.forward.decode(slots, [token] * len(slots))[middle])
        return torch.stack(rows)

    def _prefill(self, slot: int, how: str) -> torch.Tensor:
        if how == "alone":
            return self.forward.prefill([PromptChunk(slot, self.prompt)])[0]
        if how == "crowd":
            cache = self.forward.cache
            others = [PromptChunk(cache.allocate(), o) for o in self.others]
            logits = self.forward.prefill([others[0], PromptChunk(slot, self.prompt), *others[1:]])
            for chunk in others:
                cache.free(chunk.slot)
            return logits[1]
        size = int(how.removeprefix("chunk"))
        for start in range(0, len(self.prompt), size):
            logits = self.forward.prefill([PromptChunk(slot, self.prompt[start : start + size])])
        return logits[0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_a_streams_logits_are_the_same_alone_or_in_a_crowd(tiny_model_dir, kind, dtype):
    """A prompt prefilled alone, among other prompts or in chunks of 1, 7 or 32 tokens, then
    decoded alone or beside 1 or 15 streams of other lengths: the same logits, bit for bit, at
    every step."""
    same_alone_or_in_a_crowd(load_model(str(tiny_model_dir), dtype=dtype, device="cpu"), kind)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ("none", "int4"))
@pytest.mark.parametrize("family", ("qwen3", "gemma2", "gemma3_text", "qwen3_moe", "olmoe"))
def test_other_families_streams_are_the_same_alone_or_in_a_crowd(family, kind, dtype):
    """The same for Qwen3, whose heads' queries and keys are normalised between the C calls,
    Gemma 2 and 3 (norms after the attention and the MLP in torch, GELU and Gemma 2's capped
    scores in C; their sliding layers in rings of 23 positions, which the prompt wraps, and
    prefill calls of at most 16 tokens per slot) and Qwen3's mixture of
    experts (each token routed on its own, its experts run among whichever tokens chose them)."""
    same_alone_or_in_a_crowd(tiny_config_model(family, getattr(torch, dtype)), kind)


def same_alone_or_in_a_crowd(loaded, kind: str) -> None:
    """The crowd test's body for one loaded model (sliding-window layers in rings of their
    window + 15 positions)."""
    config = ForwardConfig(
        CacheBudget(bytes=64 << 20), max_len=256, max_slots=20, quantize=kind, window_chunk=16
    )
    probe = Probe(SlotForward.create(loaded, config))
    alone = probe.run("alone", 0)
    for prefill, mates in (("crowd", 0), ("chunk1", 0), ("chunk7", 0), ("chunk32", 0)):
        assert torch.equal(probe.run(prefill, mates), alone), prefill
    for prefill, mates in (("alone", 1), ("alone", 15), ("crowd", 15), ("chunk7", 15)):
        assert torch.equal(probe.run(prefill, mates), alone), (prefill, mates)


@pytest.fixture(scope="module")
def default_loaded(default_model_dir):
    """The default model in each dtype, loaded once for this module's thread tests."""
    return {d: load_model(str(default_model_dir), dtype=d, device="cpu") for d in DTYPES}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_one_thread_and_two_give_the_same_logits(default_loaded, kind, dtype):
    """The default model, prefilled among other prompts and decoded beside 15 streams, on one
    torch thread and on two: the same logits, bit for bit. The engine may change the thread
    count between steps when other work takes a core (streaming_backend/engine/step_threads.py), so
    a row's numbers must not depend on it."""
    config = ForwardConfig(CacheBudget(bytes=256 << 20), max_len=256, max_slots=20, quantize=kind)
    probe = Probe(SlotForward.create(default_loaded[dtype], config))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = probe.run("crowd", 15)
        torch.set_num_threads(2)
        two = probe.run("crowd", 15)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_decoded_token_is_what_a_prefill_of_it_gives(tiny_model_dir, dtype):
    """Tokens fed one decode step at a time leave the same keys and values, and the same last
    logits, as the same tokens prefilled in one chunk: an answer reused from the prefix cache
    as the next turn's prompt is the model's own numbers, not the decode path's variant."""
    loaded = load_model(str(tiny_model_dir), dtype=dtype, device="cpu")
    config = ForwardConfig(CacheBudget(bytes=64 << 20), max_len=256, max_slots=4, quantize="int4")
    forward = SlotForward.create(loaded, config)
    probe = Probe(forward)
    decoded, prefilled = forward.cache.allocate(), forward.cache.allocate()
    forward.prefill([PromptChunk(decoded, probe.prompt)])
    for token in probe.fed:
        last = forward.decode([decoded], [token])[0]
    whole = forward.prefill([PromptChunk(prefilled, probe.prompt + probe.fed)])[0]
    assert torch.equal(whole, last)
    length = len(probe.prompt) + len(probe.fed)
    places = [forward.cache.physical[s] for s in (decoded, prefilled)]
    for layer in (*forward.cache.k, *forward.cache.v):
        assert torch.equal(layer[places[0], :, :length], layer[places[1], :, :length])
