"""Answering a request through Triton: the few pb_utils calls a response needs.

The pb_utils module (triton_python_backend_utils) is importable only inside the model's process,
so `Sender` is given it; tests pass a small fake with the same few names. Only the chat model's
outbox thread calls a Sender: concurrent calls into Triton from several stub threads crashed the
server. `error_response` only builds a response: the dialogue model returns its errors with it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np

from streaming_backend.errors import StreamingError
from streaming_backend.wire import INTERNAL, TEXT_OUTPUT

log = logging.getLogger("tokenstream.model")


def string_array(text: str) -> np.ndarray:
    """A STRING tensor's [1] array holding `text`."""
    return np.array([text.encode()], dtype=np.object_)


def error_message(exc: Exception) -> str:
    """What the client reads: a StreamingError's own message, else an internal error."""
    return str(exc) if isinstance(exc, StreamingError) else f"{INTERNAL.prefix}: {exc!r}"


def triton_code_name(exc: Exception) -> str:
    """The name of the pb_utils.TritonError code an exception goes out with (wire.ErrorKind)."""
    return exc.kind.triton_code if isinstance(exc, StreamingError) else INTERNAL.triton_code


def error_response(pb_utils, exc: Exception):
    """An InferenceResponse carrying `exc`: its message and Triton code (wire.ErrorKind)."""
    code = getattr(pb_utils.TritonError, triton_code_name(exc))
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(error_message(exc), code))


class Sender:
    """Responses, errors and cancellation checks on a request's InferenceResponseSender."""

    def __init__(self, pb_utils):
        self._pb = pb_utils
        self._final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL

    def send(self, sender, outputs: Mapping[str, np.ndarray], final: bool) -> None:
        """One response holding `outputs` (tensor name -> array), FINAL when `final`."""
        tensors = [self._pb.Tensor(name, array) for name, array in outputs.items()]
        response = self._pb.InferenceResponse(output_tensors=tensors)
        sender.send(response, flags=self._final if final else 0)

    def send_text(self, sender, text: str) -> None:
        """The request's one response: `text` as TEXT_OUTPUT, with FINAL."""
        self.send(sender, {TEXT_OUTPUT: string_array(text)}, final=True)

    def send_error(self, sender, exc: Exception) -> None:
        """The request's only remaining response: its error, with FINAL. Never raises."""
        response = error_response(self._pb, exc)
        try:
            sender.send(response, flags=self._final)
        except Exception:  # noqa: BLE001 - the client may be gone; nothing else to do
            log.exception("could not send the error response")

    @staticmethod
    def is_cancelled(sender) -> bool:
        """Whether the request's client cancelled it (a round trip to the server)."""
        return sender.is_cancelled()
