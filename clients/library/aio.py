"""A time limit on one await that costs no task and no extra trip through the event loop.

`asyncio.wait_for` on Python 3.11 wraps the awaited coroutine in a new task, so every call
yields to the event loop at least once. In a loop that sends or reads one frame per call that
is one frame per loop iteration, however many are waiting: a bridge relaying 24 streams then
queues frames 24 times faster than it sends them. `asyncio.timeout` (3.11+) bounds the await
in place. Python 3.10 (the NVIDIA container's) keeps `wait_for`.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(awaitable: Awaitable[T], seconds: float | None) -> T:
    """`await awaitable`, raising the builtin TimeoutError after `seconds` (None: no limit)."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(seconds):
            return await awaitable
    try:
        return await asyncio.wait_for(awaitable, seconds)
    except asyncio.TimeoutError:  # a class of its own before 3.11
        raise TimeoutError from None
