"""Errors a request can end with; each carries its wire.ErrorKind (message prefix, Triton code)."""

from __future__ import annotations

from streaming_backend import wire


class StreamingError(Exception):
    """Base of the errors a single request can fail with."""

    kind: wire.ErrorKind = wire.INTERNAL

    @property
    def category(self) -> str:
        """The message prefix clients read the kind back from."""
        return self.kind.prefix

    def __str__(self) -> str:
        return f"{self.kind.prefix}: {super().__str__()}"

    @classmethod
    def of(cls, exc: Exception) -> StreamingError:
        """`exc` itself when it is a StreamingError, else an internal one naming it."""
        return exc if isinstance(exc, StreamingError) else cls(f"{type(exc).__name__}: {exc}")


class InvalidRequest(StreamingError):
    """The request itself is wrong (bad settings, empty or too long prompt)."""

    kind = wire.INVALID_REQUEST


class Overloaded(StreamingError):
    """The admission queue is full; retry later."""

    kind = wire.OVERLOADED


class EngineStopped(StreamingError):
    """The engine is shut down (or never started) and takes no requests."""

    kind = wire.UNAVAILABLE


class Cancelled(StreamingError):
    """The client cancelled the request, or the server ended it."""

    kind = wire.CANCELLED

    def __str__(self) -> str:
        return self.kind.prefix if not self.args else super().__str__()


class NonFiniteLogits(StreamingError):
    """A stream's logits held NaN or inf (float16 overflow, a broken device): no token to pick."""

    kind = wire.INTERNAL  # the model's fault, not the request's


class MaskFailed(StreamingError):
    """A row's grammar token mask could not be made: its stream fails, the batch goes on."""

    kind = wire.INTERNAL  # the grammar library's fault, not the request's
