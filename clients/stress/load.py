"""The load: N requests from C threads through tritonclient gRPC, each timed on the client."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from clients.library.grpc_client import GenerateRequest, GenerationError, stream_generate
from streaming_backend.sampling.request_keys import MAX_TOKENS
from streaming_backend.wire import (
    DIALOGUE_INPUT_IDS,
    DIALOGUE_MODEL,
    DIALOGUE_OUTPUT_IDS,
    REQUEST_OUTPUT_LEN,
)


@dataclass(frozen=True)
class Outcome:
    """One request as the client saw it."""

    sent_s: float  # time.monotonic() when sent
    latency_s: float
    error: str | None = None  # the server's message when it failed

    @property
    def ok(self) -> bool:
        return self.error is None


Sender = Callable[[int], None]  # sends request i; raises on failure


def dialogue_sender(url: str, input_len: int, output_len: int, seed: int = 0) -> Sender:
    """Request i: random ids of `input_len` in [0, 1000) as [1, L] INT32, output_len new tokens."""
    client = grpcclient.InferenceServerClient(url)  # thread-safe: one channel for all workers

    def send(i: int) -> None:
        ids = np.random.default_rng(seed + i).integers(0, 1000, [1, input_len]).astype(np.int32)
        inputs = [
            grpcclient.InferInput(DIALOGUE_INPUT_IDS, [1, input_len], "INT32"),
            grpcclient.InferInput(REQUEST_OUTPUT_LEN, [1, 1], "INT32"),
        ]
        inputs[0].set_data_from_numpy(ids)
        inputs[1].set_data_from_numpy(np.array([[output_len]], dtype=np.int32))
        result = client.infer(DIALOGUE_MODEL, inputs)
        shape = result.as_numpy(DIALOGUE_OUTPUT_IDS).shape
        if shape[:2] != (1, 1):
            raise ValueError(f"output_ids has shape {list(shape)}, expected [1, 1, T]")

    return send


def chat_sender(url: str, model: str, prompts: Sequence, output_len: int) -> Sender:
    """Request i: chat prompt i (cycling), one non-streamed answer of at most output_len tokens."""

    def send(i: int) -> None:
        request = GenerateRequest(
            messages=prompts[i % len(prompts)], sampling={MAX_TOKENS: output_len}, stream=False
        )
        for _ in stream_generate(url, request, model=model):
            pass

    return send


def run(send: Sender, requests: int, concurrency: int, progress: bool = True) -> list[Outcome]:
    """Send `requests` requests from `concurrency` threads; every outcome, in request order."""
    outcomes: list[Outcome | None] = [None] * requests
    bar = Progress(requests, enabled=progress)

    def one(i: int) -> None:
        started = time.monotonic()
        error = None
        try:
            send(i)
        except (InferenceServerException, GenerationError, ValueError) as exc:
            error = _message(exc)
        outcomes[i] = Outcome(started, time.monotonic() - started, error)
        bar.advance(error is None)

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        list(pool.map(one, range(requests)))
    bar.close()
    return outcomes


def _message(exc: Exception) -> str:
    if isinstance(exc, InferenceServerException):
        return exc.message() or str(exc)
    return str(exc)


class Progress:
    """A one-line progress bar on stderr: done/total, failures, elapsed."""

    def __init__(self, total: int, enabled: bool = True, width: int = 30):
        self.total, self.enabled, self.width = total, enabled, width
        self.done = self.failed = 0
        self.started = time.monotonic()
        self.lock = threading.Lock()
        self.last_draw = 0.0

    def advance(self, ok: bool) -> None:
        with self.lock:
            self.done += 1
            self.failed += not ok
            now = time.monotonic()
            if self.enabled and (now - self.last_draw > 0.1 or self.done == self.total):
                self.last_draw = now
                self._draw(now)

    def _draw(self, now: float) -> None:
        filled = self.width * self.done // max(self.total, 1)
        bar = "#" * filled + "-" * (self.width - filled)
        elapsed = now - self.started
        counts = f"{self.done}/{self.total}  failed {self.failed}"
        sys.stderr.write(f"\r[{bar}] {counts}  {elapsed:.1f}s")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()
