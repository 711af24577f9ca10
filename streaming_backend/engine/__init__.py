"""The engine: one thread owns the model and steps every live stream together.

Requests are submitted from any thread and join the running batch between decode steps
(iteration-level batching). Each step runs one forward pass for all live streams, samples each
row with its own settings and hands out one `TokenEvent` per stream through that stream's sink
(built by `stream_events.StreamEvents`: the engine schedules, it does not write events).

Beside it in this package: stream_events.py (a chosen token -> its TokenEvent), detokenize.py
(incremental text) and step_threads.py (how many torch threads the decode steps run on).
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch

from streaming_backend.configuration.models import EngineConfig
from streaming_backend.engine.detokenize import IncrementalDetokenizer
from streaming_backend.engine.step_threads import (
    LOOK_S,
    StepReport,
    StepThreads,
    machine_idle_seconds,
    other_processes_seconds,
    usable_cpus,
)
from streaming_backend.engine.stream_events import EventSink, StreamEvents
from streaming_backend.errors import EngineStopped, Overloaded, StreamingError
from streaming_backend.events import FinishReason, TokenEvent
from streaming_backend.model.loading import LoadedModel
from streaming_backend.model.memory import MemoryReport
from streaming_backend.model.numerics import Numerics, describe
from streaming_backend.prompts.prompt_limits import PromptLimits
from streaming_backend.sampling import sampling
from streaming_backend.sampling.grammar import GrammarCompiler, GrammarMatcher, compute_masks_ahead
from streaming_backend.sampling.logits import NextTokenChooser
from streaming_backend.sampling.request_keys import MAX_TOKENS
from streaming_backend.sampling.settings import SamplingSettings
from streaming_backend.sampling.stopping import StopStringMatcher
from streaming_backend.steps import Decoded, Steps, admission
from streaming_backend.steps.build import build_steps
from streaming_backend.steps.drafts import DraftCounts, resolve_mode
from streaming_backend.steps.forward_choice import ForwardChoice
from streaming_backend.wire import speculation_counts

log = logging.getLogger(__name__)

# A failed step whose message holds one of these leaves the device unusable (every later step
# fails too): the engine turns unhealthy at once, so the model reports it and gets restarted.
POISON_MARKERS = ("CUDA error", "device-side assert", "out of memory", "CUBLAS_STATUS", "NCCL")
MAX_FAILED_STEPS = 3  # consecutive failed steps that make the engine unhealthy whatever the cause


class StreamHandle:
    """A submitted request: iterate it for its events, or cancel it."""

    def __init__(self, request_id: str, sink: EventSink | None):
        self.request_id = request_id
        self._own_queue: queue.Queue[TokenEvent] | None = None if sink else queue.Queue()
        self.sink: EventSink = sink or self._own_queue
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        """Stop this stream; it ends with a CANCELLED event within one engine step."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        """True once cancel() was called."""
        return self._cancelled.is_set()

    def __iter__(self) -> Iterator[TokenEvent]:
        if self._own_queue is None:
            raise TypeError("this stream's events go to the sink given at submit")
        while True:
            event = self._own_queue.get()
            yield event
            if event.final:
                return

    def text(self) -> str:
        """Block until the stream ends; return its whole text (raises the stream's error)."""
        events = list(self)
        if events[-1].error is not None:
            raise events[-1].error
        return "".join(e.text for e in events)


@dataclass(eq=False)  # streams compare by identity
class _Stream:
    """Engine-thread state of one request."""

    handle: StreamHandle
    prompt_ids: list[int]
    settings: SamplingSettings  # max_tokens resolved
    logprobs: bool
    submitted_ns: int
    generator: torch.Generator
    detokenizer: IncrementalDetokenizer
    matcher: StopStringMatcher
    output_ids: list[int] = field(default_factory=list)
    scheduled_ns: int = 0
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    ended: bool = False  # its final event went out: it must never get a second one
    grammar: GrammarMatcher | None = None  # constrained decoding (guided_*): its token mask
    # its own row's logits pipeline, for a drafted position past a step's first (speculation)
    chooser: NextTokenChooser | None = None


class Engine:
    """Continuous-batching generation over one loaded model, on its own thread."""

    def __init__(
        self,
        loaded: LoadedModel | Callable[[], LoadedModel],
        config: EngineConfig | None = None,
    ):
        """Build the engine on its own thread and wait until it is ready (or raise what failed).

        `loaded` is a loaded model, or a function that loads one, which then runs on the
        engine's thread too. Every torch computation of the engine (the model's load when given
        a function, the forward's build, its calibration and every step) runs on that one
        thread: torch's OpenMP threads form one team per calling thread, and on a 2-core CPU a
        second team (the main thread's, from building and calibrating the forward there) made
        every int4 decode step of the engine thread 1.7x as long (docs/design.md). The
        loop itself waits for start().
        """
        self.config = config or EngineConfig()
        self._cond = threading.Condition()
        self._waiting: collections.deque[_Stream] = collections.deque()
        self._stopping = False
        self._started = threading.Event()
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._failed_steps = 0  # consecutive steps that raised
        self._fault: str | None = None  # why the engine is unhealthy; None while healthy
        self._last_emit_ns = 0  # when the latest step's tokens existed
        self._ids = itertools.count()
        # torch's CPU threads as the caller has them: the engine thread starts on this count
        # (torch.set_num_threads is also global: an earlier engine's last count would otherwise
        # be a new thread's) and StepThreads never goes above it
        self._torch_threads = torch.get_num_threads()
        self._thread = threading.Thread(
            target=self._run, args=(loaded,), name="streaming-engine", daemon=True
        )
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            self._thread.join()
            raise self._build_error
        model = self.loaded
        self._limits = PromptLimits.of(model)
        # compiles guided_* settings into per-request matchers (streaming_backend.sampling.grammar)
        self._grammars = GrammarCompiler(model.tokenizer, self._limits.vocab, model.eos_ids)
        # Fill the next step's grammar masks on a worker while the forward runs: on a GPU the
        # host is free meanwhile; on a CPU the forward's threads hold every core, and the worker
        # would take them from it (docs/openai.md, scripts/grammar_bench.py --mask-ahead).
        self.mask_ahead = model.device.type == "cuda"

    def _build(self, loaded: LoadedModel | Callable[[], LoadedModel]) -> None:
        """On the engine thread: load the model (if given a loader), build its steps and say
        what decides their numbers."""
        _set_threads(self._torch_threads)
        self.loaded = loaded() if callable(loaded) else loaded
        # each chosen token -> its stream's event (text, stop checks, logprobs, the final one)
        self._events = StreamEvents(self.loaded)
        # the live streams and the forward they run on; owned by the engine thread
        self._steps: Steps[_Stream] = build_steps(self.loaded, self.config, self._prefill_failed)
        # what decides every answer's numbers, and its system_fingerprint (reads the weights)
        self.numerics: Numerics = describe(self.loaded, self._steps)
        # which forward that is and why (the health answer's, so /status shows it)
        self.forward_choice = ForwardChoice.of(self._steps)
        # speculative decoding: drafts from the context or a draft model, verified in the steps
        # (steps/drafts.py, steps/draft_model.py)
        self.draft_counts = DraftCounts()
        self.speculative = resolve_mode(self.config.speculative, self.loaded.device.type)
        if self.speculative != "off":
            if self.config.test_first_token_delay_s or self.config.test_token_delay_s:
                why = "test delays pace one token a step"
            else:
                why = self._steps.enable_drafts(self.draft_counts)
            if why is not None:
                log.info("no speculative decoding: %s", why)
                self.speculative = "off"
        # the decode steps' torch threads on a CPU: fewer while fewer measure faster
        adaptive = self.config.adaptive_threads and self.loaded.device.type == "cpu"
        self._threads = None
        if adaptive:  # read over the CPUs this process may use (a container's cpuset)
            cpus = usable_cpus()
            self._threads = StepThreads(
                self._torch_threads,
                idle=lambda: machine_idle_seconds(cpus=cpus),
                others=lambda: other_processes_seconds(cpus=cpus),
                cores=len(cpus) if cpus else 0,
            )

    # ---- public API (any thread) -------------------------------------------------------------

    def start(self) -> Engine:
        """Start the engine's loop."""
        self._started.set()
        return self

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def live_streams(self) -> int:
        """Streams admitted to the model (prefilling or decoding)."""
        return len(self._steps.live())

    @property
    def forward(self) -> str:
        """The forward the streams run on: "compact" or "hf"."""
        return self._steps.name

    @property
    def waiting_streams(self) -> int:
        """Streams waiting for a slot."""
        return len(self._waiting)

    def step_report(self) -> StepReport | None:
        """The decode steps' thread count and pace (None off a CPU or with adaptive_threads off).
        Read from other threads: a snapshot, never a lock on the engine."""
        return self._threads.report() if self._threads is not None else None

    def memory_report(self) -> MemoryReport | None:
        """What the forward's weights and KV cache cost the host now (None on the Hugging Face
        forward or a GPU). Read from other threads: addresses and pages, never values."""
        return self._steps.memory()

    def speculation_report(self) -> dict:
        """Speculative decoding's mode and its tokens drafted and accepted since load (/status).
        Read from other threads: two counters, never a lock on the engine."""
        counts = self.draft_counts
        return {"mode": self.speculative} | speculation_counts(counts.drafted, counts.accepted)

    def health(self) -> tuple[bool, str]:
        """(healthy, reason): unhealthy once the device is poisoned or the thread has died."""
        if self._fault is not None:
            return False, self._fault
        if not self._stopping and self._thread.ident is not None and not self._thread.is_alive():
            return False, "the engine thread ended"
        return True, ""

    def submit(
        self,
        prompt_ids: Sequence[int],
        settings: SamplingSettings | None = None,
        *,
        request_id: str | None = None,
        logprobs: bool = False,
        sink: EventSink | None = None,
    ) -> StreamHandle:
        """Queue a request; raises InvalidRequest, Overloaded or EngineStopped at once."""
        settings = self._resolve(list(prompt_ids), settings or SamplingSettings())
        grammar = self._grammars.matcher(settings)  # grammar: InvalidRequest if it won't compile
        handle = StreamHandle(request_id or f"req-{next(self._ids)}", sink)
        stream = _Stream(
            handle=handle,
            prompt_ids=list(prompt_ids),
            settings=settings,
            logprobs=logprobs,
            submitted_ns=time.monotonic_ns(),
            generator=sampling.new_generator(settings.seed),
            detokenizer=IncrementalDetokenizer(self.loaded.tokenizer),
            matcher=StopStringMatcher(settings.stop),
            grammar=grammar,
        )
        with self._cond:
            if self._stopping or not self._started.is_set() or not self._thread.is_alive():
                raise EngineStopped("the engine is not running")
            if self._fault is not None:
                raise EngineStopped(f"the engine failed and awaits a restart: {self._fault}")
            if len(self._waiting) >= self.config.queue_limit:
                raise Overloaded(
                    f"{len(self._waiting)} requests are already waiting "
                    f"(queue limit {self.config.queue_limit}); retry later"
                )
            self._waiting.append(stream)
            self._cond.notify()
        return handle

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """End every stream with a CANCELLED (shutdown) event and stop the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._started.set()  # a loop never started ends at once
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- validation ----------------------------------------------------------------------------

    def _resolve(self, prompt_ids: list[int], settings: SamplingSettings) -> SamplingSettings:
        """Check the prompt against the model; fill in max_tokens."""
        self._limits.check_ids(prompt_ids)
        if settings.max_tokens is None:
            room = self._limits.room(prompt_ids)
            return replace(settings, max_tokens=min(self.config.default_max_tokens, room))
        self._limits.check_room(prompt_ids, settings.max_tokens, MAX_TOKENS)
        return settings

    # ---- the engine thread ---------------------------------------------------------------------

    def _run(self, loaded: LoadedModel | Callable[[], LoadedModel]) -> None:
        try:
            self._build(loaded)
        except BaseException as exc:  # handed to the constructor, which raises it
            self._build_error = exc
            return
        finally:
            self._built.set()
        self._started.wait()
        with torch.inference_mode():
            while True:
                new = self._admit()
                if new is None:
                    break
                try:
                    self._steps.admit(self._drop_cancelled(new))
                    self._prefill_step()
                    if self._steps.decoding():
                        self._decode_step()
                    self._failed_steps = 0
                except Exception as exc:  # a bug must not kill the thread: fail the batch
                    log.exception("engine step failed")
                    self._note_failure(exc)
                    # and the streams just taken from the queue, which a failed admission may
                    # have left outside the steps (one that already ended gets nothing more)
                    self._fail(self._steps.clear() + new, exc)
        self._shutdown_streams()
        _set_threads(self._torch_threads)  # leave torch's global count as the engine found it

    def _note_failure(self, exc: Exception) -> None:
        """Count a failed step; a poisoned device or repeated failures make the engine unhealthy."""
        self._failed_steps += 1
        if self._failed_steps >= MAX_FAILED_STEPS and self._fault is None:
            message = f"{type(exc).__name__}: {exc}"
            self._fault = f"{self._failed_steps} steps in a row failed, the last with {message}"
            log.error("engine unhealthy: %s", self._fault)
        self._check_poison(exc)

    def _check_poison(self, exc: Exception) -> None:
        """Turn unhealthy when `exc` says the device is unusable; end what waits for it."""
        message = f"{type(exc).__name__}: {exc}"
        if self._fault is None and any(marker in message for marker in POISON_MARKERS):
            self._fault = f"the device failed ({message})"
            log.error("engine unhealthy: %s", self._fault)
        if self._fault is not None and self._waiting:
            with self._cond:  # nothing waiting will ever run: end it now
                waiting, self._waiting = list(self._waiting), collections.deque()
            self._fail(waiting, EngineStopped(f"the engine failed: {self._fault}"))

    def _admit(self) -> list[_Stream] | None:
        """Take waiting requests into free slots (blocks while idle); None when stopping."""
        with self._cond:
            while not self._stopping and not self._waiting and not self._steps.live():
                # the step threads read the machine meanwhile (their first step's start count)
                timeout = LOOK_S if self._threads is not None else None
                if not self._cond.wait(timeout) and self._threads is not None:
                    self._threads.waiting()
            if self._stopping:
                return None
            # read lazily (admission stops at the first that stays), taken once it has answered
            count = admission(self._steps, ((1, len(s.prompt_ids)) for s in self._waiting))
            return [self._waiting.popleft() for _ in range(count)]

    def _drop_cancelled(self, new: list[_Stream]) -> list[_Stream]:
        """End cancelled streams, waiting, new or live, and free their rows; return new's others."""
        with self._cond:
            waiting = [s for s in self._waiting if s.handle.cancelled]
            for stream in waiting:
                self._waiting.remove(stream)
        live = [s for s in self._steps.live() if s.handle.cancelled]
        fresh = [s for s in new if s.handle.cancelled]
        for stream in waiting + fresh + live:
            self._events.finish(stream, FinishReason.CANCELLED)
        self._steps.remove(live)
        return [s for s in new if not s.handle.cancelled]

    def _prefill_step(self) -> None:
        """Prefill what this step's budget allows; streams whose prompt is done get a token."""
        if self._threads is not None and not self._threads.started:  # the engine's first step
            _set_threads(self._threads.start())
        for ready in self._steps.prefill():
            if self.config.test_first_token_delay_s:
                _pace_until(ready.streams[0].scheduled_ns, self.config.test_first_token_delay_s)
            chooser = NextTokenChooser.for_rows(
                ready.streams, self.loaded.eos_ids, ready.logits.device
            )
            self._emit(ready.streams, ready.logits, chooser)

    def _prefill_failed(self, streams: list[_Stream], exc: Exception) -> None:
        """A prompt whose prefill failed alone: that stream ends with the error."""
        self._fail(streams, exc)
        self._check_poison(exc)

    def _decode_step(self) -> None:
        """One forward pass for every decoding stream, one new token each."""
        step = self._steps.decode() if self._threads is None else self._timed_decode()
        if self.config.test_token_delay_s:
            _pace_until(self._last_emit_ns, self.config.test_token_delay_s)
        if step.drafts:
            self._emit_verified(step)
        else:
            self._emit(step.streams, step.logits, step.chooser)

    def _timed_decode(self):
        """The decode step on the thread count StepThreads picks, timed for it; every other
        torch call of the engine runs on its current count."""
        threads = self._threads
        _set_threads(threads.before())
        try:
            start = time.perf_counter()
            step = self._steps.decode()
            seconds = time.perf_counter() - start
            context = max((len(s.prompt_ids) + len(s.output_ids) for s in step.streams), default=0)
            threads.after(len(step.logits), seconds, context)  # a row per token verified
            return step
        finally:
            _set_threads(threads.current)

    # ---- a step's tokens, and streams ended (their events: stream_events.py) -------------------

    def _emit(
        self, streams: list[_Stream], logits: torch.Tensor, chooser: NextTokenChooser
    ) -> None:
        """Choose one token per row of logits [N, V]; hand out events; retire finished rows."""
        wants_logprobs = any(s.logprobs for s in streams)
        top = max((s.settings.top_logprobs for s in streams if s.logprobs), default=0)
        choice = chooser.choose(logits, streams, logprobs=wants_logprobs, top_logprobs=top)
        emitted_ns = self._last_emit_ns = time.monotonic_ns()
        done = []
        for row, stream in enumerate(streams):
            try:
                if self._events.advance(stream, choice, row, emitted_ns):
                    done.append(stream)
            except Exception as exc:  # one stream's failure must not end the others
                log.exception("stream %s failed", stream.handle.request_id)
                self._fail([stream], exc)
        self._steps.remove(done)
        if self.mask_ahead:  # the next masks are filled while the next forward runs
            compute_masks_ahead([s.grammar for s in streams if not s.ended], logits.shape[-1])

    def _emit_verified(self, step: Decoded) -> None:
        """A step with drafts: each row's first token chosen as `_emit` chooses it; then, while
        the token chosen equals the row's next drafted token, the token after it, chosen from
        the logits after that draft by the row's own pipeline: its settings, its generator's
        next draw (one a token, as in plain decoding), its grammar as advanced, its output so
        far. So the tokens are plain decoding's; a step that accepts 5 sends 5 events, in
        order. The rejected drafts' KV is dropped after (`Steps.settle`)."""
        streams, starts = step.streams, step.first_rows()
        wants_logprobs = any(s.logprobs for s in streams)
        top = max((s.settings.top_logprobs for s in streams if s.logprobs), default=0)
        first = step.logits[starts]  # [B, V]: each row's logits after its latest token
        choice = step.chooser.choose(first, streams, logprobs=wants_logprobs, top_logprobs=top)
        emitted_ns = self._last_emit_ns = time.monotonic_ns()
        done = []
        for row, stream in enumerate(streams):
            try:
                ended = self._events.advance(stream, choice, row, emitted_ns)
                drafted, at = step.drafts[row], 0
                while not ended and at < len(drafted) and stream.output_ids[-1] == drafted[at]:
                    at += 1
                    logits = step.logits[starts[row] + at][None]  # [1, V]
                    ended = self._emit_one(stream, logits, emitted_ns)
                if ended:
                    done.append(stream)
            except Exception as exc:  # one stream's failure must not end the others
                log.exception("stream %s failed", stream.handle.request_id)
                self._fail([stream], exc)
        self._steps.settle(step)
        self._steps.remove(done)

    def _emit_one(self, stream: _Stream, logits: torch.Tensor, emitted_ns: int) -> bool:
        """One token of one stream from its logits [1, V] through its own pipeline; True when
        the stream is done."""
        if stream.chooser is None:
            stream.chooser = NextTokenChooser.for_rows([stream], self.loaded.eos_ids, logits.device)
        top = stream.settings.top_logprobs if stream.logprobs else 0
        choice = stream.chooser.choose(logits, [stream], logprobs=stream.logprobs, top_logprobs=top)
        return self._events.advance(stream, choice, 0, emitted_ns)

    def _fail(self, streams: list[_Stream], exc: Exception) -> None:
        """End streams with an error event carrying a StreamingError."""
        error = StreamingError.of(exc)
        for stream in streams:
            self._events.finish(stream, FinishReason.ERROR, error)
        self._steps.remove(streams, keep=False)

    def _shutdown_streams(self) -> None:
        """On shutdown: every waiting and live stream ends with CANCELLED."""
        with self._cond:
            waiting, self._waiting = list(self._waiting), collections.deque()
        error = EngineStopped("the server is shutting down")
        for stream in waiting + self._steps.clear():
            self._events.finish(stream, FinishReason.CANCELLED, error)


def _set_threads(count: int) -> None:
    """torch's CPU threads for the calling thread's next operations, if not already so."""
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)


def _pace_until(start_ns: int, delay_s: float) -> None:
    """Sleep until `delay_s` after `start_ns` (monotonic); no sleep when that is past."""
    remaining = start_ns / 1e9 + delay_s - time.monotonic()
    if remaining > 0:
        time.sleep(remaining)
