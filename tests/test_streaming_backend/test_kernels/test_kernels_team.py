"""The kernels' thread team (streaming_backend/kernels/team.py, csrc/team.c): a call's chunks go
to whichever thread runs, the calling thread takes over a chunk a parked worker holds, and every
output has the same bits as on one thread, however the workers are scheduled."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from streaming_backend.forward import quant
from streaming_backend.forward.runner import ForwardConfig, PromptChunk, SlotForward
from streaming_backend.forward.slots import CacheBudget
from streaming_backend.kernels import team
from streaming_backend.kernels.attention import Placed, attention_kernel
from streaming_backend.model.loading import load_model

HOLD_S = 0.003  # a parked worker: about a scheduler's slice


@pytest.fixture
def threads():
    """torch's thread count (the kernels' too), restored after the test, and no held workers."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    team.hold_workers(0)
    torch.set_num_threads(before)


def linears(seed: int = 0) -> list[tuple[torch.Tensor, object]]:
    """Inputs and weights of each quantized format and the dense one: (x, weight)."""
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(1000, 576, generator=generator) * 0.05
    cases = []
    for rows in (1, 5, 16, 33):
        x = torch.randn(rows, 576, generator=generator)
        cases += [(x, quant.quantize_weight(w, kind)) for kind in ("int8", "int4")]
    return cases


def run_linears(cases) -> list[torch.Tensor]:
    return [quant.linear(x, w) for x, w in cases]


def attention(rows: list[tuple[int, int]], seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    k = torch.randn(6, 3, 300, 64, generator=generator)
    v = torch.randn(6, 3, 300, 64, generator=generator)
    q = torch.randn(len(rows), 3, 3, 64, generator=generator)
    kernel = attention_kernel()
    return lambda: kernel(q, k, v, Placed.of(rows), 1 << 62, 0.125)


ROWS = [(0, 0), (1, 7), (2, 80), (3, 150), (4, 160), (5, 299), (0, 255), (1, 256)]


def test_workers_take_chunks_and_give_the_bits_of_one_thread(threads):
    """On two threads the worker computes chunks of a call (the counts say so) and the matmuls
    and attention give exactly what one thread gives."""
    cases = linears()
    attend = attention(ROWS)
    threads(1)
    alone = run_linears(cases), attend()
    threads(2)
    before = team.stats()
    deadline = time.monotonic() + 60  # a busy machine may keep the worker off a core a while
    while True:
        together = run_linears(cases), attend()
        assert all(torch.equal(a, b) for a, b in zip(alone[0], together[0]))
        assert torch.equal(alone[1], together[1])
        after = team.stats()
        if after.worker_chunks > before.worker_chunks or time.monotonic() > deadline:
            break
    assert after.workers >= 1
    assert after.jobs > before.jobs and after.worker_chunks > before.worker_chunks


@pytest.mark.parametrize("count", [2, 3])
def test_a_parked_worker_is_taken_over_and_changes_no_bit(threads, count):
    """Workers that stop for a scheduler's slice before committing each chunk: the calling thread
    computes their chunks itself (takeovers), the late workers' results are never stored over a
    later call's (each call's outputs differ here, so a stale store would show), and every
    output is still the one-thread result."""
    calls = [linears(seed) for seed in range(3)]
    attends = [attention(ROWS[: 2 + seed * 3], seed) for seed in range(3)]
    threads(1)
    alone = [(run_linears(c), a()) for c, a in zip(calls, attends)]
    threads(count)
    team.hold_workers(HOLD_S)
    before = team.stats()
    deadline = time.monotonic() + 60
    for round in range(1000):
        for (expected, expected_attention), cases, attend in zip(alone, calls, attends):
            got = run_linears(cases)
            assert all(torch.equal(a, b) for a, b in zip(expected, got))
            assert torch.equal(expected_attention, attend())
        taken = team.stats().takeovers > before.takeovers
        if round >= 2 and (taken or time.monotonic() > deadline):
            break
    assert taken


def test_calls_from_two_threads_at_once_each_get_their_own_bits(threads):
    """Two Python threads calling the kernels at once: one holds the team, the other runs alone
    (or waits for nothing); both get the one-thread results, every time."""
    cases = [linears(seed) for seed in range(2)]
    threads(1)
    expected = [run_linears(c) for c in cases]
    threads(2)
    failures = []

    def hammer(index: int) -> None:
        torch.set_num_threads(2)
        for _ in range(15):
            got = run_linears(cases[index])
            if not all(torch.equal(a, b) for a, b in zip(expected[index], got)):
                failures.append(index)

    workers = [threading.Thread(target=hammer, args=(i,)) for i in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert failures == []


def test_the_decoder_stack_gives_the_same_logits_with_parked_workers(threads, tiny_model_dir):
    """The whole compact forward (prefill, then decode steps, in one C call a step) on two
    threads with workers parked before every commit: the logits of one thread, to the bit."""
    loaded = load_model(str(tiny_model_dir), dtype="bfloat16", device="cpu")
    config = ForwardConfig(CacheBudget(bytes=64 << 20), max_len=128, max_slots=4, quantize="int4")
    forward = SlotForward.create(loaded, config)
    assert forward.model.native_stack is not None
    logits = {}
    for count, hold in ((1, 0.0), (2, 0.0), (2, HOLD_S)):
        threads(count)
        team.hold_workers(hold)
        slots = [forward.cache.allocate() for _ in range(3)]
        prompts = [[5, 6, 7, 8, 9], [10, 11], [(12 + i) % 50 for i in range(40)]]
        steps = [forward.prefill([PromptChunk(s, p) for s, p in zip(slots, prompts)]).float()]
        for step in range(4):
            steps.append(forward.decode(slots, [20 + step, 30 + step, 40 + step]).float())
        logits[(count, hold)] = torch.stack(steps)
        for slot in slots:
            forward.cache.free(slot)
    assert torch.equal(logits[(1, 0.0)], logits[(2, 0.0)])
    assert torch.equal(logits[(1, 0.0)], logits[(2, HOLD_S)])


def test_no_worker_is_inside_a_call_once_it_returns(threads):
    """A worker parked in a chunk the caller took over is waited for at the end of the call (it
    may be reading the weights or the cache, which the caller may free once the call returns):
    right after each call no worker is busy, although each holds every chunk 20 ms."""
    cases = linears()
    threads(1)
    expected = run_linears(cases)
    threads(2)
    team.hold_workers(0.02)
    for _ in range(3):
        for (x, w), want in zip(cases, expected):
            assert torch.equal(quant.linear(x, w), want)
            assert team.stats().busy == 0
