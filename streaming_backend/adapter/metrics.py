"""Our metric families on Triton's metrics port: the chat model's, fed from the outbox thread,
and the dialogue model's, fed after each execute().

Names follow vLLM's where one exists, for dashboards: tokenstream_time_to_first_token_seconds is
the server's first-token latency (received by the model -> first token emitted), called
`first_token` here; TTFT in this project names genai-perf's interval, which a client measures
(docs/ttft.md). The pb_utils module is not importable outside the model's
process, so `Metrics` is given its `MetricFamily` class; tests pass a small fake of it. No call
here ever raises: a failed metrics call is logged, and a stream never ends because of one.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from streaming_backend.engine.step_threads import StepReport
from streaming_backend.events import FinishReason, TokenEvent
from streaming_backend.wire import SPEC_ACCEPTED_METRIC, SPEC_DRAFTED_METRIC

log = logging.getLogger("tokenstream.model")
LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0]
ITL_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5]
OK, FAILED, CANCELLED, REJECTED = "ok", "failed", "cancelled", "rejected"
OUTCOMES = (OK, FAILED, CANCELLED, REJECTED)  # labels of tokenstream_requests_total
# The slowdown gauge is set at most this often (a thread count change is set at once): a gauge's
# set, unlike every other metrics call, keeps the model process's GIL for its round trip to
# Triton's process, so the engine thread's Python waits on it (docs/design.md).
STEP_GAUGES_EVERY_S = 1.0


def outcome(event: TokenEvent) -> str:
    """How a finished stream counts in tokenstream_requests_total."""
    if event.finish_reason is FinishReason.CANCELLED:
        return CANCELLED
    return FAILED if event.error is not None else OK


def quietly(call: Callable, *args) -> None:
    """A metrics call whose failure is logged, never raised: metrics must not end a stream."""
    try:
        call(*args)
    except Exception:  # noqa: BLE001
        log.exception("a metrics call failed")


def metric_maker(family, labels: dict[str, str], families: list) -> Callable:
    """make(name, doc, kind, **kw): a metric of a new family with `labels`; the family is kept
    in `families` (a Metric is unusable once its MetricFamily is garbage-collected)."""

    def make(name, doc, kind, **kw):
        families.append(family(name=name, description=doc, kind=kind))
        return families[-1].Metric(labels=labels, **kw)

    return make


class DraftCounters:
    """Speculative decoding's drafted and accepted tokens as two counters of one model's
    labels (wire.SPEC_DRAFTED_METRIC, SPEC_ACCEPTED_METRIC), grown by what is new."""

    def __init__(self, make: Callable, counter_kind):
        self.drafted = make(
            SPEC_DRAFTED_METRIC,
            "Tokens drafted by speculative decoding and verified in the running batch",
            counter_kind,
        )
        self.accepted = make(
            SPEC_ACCEPTED_METRIC,
            "Drafted tokens accepted: equal to the token decoding chose at their position",
            counter_kind,
        )
        self._added = (0, 0)  # drafted and accepted tokens as last added to the counters

    def add(self, drafted: int, accepted: int) -> bool:
        """The totals since load: the counters grow by what is new since the last call.
        Whether anything was new."""
        before_drafted, before_accepted = self._added
        if drafted == before_drafted:
            return False
        quietly(self.drafted.increment, drafted - before_drafted)
        quietly(self.accepted.increment, accepted - before_accepted)
        self._added = (drafted, accepted)
        return True


class Metrics:
    """The chat model's metrics; `family` is pb_utils.MetricFamily (or a fake of it)."""

    def __init__(self, family, model_name: str, version: str):
        labels = {"model": model_name, "version": version}
        self._families = []
        make = metric_maker(family, labels, self._families)

        self.first_token = make(
            "tokenstream_time_to_first_token_seconds",
            "Time from request received to first token emitted",
            family.HISTOGRAM,
            buckets=LATENCY_BUCKETS,
        )
        self.tpot = make(
            "tokenstream_time_per_output_token_seconds",
            "Mean inter-token latency of each finished request",
            family.HISTOGRAM,
            buckets=ITL_BUCKETS,
        )
        self.queue = make(
            "tokenstream_request_queue_time_seconds",
            "Time from request received to its prefill start",
            family.HISTOGRAM,
            buckets=LATENCY_BUCKETS,
        )
        self.tokens = make(
            "tokenstream_generation_tokens_total", "Output tokens generated", family.COUNTER
        )
        self.active = make(
            "tokenstream_active_streams", "Requests accepted and not yet finished", family.GAUGE
        )
        self.prompt_tokens = make(
            "tokenstream_prompt_tokens_total", "Prompt tokens of started requests", family.COUNTER
        )
        self.cached_tokens = make(
            "tokenstream_prefix_cache_reused_tokens_total",
            "Prompt tokens whose KV came from the prefix cache (not prefilled again)",
            family.COUNTER,
        )
        self.cache_hits = make(
            "tokenstream_prefix_cache_hits_total",
            "Started requests that reused a cached prefix",
            family.COUNTER,
        )
        self.waiting = make(
            "tokenstream_waiting_requests",
            "Requests accepted and waiting for a slot in the running batch",
            family.GAUGE,
        )
        self.step_threads = make(
            "tokenstream_step_threads",
            "torch CPU threads the decode steps run on now (adaptive_threads)",
            family.GAUGE,
        )
        self.step_slowdown = make(
            "tokenstream_step_slowdown",
            "Recent decode step time over the fastest of the same rows since load (1: full speed)",
            family.GAUGE,
        )
        self.drafts = DraftCounters(make, family.COUNTER)
        self.drafted, self.accepted = self.drafts.drafted, self.drafts.accepted
        self.acceptance = make(
            "tokenstream_spec_decode_acceptance_rate",
            "Accepted over drafted tokens since load (0 before any draft)",
            family.GAUGE,
        )
        self.rejected = make(
            "tokenstream_rejected_requests_total",
            "Requests refused (invalid or overloaded)",
            family.COUNTER,
        )
        # nv_inference_request_success counts refused and cancelled requests as successes
        requests = family(
            name="tokenstream_requests_total",
            description="Requests by outcome: ok, failed, cancelled, rejected (refused at entry)",
            kind=family.COUNTER,
        )
        self._families.append(requests)
        self.outcomes = {o: requests.Metric(labels=labels | {"outcome": o}) for o in OUTCOMES}
        # the gauges' values as last set
        self._reported = {
            "active": 0, "waiting": 0, "step_threads": 0, "step_slowdown": 0.0, "acceptance": 0.0
        }  # fmt: skip
        # time.monotonic() of set_steps' last look at a report (the limit had passed, or a switch)
        self._steps_set_at = -math.inf
        # output tokens not yet added to tokenstream_generation_tokens_total: every metrics call
        # is a round trip to Triton's process, so the counter is added to when a stream ends and
        # at each poll (flush_tokens), not once a token (docs/design.md)
        self._unreported_tokens = 0

    def count(self, outcome: str) -> None:
        """One more request ended with `outcome` (one of OUTCOMES)."""
        quietly(self.outcomes[outcome].increment, 1)

    def count_rejected(self) -> None:
        """One more request refused at entry."""
        self.count(REJECTED)
        quietly(self.rejected.increment, 1)

    def set_active(self, active: int) -> None:
        """The active-streams gauge, set only when the number changed."""
        self._set_gauge("active", active)

    def set_waiting(self, waiting: int) -> None:
        """The waiting-requests gauge, set only when the number changed."""
        self._set_gauge("waiting", waiting)

    def set_steps(self, report: StepReport | None, now: float | None = None) -> None:
        """The decode steps' thread count and slowdown (to 0.01), set when they changed: a new
        thread count at once, the slowdown at most once in STEP_GAUGES_EVERY_S (`now`:
        time.monotonic() unless given); nothing without a report (a GPU, adaptive_threads off)."""
        if report is None:
            return
        now = time.monotonic() if now is None else now
        switched = report.threads != self._reported["step_threads"]
        if not switched and now - self._steps_set_at < STEP_GAUGES_EVERY_S:
            return
        self._steps_set_at = now
        self._set_gauge("step_threads", report.threads)
        if report.slowdown is not None:
            self._set_gauge("step_slowdown", round(report.slowdown, 2))

    def set_drafts(self, drafted: int, accepted: int) -> None:
        """Speculative decoding's tokens drafted and accepted since load: the counters grow by
        what is new since the last call, the rate gauge is set when it changed."""
        if self.drafts.add(drafted, accepted):
            self._set_gauge("acceptance", round(accepted / drafted, 3))

    def _set_gauge(self, name: str, value: float) -> None:
        if value != self._reported[name]:
            quietly(getattr(self, name).set, value)
            self._reported[name] = value

    def observe(self, event: TokenEvent, received_ns: int, first_emitted_ns: int) -> None:
        """One event of a stream received at `received_ns` whose first token was emitted at
        `first_emitted_ns`: first-token latency and queue time at the first token, mean ITL at the
        end; its tokens are counted, added to the counter at the stream's end or the next
        flush_tokens."""
        quietly(self._observe, event, received_ns, first_emitted_ns)

    def flush_tokens(self) -> None:
        """Add the output tokens counted since the last flush to the token counter."""
        unreported, self._unreported_tokens = self._unreported_tokens, 0
        if unreported:
            quietly(self.tokens.increment, unreported)

    def _observe(self, event: TokenEvent, received_ns: int, first_emitted_ns: int) -> None:
        self._unreported_tokens += len(event.token_ids)
        if event.final:  # a stream that ended is counted whole
            self.flush_tokens()
        if not event.token_ids:
            return
        if event.num_output_tokens == 1:
            self.prompt_tokens.increment(event.num_input_tokens)
            if event.cached_tokens:
                self.cache_hits.increment(1)
                self.cached_tokens.increment(event.cached_tokens)
            self.first_token.observe((event.emitted_ns - received_ns) / 1e9)
            self.queue.observe((event.scheduled_ns - received_ns) / 1e9)
        elif event.final:
            self.tpot.observe(
                (event.emitted_ns - first_emitted_ns) / 1e9 / (event.num_output_tokens - 1)
            )


DIALOGUE_BATCH_BUCKETS = [1, 2, 4, 8, 12, 16, 24, 32]


class DialogueMetrics:
    """The dialogue model's metrics: requests per execute(), and speculative decoding's
    drafted and accepted tokens under the chat model's names with this model's labels.

    Its instances share each labelled metric (Triton hands every instance the same series), so
    the counters sum the instances' tokens; no acceptance-rate gauge, which each instance would
    set to its own rate: the rate is the counters' quotient (/status computes it)."""

    def __init__(self, family, model_name: str, version: str):
        labels = {"model": model_name, "version": version}
        self._families = []
        make = metric_maker(family, labels, self._families)
        self.batch_size = make(
            "tokenstream_dialogue_batch_size",
            "Requests per execute() of the dialogue model (the batches Triton formed)",
            family.HISTOGRAM,
            buckets=DIALOGUE_BATCH_BUCKETS,
        )
        self.drafts = DraftCounters(make, family.COUNTER)

    def observe_batch(self, requests: int) -> None:
        """One execute() of `requests` requests."""
        quietly(self.batch_size.observe, requests)

    def set_drafts(self, drafted: int, accepted: int) -> None:
        """This instance's drafted and accepted tokens since load (the counters grow by what is
        new since the last call)."""
        self.drafts.add(drafted, accepted)
