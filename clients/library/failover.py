"""Retry a generation on another replica when its stream fails as unavailable before its first
response: the user never sees a replica that died, drained or restarted between streams.

Each attempt is a new gRPC stream, and round_robin gives a new stream the next ready connection,
so a retry lands on another replica. A replica that is gone drops out of round_robin as soon as
its connection breaks; one that still accepts streams but refuses them (stopping or draining)
is skipped by these retries until it closes. After the first response nothing is retried: the
client already showed tokens, and the failure is reported as it is.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator

from clients.library.chunk import Chunk, GenerationError
from streaming_backend.wire import UNAVAILABLE

log = logging.getLogger("tokenstream.client")

# Pauses before attempts 2, 3, ..., 16: the first retry goes at once (round_robin moves on), later
# ones leave a moment for gRPC to notice broken connections. A stopping or draining replica
# refuses for as long as it takes to close (seconds), and while other streams' picks interleave
# with this one's, each attempt lands on it with a chance of about 1/N of N replicas: all k
# attempts do with (1/N)^k. These 16 attempts all fail about once in 65,000 streams with two
# replicas, and give up after the pauses' sum, about 3 s.
RETRY_DELAYS_S = (0.0, 0.05, 0.1, 0.2) + (0.25,) * 11


def retryable(error: GenerationError, responses: int) -> bool:
    """Whether a failed attempt may be retried: unavailable, and nothing received yet."""
    return responses == 0 and error.code == UNAVAILABLE.code and error.retryable


def next_delay(
    error: GenerationError, responses: int, tries: int, delays: tuple[float, ...]
) -> float | None:
    """After attempt number `tries` failed with `error` having received `responses`: the pause
    before the next attempt, or None to give up and raise. The one decision of both loops."""
    if tries > len(delays) or not retryable(error, responses):
        return None
    log.info("attempt %d failed before its first response (%s); retrying", tries, error)
    return delays[tries - 1]


async def failover(
    attempt: Callable[[], AsyncIterator[Chunk]], delays: tuple[float, ...] = RETRY_DELAYS_S
) -> AsyncIterator[Chunk]:
    """The chunks of the first attempt that gets a response; closing this closes the attempt."""
    for tries in itertools.count(1):
        received = 0
        chunks = attempt()
        try:
            async for chunk in chunks:
                received += 1
                yield chunk
            return
        except GenerationError as exc:
            delay = next_delay(exc, received, tries, delays)
            if delay is None:
                raise
        finally:
            await chunks.aclose()  # leaving early cancels the stream upstream
        await asyncio.sleep(delay)


def failover_sync(
    attempt: Callable[[], Iterator[Chunk]], delays: tuple[float, ...] = RETRY_DELAYS_S
) -> Iterator[Chunk]:
    """The synchronous twin of failover()."""
    for tries in itertools.count(1):
        received = 0
        chunks = attempt()
        try:
            for chunk in chunks:
                received += 1
                yield chunk
            return
        except GenerationError as exc:
            delay = next_delay(exc, received, tries, delays)
            if delay is None:
                raise
        finally:
            chunks.close()
        time.sleep(delay)
