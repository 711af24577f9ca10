"""The C kernels' library (streaming_backend/forward/native.py) and its exact attention
(csrc/exact_attention.c); the quantized matmuls are tested in test_forward_quant.py."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F
from families import COMPACT_FAMILIES, tiny_config_model

from streaming_backend.forward import native, quant
from streaming_backend.forward.layers import exact_attention
from streaming_backend.forward.native import Placed
from streaming_backend.forward.runner import ForwardConfig, PromptChunk, SlotForward
from streaming_backend.forward.slots import CacheBudget
from streaming_backend.model.loading import load_model

PLACES, KV_HEADS, GROUPS, MAX_LEN, HEAD_DIM = 6, 3, 3, 300, 64
NO_WINDOW = 1 << 62
# (atol, rtol) against torch's attention in float64: float32 rounding over up to 300 positions
# (measured up to 1.4e-6 on outputs of size ~1); bfloat16: half a bf16 step of the value, plus
# float32's, since the kernel sums in float32 and rounds once, at its output
TOLERANCE = {torch.float32: (5e-6, 0.0), torch.bfloat16: (1e-5, 2**-8)}


@pytest.fixture(scope="module")
def kernel() -> native.AttentionKernel:
    """The kernel as this machine builds it (the suite's machines all have gcc)."""
    built = native.attention_kernel()
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


def test_no_compiler_means_torch_kernels_with_a_warning(monkeypatch, caplog):
    """Without a C compiler both kernels are None, the reason is logged, and quantized weights
    take torch's layouts (its weight-only kernels run them)."""
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv(native.COMPILER_VARIABLE, raising=False)
    assert native.compiler() is None
    native.forget()
    try:
        assert native.attention_kernel() is None and native.matmul_kernel() is None
        assert "no C compiler" in caplog.text
        w = torch.randn(64, 128)
        assert isinstance(quant.quantize_weight(w, "int4"), quant.Int4Weight)
        assert isinstance(quant.quantize_weight(w, "int8"), quant.Int8Weight)
    finally:
        monkeypatch.undo()
        native.forget()
    assert isinstance(quant.quantize_weight(torch.randn(64, 128), "int4"), quant.NativeInt4Weight)


def test_a_build_goes_to_a_new_name_per_source_and_leaves_no_partial_file(tmp_path, monkeypatch):
    """The library is built under the cache folder with a digest in its name, loads, and a
    second build finds it instead of compiling again; no temporary file stays behind."""
    monkeypatch.setenv("TOKENSTREAM_CACHE", str(tmp_path))
    cc = native.compiler()
    path = native.build(cc, native.variant())
    assert path.parent == tmp_path / "native" and path.suffix == ".so"
    assert native.variant() in path.name
    library = ctypes.CDLL(str(path))
    library.ts_exact_attention, library.ts_q4_matmul, library.ts_q8_matmul  # noqa: B018 - there
    stamp = os.stat(path).st_mtime_ns
    assert native.build(cc, native.variant()) == path and os.stat(path).st_mtime_ns == stamp
    assert [p.name for p in path.parent.iterdir()] == [path.name]


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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize(
    "family",
    COMPACT_FAMILIES,
)
def test_the_native_layers_compute_what_the_torch_layers_do(tiny_model_dir, family, kind, dtype):
    """With quantized weights every layer runs as a few C calls (layers.native_layer: the norms,
    RoPE, K/V writes, attention, silu and residuals in C; Qwen3's head norms in torch between
    them; Granite's multipliers folded into the weights); prefill (padded rows too) and decode
    give the logits of the same weights through torch's norms, RoPE and MLP, within the rounding
    of the activations' quantization (a norm a hair apart can move a level)."""
    logits = {}
    for use_native in (True, False):
        if family == "llama":
            loaded = load_model(str(tiny_model_dir), dtype=dtype, device="cpu")
        else:
            loaded = tiny_config_model(family, getattr(torch, dtype))
        config = ForwardConfig(CacheBudget(bytes=64 << 20), max_len=128, max_slots=4, quantize=kind)
        forward = SlotForward.create(loaded, config)
        assert forward.model.native
        forward.model.native = use_native
        slots = [forward.cache.allocate() for _ in range(3)]
        prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18]]
        steps = [forward.prefill([PromptChunk(s, p) for s, p in zip(slots, prompts)])]
        for step in range(4):  # the same tokens fed to both (an argmax tie could part them)
            steps.append(forward.decode(slots, [20 + step, 30 + step, 40 + step]))
        logits[use_native] = torch.stack(steps)
    ours, theirs = logits[True], logits[False]
    # float32: a norm one ulp apart can move an activation a level (of 16256 per block): measured
    # up to 4e-5 of the largest logit; a wrong RoPE or norm is off by about the logits themselves
    if dtype == "float32":
        assert (ours - theirs).abs().max() <= 2e-4 * theirs.abs().max()
    else:  # torch rounds each step to bfloat16, C once (measured: cosine 0.99984 at the least)
        close = F.cosine_similarity(ours.flatten(0, 1), theirs.flatten(0, 1), dim=-1)
        assert close.min() > 0.999


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("family", COMPACT_FAMILIES)
def test_the_decoder_stack_gives_the_bits_of_the_layer_by_layer_calls(tiny_model_dir, family, kind):
    """Where no layer needs torch between its calls, every layer runs in one C call
    (native.DecoderStack): the same functions in the same order as native_layer's calls from
    Python, so the same logits to the bit, in prefill (padded rows too), decode, and a prompt
    longer than the windows of the families that have them. Families with head norms, post
    norms or experts keep the calls from Python."""
    if family == "llama":
        loaded = load_model(str(tiny_model_dir), dtype="bfloat16", device="cpu")
    else:
        loaded = tiny_config_model(family, torch.bfloat16)
    config = ForwardConfig(CacheBudget(bytes=64 << 20), max_len=128, max_slots=4, quantize=kind)
    forward = SlotForward.create(loaded, config)
    stack = forward.model.native_stack
    blocks = forward.model.native_blocks
    plain = all(b.q_norm is None and b.attn_out_norm is None and b.experts is None for b in blocks)
    assert (stack is not None) == plain
    if stack is None:
        return
    logits = {}
    for use_stack in (True, False):
        forward.model.native_stack = stack if use_stack else None
        slots = [forward.cache.allocate() for _ in range(3)]
        prompts = [[5, 6, 7, 8, 9], [10, 11], [(12 + i) % 50 for i in range(40)]]
        steps = [forward.prefill([PromptChunk(s, p) for s, p in zip(slots, prompts)]).float()]
        for step in range(4):
            steps.append(forward.decode(slots, [20 + step, 30 + step, 40 + step]).float())
        logits[use_stack] = torch.stack(steps)
        for slot in slots:
            forward.cache.free(slot)
    assert torch.equal(logits[True], logits[False])


def test_the_decoder_stack_refuses_caches_that_do_not_fit(tiny_model_dir):
    """A cache list of the wrong length, dtype or shape is refused before any C runs."""
    loaded = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    config = ForwardConfig(CacheBudget(bytes=16 << 20), max_len=64, max_slots=2, quantize="int4")
    model = SlotForward.create(loaded, config).model
    stack = model.native_stack
    k = [torch.zeros(2, model.shape.kv_heads, 64, model.shape.head_dim) for _ in model.blocks]
    x = torch.zeros(1, model.shape.hidden)
    placed = Placed.of([(0, 0)])
    with pytest.raises(ValueError, match="layers' caches"):
        stack(x, k[:-1], k[:-1], placed)
    with pytest.raises(ValueError, match="caches"):
        stack(x, k, [t.to(torch.bfloat16) for t in k], placed)
    with pytest.raises(ValueError, match="x "):
        stack(x.to(torch.bfloat16), k, k, placed)
    # tuples of caches are checked once and their arguments kept; other caches are checked anew
    kept = tuple(k)
    stack(x, kept, kept, placed)
    assert stack._caches[0] is kept
    with pytest.raises(ValueError, match="caches"):
        stack(x, kept, tuple(t.to(torch.bfloat16) for t in k), placed)
    with pytest.raises(ValueError, match="caches"):
        stack(x, kept, tuple(t[:, :, :32] for t in k), placed)


def cpu_has(variant: str) -> bool:
    """Whether this CPU runs the build `variant` (native.NEEDS)."""
    return native.NEEDS[variant] <= set(open("/proc/cpuinfo").read().split())


@pytest.mark.skipif(not cpu_has("avx512"), reason="the CPU has no AVX-512 with VNNI")
def test_the_avx512_and_avx2_builds_give_the_same_bits(tmp_path, monkeypatch):
    """The AVX-512 build's matmuls sum the AVX2 build's products in the AVX2 build's order (the
    dense one is the same code): the same bits from both, whatever the rows, inputs (block
    counts even, odd, below and above 8; a dense input count off the lanes of 8), prologue and
    dtype. Its attention takes 16 lanes where the AVX2 build takes 8, each lane adding the
    products an AVX2 lane adds, in its order: the same bits too, whatever the head size and
    cache dtype. So an answer does not depend on which of the two CPU kinds served it."""
    monkeypatch.setenv("TOKENSTREAM_CACHE", str(tmp_path))
    cc = native.compiler()
    built = {v: ctypes.CDLL(str(native.build(cc, v))) for v in ("avx2", "avx512")}
    matmuls = {v: native.MatmulKernel(lib, v) for v, lib in built.items()}
    generator = torch.Generator().manual_seed(2)
    for inputs in (96, 576, 608, 2048):
        w = torch.randn(77, inputs, generator=generator) * 0.05
        weights = (quant.quantize_int4_native(w), quant.quantize_int8_native(w))
        for rows, dtype in ((1, torch.float32), (5, torch.bfloat16), (9, torch.float32)):
            x = torch.randn(rows, 2 * inputs, generator=generator).to(dtype)
            norm = torch.rand(inputs, generator=generator).to(dtype)
            around = [
                {},
                {"prologue": "rms_norm", "norm": norm, "eps": 1e-5},
                {"prologue": "silu_mul", "add_to": torch.ones(rows, 77, dtype=dtype)},
                {"prologue": "gelu_tanh_mul"},
            ]
            for options in around:
                gated = options.get("prologue") in native.MatmulKernel.GATED
                width = 2 * inputs if gated else inputs
                a = x[:, :width].contiguous()
                got = {}
                for variant, kernel in matmuls.items():
                    opts = {k: v.clone() if k == "add_to" else v for k, v in options.items()}
                    got[variant] = (
                        kernel.q4(a, *weights[0], **opts),
                        kernel.q8(a, *weights[1], **opts),
                        kernel.dense(a, w.to(dtype), **opts),
                        kernel.dense(x[:, : inputs - 5].contiguous(), w[:, :-5].contiguous()),
                    )
                assert all(torch.equal(p, q) for p, q in zip(got["avx2"], got["avx512"]))
    # the attention: head sizes of 4 x 16 values (64, 128), 16 off them (80, 96) and off 16 (40,
    # the one-head functions), float32 and bfloat16 caches, with and without a cap
    heads = [(64, torch.float32), (64, torch.bfloat16), (128, torch.bfloat16)]
    heads += [(80, torch.float32), (96, torch.bfloat16), (40, torch.bfloat16)]
    for head_dim, dtype in heads:
        shape = (PLACES, KV_HEADS, MAX_LEN, head_dim)
        k, v = (torch.randn(shape, generator=generator).to(dtype) for _ in range(2))
        q = torch.randn(len(ROWS), KV_HEADS, GROUPS, head_dim, generator=generator).to(dtype)
        for cap in (0.0, 1.5):
            outs = [
                native.AttentionKernel(lib, n)(q, k, v, Placed.of(ROWS), NO_WINDOW, 0.125, cap)
                for n, lib in built.items()
            ]
            assert torch.equal(*outs), (head_dim, dtype, cap)


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump to read the library")
@pytest.mark.skipif(native.variant() == "generic", reason="the generic build does not prefetch")
def test_the_matmuls_prefetch_their_weight_rows(tmp_path, monkeypatch):
    """The quantized matmuls ask for their weights ahead (csrc/quant_matmul.c, `ask`): about
    1.5x the weight stream from memory. gcc drops the calls of a function
    of prefetches alone as having no effect unless it is inlined first; this catches the
    library built without them."""
    monkeypatch.setenv("TOKENSTREAM_CACHE", str(tmp_path))
    path = native.build(native.compiler(), native.variant())
    listing = subprocess.run(["objdump", "-d", str(path)], capture_output=True, text=True)
    assert listing.returncode == 0 and "prefetcht0" in listing.stdout


@pytest.mark.skipif(not cpu_has("avx512"), reason="the CPU has no AVX-512 with VNNI")
def test_q4_gives_the_same_bits_from_the_avx512_avx2_and_portable_builds(tmp_path, monkeypatch):
    """q4's sums are defined lane by lane (csrc/quant_matmul.c, q4_tile), so the portable build
    gives the SIMD builds' bits too (with no prologue: the portable RMS norm sums its squares
    in another order). Block counts cover every tail of a group of 4 and of 16, and weight
    matrices of 1 and 2 rows of 1 block, where a row's last group is read by copy rather than
    past its end; activation rows 1 to 5 cover every row tile. Rows of 2304 and 8192 inputs
    too, on one thread and on two (1 and 2 rows take the tiles that ask for the next tile's
    weight rows as they read, rows_ahead)."""
    monkeypatch.setenv("TOKENSTREAM_CACHE", str(tmp_path))
    cc = native.compiler()
    kernels = [
        native.MatmulKernel(ctypes.CDLL(str(native.build(cc, v))), v)
        for v in ("avx512", "avx2", "generic")
    ]
    generator = torch.Generator().manual_seed(3)
    short = [(b, 37) for b in range(1, 34)] + [(1, 1), (1, 2), (3, 1), (17, 2)]
    for blocks, outputs in short + [(72, 37), (72, 130), (256, 9)]:
        inputs = 32 * blocks
        weight = quant.quantize_int4_native(torch.randn(outputs, inputs, generator=generator))
        for rows in (1, 2, 3, 4, 5):
            x = torch.randn(rows, inputs, generator=generator)
            norm = torch.rand(inputs, generator=generator)
            options = {"prologue": "rms_norm", "norm": norm, "eps": 1e-5} if rows % 2 else {}
            got = [kernel.q4(x, *weight, **options) for kernel in kernels]
            assert torch.equal(got[0], got[1]), (blocks, outputs, rows)
            assert options or torch.equal(got[0], got[2]), (blocks, outputs, rows)


def amx_kernel() -> native.MatmulKernel | None:
    """The loaded matmuls where their block dots can run on AMX (a Xeon's tiles), else None."""
    kernel = native.matmul_kernel()
    return kernel if kernel is not None and kernel.amx else None


@pytest.mark.skipif(amx_kernel() is None, reason="no AMX-INT8 here (or not granted, or capped)")
def test_the_amx_tiles_give_the_bits_of_the_avx512_tiles():
    """With AMX, a block's dot products come from tile multiplies; the sums after are the AVX-512
    tiles' own, in their order: the same bits, for q4 and q8, whatever the rows (below AMX's 8,
    its 16 and a last group of every size: 8 to 16 on AMX, fewer on the AVX-512 tiles), block
    counts (1, odd, past the 4 blocks unpacked ahead), weight rows off the tiles, prologue,
    dtype and threads; with extreme values too (nibbles 0 and 15, int8 +-127, activation
    halves at their ends)."""
    kernel = amx_kernel()
    generator = torch.Generator().manual_seed(4)
    threads = torch.get_num_threads()
    cases = [(1, 16), (2, 37), (3, 16), (5, 130), (18, 77), (72, 37), (256, 9)]
    try:
        for blocks, outputs in cases:
            inputs = 32 * blocks
            w = torch.randn(outputs, inputs, generator=generator) * 0.05
            if blocks == 5:  # the extremes: every weight at a block's lowest or highest level
                w = torch.where(w > 0, 1.0, -1.0) * torch.rand(outputs, 1, generator=generator)
            weights = (quant.quantize_int4_native(w), quant.quantize_int8_native(w))
            for rows in (1, 7, 8, 9, 15, 16, 17, 23, 24, 31, 33):
                x = torch.randn(rows, 2 * inputs, generator=generator)
                if blocks == 5:
                    x = torch.where(x > 0, 1.0, -1.0) * (1 + (x.abs() > 1))  # v at +-16256, +-8128
                dtype = torch.bfloat16 if rows % 2 else torch.float32
                x = x.to(dtype)
                norm = torch.rand(inputs, generator=generator).to(dtype)
                options = [{}, {"prologue": "rms_norm", "norm": norm, "eps": 1e-5}]
                options.append(
                    {"prologue": "silu_mul", "add_to": torch.ones(rows, outputs, dtype=dtype)}
                )
                for opts in options:
                    a = x if opts.get("prologue") == "silu_mul" else x[:, :inputs].contiguous()
                    got = {}
                    for on, count in ((True, 2), (False, 1), (True, 1)):
                        kernel.amx = on
                        torch.set_num_threads(count)
                        fresh = {
                            key: v.clone() if key == "add_to" else v for key, v in opts.items()
                        }
                        got[on, count] = (
                            kernel.q4(a, *weights[0], **fresh),
                            kernel.q8(a, *weights[1], **fresh),
                        )
                    for got_amx in (got[True, 2], got[True, 1]):
                        for p, q in zip(got_amx, got[False, 1]):
                            assert torch.equal(p, q), (blocks, outputs, rows, dtype, opts.keys())
    finally:
        kernel.amx = True
        torch.set_num_threads(threads)


@pytest.mark.skipif(amx_kernel() is None, reason="no AMX-INT8 here (or not granted, or capped)")
def test_tokenstream_amx_0_keeps_the_matmuls_off_amx(monkeypatch):
    """TOKENSTREAM_AMX=0 keeps the block dots on the AVX-512 tiles (benchmarks, a suspect CPU)."""
    library, variant = native.library()
    try:
        monkeypatch.setenv(native.AMX_VARIABLE, "0")
        assert not native.MatmulKernel(library, variant).amx
        monkeypatch.setenv(native.AMX_VARIABLE, "1")
        kernel = native.MatmulKernel(library, variant)
        assert not kernel.amx  # the variable only turns it off; turning on is the setter's
        kernel.amx = True
        assert kernel.amx
    finally:
        native.matmul_kernel().amx = True


@pytest.mark.skipif(not cpu_has("avx512"), reason="the CPU has no AVX-512 with VNNI")
def test_a_compiler_without_amx_still_builds_the_avx512_kernels(tmp_path, monkeypatch):
    """A compiler that rejects AMX's flags (gcc before 11) builds the AVX-512 kernels without
    them, and they run without AMX, rather than the build failing and the forward losing every
    kernel."""
    monkeypatch.setenv("TOKENSTREAM_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "AMX_FLAGS", ("-mno-such-option-anywhere",))
    cc = native.compiler()
    assert "-mno-such-option-anywhere" not in native.flags("avx512", cc)
    assert "-mno-such-option-anywhere" in native.flags("avx512")  # no compiler: as declared
    kernel = native.MatmulKernel(ctypes.CDLL(str(native.build(cc, "avx512"))), "avx512")
    assert not kernel.amx
    weight = quant.quantize_int4_native(torch.randn(40, 64))
    x = torch.randn(9, 64)
    assert torch.equal(kernel.q4(x, *weight), native.matmul_kernel().q4(x, *weight))


def test_the_greedy_pick_is_the_first_largest_in_every_build(tmp_path, monkeypatch):
    """ts_greedy_rows (sampling's greedy rows): the first index of each row's largest value, as
    torch's max gives it, ties at every lane place and lengths on and off the vector widths;
    a row with NaN or an infinity, or so large that its sum might overflow, is not certain
    (0, for the pipeline to decide). Every build this CPU runs."""
    monkeypatch.setenv("TOKENSTREAM_CACHE", str(tmp_path))
    cc = native.compiler()
    builds = [v for v in ("avx512", "avx2") if cpu_has(v)] + ["generic"]
    kernels = [native.MatmulKernel(ctypes.CDLL(str(native.build(cc, v))), v) for v in builds]
    generator = torch.Generator().manual_seed(5)
    for vocab in (1, 7, 8, 15, 16, 17, 33, 100, 49152, 49155):
        x = torch.randn(4, vocab, generator=generator)
        x[1, vocab // 2 :] = x[1].max() + 1.0  # a tie from the middle on: the first wins
        x[2] = -3.0  # all alike
        x[3, -1] = 1e4  # the last place
        expected = x.max(-1).indices.tolist()
        for kernel in kernels:
            assert kernel.greedy(x) == (expected, [True] * 4), (kernel.variant, vocab)
    bad = torch.randn(6, 50, generator=generator)
    bad[0, 3], bad[1, 49], bad[2, 20] = float("nan"), float("inf"), float("-inf")
    bad[3] = 4e36  # 2 x 50 x 4e36 > float's largest: a sum could overflow
    bad[4] = 1e30  # far from it
    for kernel in kernels:
        ids, sure = kernel.greedy(bad)
        assert sure == [False, False, False, False, True, True], kernel.variant
        assert ids[:4] == [0, 0, 0, 0] and ids[4:] == bad[4:].max(-1).indices.tolist()
    with pytest.raises(ValueError, match="greedy: logits"):
        kernels[0].greedy(torch.zeros(2, 5, dtype=torch.bfloat16))
