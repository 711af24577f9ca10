"""A small fake of the few pb_utils (triton_python_backend_utils) names the adapter calls.

The real module is importable only inside Triton's stub process; the adapter is given the module,
so its tests give it this one. Senders and metrics record what they were asked to do.
"""

from __future__ import annotations

import threading

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1


class Tensor:
    def __init__(self, name, array):
        self.name, self.array = name, array


class InferenceResponse:
    def __init__(self, output_tensors=(), error=None):
        self.outputs = {t.name: t.array for t in output_tensors}
        self.error = error


class TritonError:
    INVALID_ARG, UNAVAILABLE, CANCELLED, INTERNAL = (
        "INVALID_ARG",
        "UNAVAILABLE",
        "CANCELLED",
        "INTERNAL",
    )

    def __init__(self, message, code=INTERNAL):
        self.message, self.code = message, code


class InputTensor:
    def __init__(self, array):
        self.array = array

    def as_numpy(self):
        return self.array


class InferenceRequest:
    """A request holding its input arrays by tensor name."""

    def __init__(self, **arrays):
        self.inputs = {name: InputTensor(array) for name, array in arrays.items()}


def get_input_tensor_by_name(request, name):
    return request.inputs.get(name)


class ResponseSender:
    """A request's response sender: keeps (response, flags); `fail` makes data sends raise."""

    def __init__(self, fail: bool = False, cancel_fails: bool = False):
        self.sent: list[tuple[InferenceResponse, int]] = []
        self.cancelled = False
        self.fail, self.cancel_fails = fail, cancel_fails
        self.finished = threading.Event()

    def send(self, response, flags=0):
        if self.fail and response.error is None:
            raise RuntimeError("the stub refused the response")
        self.sent.append((response, flags))
        if flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL:
            self.finished.set()

    def is_cancelled(self):
        if self.cancel_fails:
            raise RuntimeError("the sender is broken")
        return self.cancelled

    def finals(self) -> int:
        return sum(1 for _, flags in self.sent if flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL)


class Metric:
    def __init__(self, family, labels, buckets=None):
        self.family, self.labels, self.buckets = family, labels, buckets
        self.value = 0
        self.observed: list[float] = []
        self.increments: list[float] = []  # a counter's every increment, in order

    def _check(self):
        if self.family.broken:
            raise RuntimeError("metrics are broken")

    def increment(self, n):
        self._check()
        self.value += n
        self.increments.append(n)

    def set(self, value):
        self._check()
        self.value = value
        self.observed.append(value)  # a gauge's every set, in order

    def observe(self, value):
        self._check()
        self.observed.append(value)


class MetricFamily:
    HISTOGRAM, COUNTER, GAUGE = "histogram", "counter", "gauge"
    broken = False  # set on a family: every call of its metrics raises

    def __init__(self, name, description, kind):
        self.name, self.description, self.kind = name, description, kind
        self.metrics: list[Metric] = []

    def Metric(self, labels, buckets=None):  # noqa: N802 - pb_utils' spelling
        self.metrics.append(Metric(self, labels, buckets))
        return self.metrics[-1]
