"""A stress run's report: the figures operators watch, each beside its reference range."""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from dataclasses import asdict

from clients.library.metrics import stats
from clients.stress.load import Outcome
from clients.stress.server_stats import Batching, Resources

SCHEMA = "tokenstream-stress/1"
MS_PER_S = 1000.0

# The reference ranges: (figure, what it must be, bound).
P99_LATENCY_MS = 500.0  # p99 latency < 500 ms
THROUGHPUT_QPS = 50.0  # throughput > 50 QPS
ACCELERATOR_UTILIZATION = 0.70  # accelerator utilisation > 70 %
MEMORY_USED = 0.80  # memory < 80 %


def summarize(
    target: Mapping,
    outcomes: Sequence[Outcome],
    batching: Batching | None,
    metrics_queue_ms: float | None,
    resources: Resources,
) -> dict:
    """The JSON report of one run."""
    ok = [o for o in outcomes if o.ok]
    span = max(o.sent_s + o.latency_s for o in outcomes) - min(o.sent_s for o in outcomes)
    errors = collections.Counter(o.error for o in outcomes if not o.ok)
    report = {
        "schema": SCHEMA,
        "target": dict(target),
        "requests": {
            "sent": len(outcomes),
            "ok": len(ok),
            "failed": len(outcomes) - len(ok),
            "success_rate": len(ok) / len(outcomes) if outcomes else None,
            "errors": dict(errors.most_common(5)),
        },
        "duration_s": span,
        "qps": len(ok) / span if span > 0 else None,
        "latency_ms": stats([o.latency_s * MS_PER_S for o in ok]).as_dict(),
        "batching": _batching(batching, metrics_queue_ms),
        "resources": asdict(resources),
    }
    report["checks"] = checks(report)
    return report


def _batching(batching: Batching | None, metrics_queue_ms: float | None) -> dict | None:
    if batching is None:
        return None
    return {
        "executions": batching.executions,
        "inferences": batching.inferences,
        "batch_sizes": {str(k): v for k, v in batching.batch_sizes.items()},
        "mean_batch_size": batching.mean_batch_size,
        "queue_ms": batching.queue_ms,
        "queue_ms_metrics": metrics_queue_ms,
        "compute_ms_per_execution": batching.compute_ms,
    }


def checks(report: Mapping) -> list[dict]:
    """Each watched figure beside its reference range, with pass / miss (n/a when unknown)."""
    r = report["resources"]
    gpu = r["gpu_utilization"] is not None
    memory = r["gpu_memory_used"] if gpu else r["host_memory_used"]
    rows = [
        ("success rate", report["requests"]["success_rate"], "%", "= 100 %", lambda v: v == 1.0),
        (
            "p99 latency",
            report["latency_ms"]["p99"],
            "ms",
            f"< {P99_LATENCY_MS:g} ms",
            lambda v: v < P99_LATENCY_MS,
        ),
        (
            "throughput",
            report["qps"],
            "QPS",
            f"> {THROUGHPUT_QPS:g} QPS",
            lambda v: v > THROUGHPUT_QPS,
        ),
        (
            "accelerator utilisation" + ("" if gpu else " (no GPU)"),
            r["gpu_utilization"],
            "%",
            f"> {ACCELERATOR_UTILIZATION:.0%}",
            lambda v: v > ACCELERATOR_UTILIZATION,
        ),
        (
            "GPU memory" if gpu else "host memory",
            memory,
            "%",
            f"< {MEMORY_USED:.0%}",
            lambda v: v < MEMORY_USED,
        ),
    ]
    return [
        {
            "figure": name,
            "value": value,
            "unit": unit,
            "reference": reference,
            "verdict": "n/a" if value is None else ("pass" if ok(value) else "miss"),
        }
        for name, value, unit, reference, ok in rows
    ]


def _value(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "%":
        return f"{value * 100:.1f} %"
    return f"{value:.1f} {unit}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def format_table(report: Mapping) -> str:
    """The report for a terminal."""
    t = report["target"]
    lines = [
        f"tokenstream stress: {t['model']} at {t['url']}, {t['requests']} requests, "
        f"{t['concurrency']} concurrent ({t['workload']})",
        "",
        f"{'figure':<34}{'value':>14}   {'reference':<12}verdict",
    ]
    for row in report["checks"]:
        value = _value(row["value"], row["unit"])
        lines.append(f"{row['figure']:<34}{value:>14}   {row['reference']:<12}{row['verdict']}")
    lat = report["latency_ms"]
    req = report["requests"]
    lines += [
        "",
        f"requests     {req['ok']} ok, {req['failed']} failed in {report['duration_s']:.1f} s",
        f"latency      mean {_ms(lat['avg'])}, p50 {_ms(lat['p50'])}, p90 {_ms(lat['p90'])}, "
        f"p99 {_ms(lat['p99'])}, max {_ms(lat['max'])}",
    ]
    for message, count in req["errors"].items():
        lines.append(f"error x{count}: {message}")
    b = report["batching"]
    if b is not None:
        sizes = " ".join(f"{size}:{n}" for size, n in b["batch_sizes"].items()) or "-"
        mean = b["mean_batch_size"]
        lines += [
            f"batches      {b['executions']} execute() for {b['inferences']} requests, "
            f"mean {mean:.1f} per execute"
            if mean
            else "batches      -",
            f"batch sizes  {sizes}   (requests per execute: count)",
            f"queue        mean {_ms(b['queue_ms'])} (statistics), "
            f"{_ms(b['queue_ms_metrics'])} (metrics port); "
            f"execute mean {_ms(b['compute_ms_per_execution'])}",
        ]
    r = report["resources"]
    if r["stub_rss_bytes"] is not None:
        lines.append(
            f"memory       model stubs RSS {r['stub_rss_bytes'] / 2**20:.0f} MiB "
            f"({len(r['stub_pids'])} processes, peak)"
        )
    return "\n".join(lines)
