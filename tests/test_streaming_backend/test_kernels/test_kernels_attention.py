"""The exact attention kernels (streaming_backend/kernels/attention.py, csrc/attention.c): each
token over exactly its own positions, RoPE and the cache writes, against torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from streaming_backend.forward.layers import exact_attention
from streaming_backend.forward.runner import ForwardConfig, PromptChunk, SlotForward
from streaming_backend.forward.slots import CacheBudget
from streaming_backend.kernels import attention
from streaming_backend.kernels.attention import Placed
from streaming_backend.model.loading import load_model

PLACES, KV_HEADS, GROUPS, MAX_LEN, HEAD_DIM = 6, 3, 3, 300, 64
NO_WINDOW = 1 << 62
# (atol, rtol) against torch's attention in float64: float32 rounding over up to 300 positions
# (measured up to 1.4e-6 on outputs of size ~1); bfloat16: half a bf16 step of the value, plus
# float32's, since the kernel sums in float32 and rounds once, at its output
TOLERANCE = {torch.float32: (5e-6, 0.0), torch.bfloat16: (1e-5, 2**-8)}


@pytest.fixture(scope="module")
def kernel() -> attention.AttentionKernel:
    """The kernel as this machine builds it (the suite's machines all have gcc)."""
    built = attention.attention_kernel()
    assert built is not None, "the attention kernel did not build (see the log)"
    return built


def cache(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random layer cache K, V [places, kv_heads, max_len, head_dim]."""
    generator = torch.Generator().manual_seed(seed)
    shape = (PLACES, KV_HEADS, MAX_LEN, HEAD_DIM)
    k = torch.randn(shape, generator=generator) * 2
    v = torch.randn(shape, generator=generator)
    return k.to(dtype), v.to(dtype)


def queries(n: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    """Random queries [n, kv_heads, groups, head_dim]."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(n, KV_HEADS, GROUPS, HEAD_DIM, generator=generator) * 2).to(dtype)


def reference(q, k, v, rows, window, cap: float = 0.0) -> torch.Tensor:
    """torch's attention in float64, one token at a time, the scores soft-capped at `cap`
    where it is not 0 -> [n, heads * head_dim]."""
    outs = []
    for token, (place, position) in enumerate(rows):
        first = max(0, position + 1 - window)
        keys = k[place, :, first : position + 1].double()[None]
        values = v[place, :, first : position + 1].double()[None]
        query = q[token].double()[None]
        if cap:
            scores = torch.tanh(query @ keys.transpose(-1, -2) * HEAD_DIM**-0.5 / cap) * cap
            outs.append(torch.softmax(scores, dim=-1) @ values)
        else:
            outs.append(F.scaled_dot_product_attention(query, keys, values))
    return torch.cat(outs).reshape(len(rows), -1)


ROWS = [(0, 0), (1, 7), (2, 8), (3, 15), (4, 16), (5, 17), (0, 255), (1, 256), (2, 299)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [NO_WINDOW, 1, 9, 100])
@pytest.mark.parametrize("cap", [0.0, 1.5])
def test_the_kernel_is_attention_over_each_tokens_own_positions(kernel, dtype, window, cap):
    """Each token attends over positions [max(0, p + 1 - window), p] of its place: torch's
    attention in float64 within float32 rounding (bfloat16: one output rounding), at lengths on
    and off the kernel's vector width, the first position and the last; with the scores
    soft-capped (Gemma 2) too, at a cap below the scores' size so that it shows."""
    k, v = cache(dtype)
    q = queries(len(ROWS), dtype)
    out = kernel(q, k, v, Placed.of(ROWS), window, HEAD_DIM**-0.5, cap)
    assert out.dtype == dtype and out.shape == (len(ROWS), KV_HEADS * GROUPS * HEAD_DIM)
    atol, rtol = TOLERANCE[dtype]
    expected = reference(q, k, v, ROWS, window, cap)
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)


@pytest.mark.cpu_kinds
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tokens_result_does_not_depend_on_what_shares_the_call(kernel, dtype):
    """A token alone, first or last among others, or repeated gives the same bits: one thread
    computes it in an order fixed by its own position."""
    k, v = cache(dtype)
    q = queries(len(ROWS), dtype)
    together = kernel(q, k, v, Placed.of(ROWS), NO_WINDOW, HEAD_DIM**-0.5)
    for token, row in enumerate(ROWS):
        alone = kernel(q[token : token + 1].contiguous(), k, v, Placed.of([row]), NO_WINDOW, 0.125)
        assert torch.equal(alone[0], together[token]), row
    backwards = kernel(q.flip(0).contiguous(), k, v, Placed.of(ROWS[::-1]), NO_WINDOW, 0.125)
    assert torch.equal(backwards.flip(0), together)


@pytest.mark.cpu_kinds
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, len(ROWS)])
def test_any_number_of_threads_gives_the_same_bits(kernel, dtype, tokens):
    """How the query heads are shared out among threads changes no value: one thread takes a
    key/value head's query heads together (each key and value row read once for them), as many
    threads as query heads take them one at a time, and counts between mix the two."""
    k, v = cache(dtype)
    q = queries(tokens, dtype)
    rows = ROWS[-tokens:]
    threads = torch.get_num_threads()
    got = []
    try:
        for count in (1, 2, 3, tokens * KV_HEADS * GROUPS):
            torch.set_num_threads(count)
            got.append(kernel(q, k, v, Placed.of(rows), NO_WINDOW, 0.125))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(got[0], other) for other in got[1:])


def test_a_position_outside_the_cache_is_refused_not_read(kernel):
    """A position at or past max_len (or a negative one) fails loudly before anything is read."""
    k, v = cache(torch.float32)
    q = queries(1, torch.float32)
    for position in (MAX_LEN, -1):
        with pytest.raises(RuntimeError, match="bad arguments"):
            kernel(q, k, v, Placed.of([(0, position)]), NO_WINDOW, 0.125)


def rope_tables(positions: int = MAX_LEN) -> tuple[torch.Tensor, torch.Tensor]:
    """Random RoPE-like cos, sin tables [positions, head_dim] (any values do for the checks)."""
    generator = torch.Generator().manual_seed(3)
    return tuple(torch.rand(positions, HEAD_DIM, generator=generator) for _ in range(2))


def test_rope_attention_turns_writes_and_attends_as_torch_would(kernel):
    """with_rope from a q/k/v projection: the keys written into the cache are RoPE's (Hugging
    Face's rotate_half), the values as they came, and the output is the exact attention of
    the turned queries over the cache (each token seeing the ones before it in the call)."""
    k, v = cache(torch.float32)
    cos, sin = rope_tables()
    rows = [(1, 0), (1, 1), (1, 2), (4, 40)]
    heads = KV_HEADS * GROUPS
    qkv = torch.randn(
        len(rows), (heads + 2 * KV_HEADS) * HEAD_DIM, generator=torch.Generator().manual_seed(4)
    )
    placed = Placed.of(rows)
    got = kernel.with_rope(qkv, (cos, sin), k, v, placed, NO_WINDOW, GROUPS)

    def turn(x, position):  # [h, D]
        half = HEAD_DIM // 2
        rotated = torch.cat([-x[:, half:], x[:, :half]], dim=-1)
        return x * cos[position] + rotated * sin[position]

    q, kk, vv = qkv.split([heads * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    turned = []
    for token, (place, position) in enumerate(rows):
        turned.append(turn(q[token].view(heads, HEAD_DIM), position))
        keys = turn(kk[token].view(KV_HEADS, HEAD_DIM), position)
        torch.testing.assert_close(k[place, :, position], keys, atol=1e-6, rtol=0)
        assert torch.equal(v[place, :, position], vv[token].view(KV_HEADS, HEAD_DIM))
    q_turned = torch.stack(turned).view(len(rows), KV_HEADS, GROUPS, HEAD_DIM)
    expected = reference(q_turned, k, v, rows, NO_WINDOW)
    torch.testing.assert_close(got, expected.float(), atol=1e-5, rtol=1e-5)


def test_rope_attention_refuses_a_place_or_position_outside_the_cache(kernel):
    """A place past the cache or a position past it (or past the RoPE table) fails loudly,
    before anything is written."""
    k, v = cache(torch.float32)
    qkv = torch.randn(1, (KV_HEADS * GROUPS + 2 * KV_HEADS) * HEAD_DIM)
    for rows, table in (([(PLACES, 0)], MAX_LEN), ([(0, MAX_LEN)], MAX_LEN), ([(0, 10)], 10)):
        before = k.clone()
        with pytest.raises(RuntimeError, match="bad arguments"):
            kernel.with_rope(qkv, rope_tables(table), k, v, Placed.of(rows), NO_WINDOW, GROUPS)
        assert torch.equal(k, before)


def ring_of(full: torch.Tensor, rows: int, held: dict[int, int]) -> torch.Tensor:
    """A layer cache of `rows` rows per place holding, as a sliding window's ring does, the
    last positions of `full` [places, kv_heads, max_len, head_dim] up to held[place]: position
    p in row p mod rows. The other rows hold noise, never to be read."""
    ring = torch.randn(full.shape[0], full.shape[1], rows, full.shape[3]).to(full.dtype) * 100
    for place, last in held.items():
        for position in range(max(0, last + 1 - rows), last + 1):
            ring[place, :, position % rows] = full[place, :, position]
    return ring


# one token per place, positions before, at and far past a ring's wrap
RING_ROWS = [(0, 3), (1, 12), (2, 13), (3, 30), (4, 255), (5, 299)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, chunk", [(9, 1), (9, 8), (100, 1), (100, 21)])
def test_a_ring_is_read_as_the_positions_it_holds(kernel, dtype, window, chunk):
    """Over a ring of window + chunk - 1 rows (position p in row p mod rows), each token's
    attention is the one over the full cache's positions: the kernel's and torch's paths,
    where the window lies in one piece of the ring and where it wraps round its end."""
    k, v = cache(dtype)
    rows = window + chunk - 1
    held = dict(RING_ROWS)
    ring_k, ring_v = ring_of(k, rows, held), ring_of(v, rows, held)
    q = queries(len(RING_ROWS), dtype)
    placed = Placed.of(RING_ROWS)
    atol, rtol = TOLERANCE[dtype]
    expected = reference(q, k, v, RING_ROWS, window)
    got = kernel(q, ring_k, ring_v, placed, window, HEAD_DIM**-0.5)
    torch.testing.assert_close(got.double(), expected, atol=atol, rtol=rtol)
    by_torch = exact_attention(q, (ring_k, ring_v), placed, window, None)
    if dtype == torch.bfloat16:  # torch rounds the weights to bf16 before they meet V
        atol = 2**-7
    torch.testing.assert_close(by_torch.double(), expected, atol=2 * atol, rtol=2 * rtol)


def test_more_positions_than_a_ring_holds_are_refused(kernel):
    """A token whose window (or whole context, under full attention) is longer than the rows
    fails loudly: the ring cannot hold it."""
    k, v = cache(torch.float32)
    ring_k, ring_v = k[:, :, :13].contiguous(), v[:, :, :13].contiguous()
    q = queries(1, torch.float32)
    kernel(q, ring_k, ring_v, Placed.of([(0, 40)]), 13, 0.125)
    for window in (14, NO_WINDOW):
        with pytest.raises(RuntimeError, match="bad arguments"):
            kernel(q, ring_k, ring_v, Placed.of([(0, 40)]), window, 0.125)


def test_rope_attention_writes_a_ring_at_its_positions_modulo_its_rows(kernel):
    """with_rope over a ring: each token's key and value land in row position mod rows, and a
    call's tokens (within the ring's spare) attend as over the full cache."""
    k, v = cache(torch.float32)
    window, rows = 9, 13  # a spare of 5 positions: calls of up to 5 tokens per place
    calls = [[(1, 20), (1, 21), (1, 22), (1, 23), (1, 24)], [(1, 25)], [(4, 11), (1, 26)]]
    ring_k, ring_v = ring_of(k, rows, {1: 19, 4: 10}), ring_of(v, rows, {1: 19, 4: 10})
    generator = torch.Generator().manual_seed(4)
    width = (KV_HEADS * GROUPS + 2 * KV_HEADS) * HEAD_DIM
    for rows_of_call in calls:
        qkv = torch.randn(len(rows_of_call), width, generator=generator)
        placed = Placed.of(rows_of_call)
        full = kernel.with_rope(qkv, rope_tables(), k, v, placed, window, GROUPS)
        got = kernel.with_rope(qkv, rope_tables(), ring_k, ring_v, placed, window, GROUPS)
        torch.testing.assert_close(got, full, atol=1e-5, rtol=1e-5)
        for place, position in rows_of_call:
            assert torch.equal(ring_k[place, :, position % rows], k[place, :, position])
            assert torch.equal(ring_v[place, :, position % rows], v[place, :, position])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_torch_path_computes_the_same_attention(kernel, dtype):
    """exact_attention without the kernel (one torch call per token) agrees with it within
    rounding, sliding window included."""
    k, v = cache(dtype)
    q = queries(len(ROWS), dtype)
    for window in (NO_WINDOW, 9):
        with_kernel = exact_attention(q, (k, v), Placed.of(ROWS), window, kernel)
        with_torch = exact_attention(q, (k, v), Placed.of(ROWS), window, None)
        atol, rtol = TOLERANCE[dtype]  # each side within it of the exact value: twice apart
        if dtype == torch.bfloat16:  # torch rounds the weights to bf16 before they meet V
            atol = 2**-7  # one bf16 step of values in [1, 2) (measured: up to 0.0029)
        torch.testing.assert_close(with_kernel, with_torch, atol=2 * atol, rtol=2 * rtol)


def test_the_tiny_model_gives_the_same_logits_with_and_without_the_kernel(tiny_model_dir):
    """The compact forward on the kernel and on torch's attention: prefill (padded rows too) and
    decode logits agree within float32 rounding."""
    logits = {}
    for use_kernel in (True, False):
        loaded = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
        config = ForwardConfig(CacheBudget(bytes=64 << 20), max_len=128, max_slots=4)
        forward = SlotForward.create(loaded, config)
        assert (forward.model.kernel is not None) and forward.model.attention.startswith("c-")
        if not use_kernel:
            forward.model.kernel, forward.model.attention = None, "torch"
        slots = [forward.cache.allocate() for _ in range(3)]
        prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18]]
        steps = [forward.prefill([PromptChunk(s, p) for s, p in zip(slots, prompts)])]
        for _ in range(4):
            steps.append(forward.decode(slots, steps[-1].argmax(-1).tolist()))
        logits[use_kernel] = torch.stack(steps)
    torch.testing.assert_close(logits[True], logits[False], atol=1e-4, rtol=0)
