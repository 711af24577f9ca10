"""Scheduling: closed-loop concurrency levels or open-loop request rates over one transport, and
closed-loop multi-turn conversations."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from clients.bench.conversation import first_turn, follow_up, next_turn
from clients.bench.prompts import Sampling
from clients.bench.summary import OK, RequestRecord
from clients.bench.transports import CHAT_TRANSPORTS, Prompt, Transport


@dataclass(frozen=True)
class Level:
    """One load level: a fixed number of requests in flight, or a request rate (req/s)."""

    concurrency: int | None = None
    request_rate: float | None = None

    @property
    def label(self) -> str:
        """Short name for tables and progress bars."""
        if self.concurrency is not None:
            return f"c={self.concurrency}"
        return f"rate={self.request_rate:g}/s"

    @property
    def slots(self) -> int:
        """Connections worth opening for this level."""
        return self.concurrency or 16


@dataclass(frozen=True)
class Workload:
    """What each level sends, and when it stops."""

    prompts: Sequence[Prompt]
    sampling: Sampling
    requests: int | None = 100  # per level (conversations when multi-turn); None with a duration
    duration_s: float | None = None
    request_timeout_s: float = 300.0
    distribution: str = "constant"  # request-rate arrivals: constant or poisson
    seed: int = 0
    turns: int | None = None  # multi-turn: each unit of work is a conversation of this many turns

    def wants(self, i: int, deadline: float | None) -> bool:
        """Whether request (or conversation) i should still be started."""
        if self.requests is not None and i >= self.requests:
            return False
        return deadline is None or time.monotonic() < deadline


async def run_all(aws: Sequence[Awaitable]) -> None:
    """Await every task; on the first failure cancel the rest (gather would leave them)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    if not tasks:
        return
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for t in tasks:
            t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for t in done:
        if not t.cancelled() and t.exception() is not None:
            raise t.exception()


async def send_one(
    transport: Transport, wl: Workload, i: int, records: list[RequestRecord]
) -> RequestRecord:
    """Send request i and keep its record, whatever happens to it."""
    rec = RequestRecord(index=i)
    records.append(rec)
    await send(transport, wl, rec, wl.prompts[i % len(wl.prompts)])
    return rec


async def send(transport: Transport, wl: Workload, rec: RequestRecord, prompt: Prompt) -> None:
    """Send `prompt` as request rec.index; a failure or a timeout becomes rec.error."""
    try:
        await asyncio.wait_for(
            transport.generate(rec, prompt, wl.sampling.params(rec.index)), wl.request_timeout_s
        )
    except asyncio.TimeoutError:
        rec.error = f"no final response within {wl.request_timeout_s:g} s"
    except asyncio.CancelledError:
        rec.cancelled = True
        raise
    except Exception as exc:  # one broken request is a figure, not the end of the run
        rec.error = f"{type(exc).__name__}: {exc}"


async def converse(
    transport: Transport,
    wl: Workload,
    c: int,
    records: list[RequestRecord],
    on_turn: Callable[[], object] = lambda: None,
) -> None:
    """Conversation c: its turns one after another, each sending the whole history so far.

    Turn t is request c * turns + t - 1 (its sampling seed too). A turn that fails ends the
    conversation: without an answer there is no history to go on with.
    """
    history = first_turn(wl.prompts[c % len(wl.prompts)])
    for turn in range(1, wl.turns + 1):
        rec = RequestRecord(index=c * wl.turns + turn - 1, conversation=c, turn=turn)
        records.append(rec)
        await send(transport, wl, rec, Prompt(messages=history))
        on_turn()
        if rec.status != OK:
            return
        if turn < wl.turns:
            history = next_turn(history, rec.text, follow_up(c, turn + 1))


def multi_turn_problem(transports: Sequence[str], levels: Sequence[Level]) -> str | None:
    """Why conversations cannot run over these transports and levels; None when they can."""
    cannot = [t for t in transports if t not in CHAT_TRANSPORTS]
    if cannot:
        return (
            f"{', '.join(cannot)} cannot carry a conversation (chat messages); "
            f"multi-turn runs over {', '.join(CHAT_TRANSPORTS)}"
        )
    if any(level.concurrency is None for level in levels):
        return "multi-turn conversations run closed-loop: give --concurrency, not --request-rate"
    return None


async def closed_loop(issue: Callable[[int], Awaitable], wl: Workload, level: Level) -> None:
    """`concurrency` workers, each sending its next request (or conversation) when the last one
    ends."""
    deadline = None if wl.duration_s is None else time.monotonic() + wl.duration_s
    counter = itertools.count()

    async def worker():
        for i in counter:
            if not wl.wants(i, deadline):
                return
            await issue(i)

    await run_all([worker() for _ in range(level.concurrency)])


async def open_loop(issue: Callable[[int], Awaitable], wl: Workload, level: Level) -> None:
    """Requests started on a schedule of `request_rate` per second, whether or not others end."""
    rng = random.Random(wl.seed)
    deadline = None if wl.duration_s is None else time.monotonic() + wl.duration_s
    tasks, start = [], time.monotonic()
    at = 0.0
    for i in itertools.count():
        if not wl.wants(i, deadline):
            break
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        tasks.append(asyncio.ensure_future(issue(i)))
        gap = 1.0 / level.request_rate
        at += rng.expovariate(level.request_rate) if wl.distribution == "poisson" else gap
    await run_all(tasks)


async def run_level(
    transport: Transport, wl: Workload, level: Level, progress: bool = True
) -> list[RequestRecord]:
    """Run one level and return every request's record."""
    from tqdm import tqdm

    await transport.open(level.slots)
    records: list[RequestRecord] = []
    bar = tqdm(
        total=wl.requests if wl.requests is None or wl.turns is None else wl.requests * wl.turns,
        desc=f"{transport.name} {level.label}",
        unit="req",
        disable=not progress,
        leave=False,
    )

    async def issue(i: int) -> None:
        if wl.turns is not None:
            await converse(transport, wl, i, records, bar.update)
            return
        await send_one(transport, wl, i, records)
        bar.update()

    try:
        loop = closed_loop if level.concurrency is not None else open_loop
        await loop(issue, wl, level)
    finally:
        bar.close()
    return sorted(records, key=lambda r: r.index)


async def warm_up(transport: Transport, wl: Workload, count: int, concurrency: int) -> None:
    """Send `count` requests first so connections, caches and the model are warm."""
    if count > 0:
        warm = Workload(wl.prompts, wl.sampling, requests=count)
        await run_level(transport, warm, Level(concurrency=max(1, min(count, concurrency))), False)
