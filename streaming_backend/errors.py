"""Errors a request can end with; each maps to one Triton error code at the edge."""

from __future__ import annotations


class StreamingError(Exception):
    """Base of the errors a single request can fail with."""

    category = "internal error"

    def __str__(self) -> str:
        return f"{self.category}: {super().__str__()}"


class InvalidRequest(StreamingError):
    """The request itself is wrong (bad settings, empty or too long prompt)."""

    category = "invalid request"


class Overloaded(StreamingError):
    """The admission queue is full; retry later."""

    category = "overloaded"


class EngineStopped(StreamingError):
    """The engine is shut down (or never started) and takes no requests."""

    category = "unavailable"
