"""The benchmark's outputs: the JSON document, terminal tables and the side-by-side comparison
(per turn index too, for multi-turn runs)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from clients.bench.summary import (
    BREAKDOWN_HELP,
    BREAKDOWN_PARTS,
    LATER_TURNS_FROM,
    ClockMap,
    RequestRecord,
    summarize,
    ttft_breakdown_ns,
)
from clients.bench.transports import TRANSPORTS
from clients.library.chunk import Chunk
from clients.library.metrics import NS_PER_MS

SCHEMA = "tokenstream-bench/2"  # /2: TTFT to the first response, time to first text apart

# Stats rows of a run's table: (key in the summary, label, unit).
STAT_ROWS = (
    ("ttft_ms", "Time to first token", "ms"),
    ("time_to_first_text_ms", "Time to first text", "ms"),
    ("itl_ms", "Inter-token latency", "ms"),
    ("server_itl_ms", "  (server-side ITL)", "ms"),
    ("request_latency_ms", "Request latency", "ms"),
    ("output_tokens", "Output tokens / request", "tok"),
    ("input_tokens", "Input tokens / request", "tok"),
)
STAT_COLS = ("avg", "min", "max", "p50", "p90", "p99")
TURN_STATS = ("ttft_ms", "input_tokens", "cached_tokens")  # of each turn in summary.multi_turn


@dataclass
class RunResult:
    """One transport at one load level, with every request's record."""

    transport: str
    url: str
    concurrency: int | None
    request_rate: float | None
    clock: ClockMap
    records: list[RequestRecord]
    note: str | None = None  # replaces the clock note (e.g. for imported runs)


def _ms(ns: float | None) -> float | None:
    return None if ns is None else ns / NS_PER_MS


def _response_row(c: Chunk) -> list:
    """[client receive ns, tokens, characters, server emitted ns or null] of one response."""
    return [c.received_ns, c.tokens, len(c.text), None if c.timing is None else c.timing.emitted_ns]


def record_json(r: RequestRecord, clock: ClockMap) -> dict:
    """One request: its derived figures and its raw timeline (client monotonic ns)."""
    b = ttft_breakdown_ns(r, clock)
    return {
        "index": r.index,
        "conversation": r.conversation,
        "turn": r.turn,
        "status": r.status,
        "error": r.error,
        "finish_reason": r.finish_reason,
        "input_tokens": r.prompt_tokens,
        "output_tokens": r.output_tokens(),
        "ttft_ms": _ms(r.ttft_ns()),
        "time_to_first_text_ms": _ms(r.time_to_first_text_ns()),
        "itl_ms": _ms(r.itl_ns()),
        "request_latency_ms": _ms(r.request_latency_ns()),
        "ttft_breakdown_ms": None if b is None else {k: _ms(v) for k, v in b.items()},
        "sent_ns": r.sent_ns,
        # [client receive ns, tokens, characters, server emitted ns or null] per response
        "responses": [_response_row(c) for c in r.chunks],
        "server_timing": None if r.server_timing is None else asdict(r.server_timing),
        "extra": r.extra,
    }


def clock_note(clock: ClockMap) -> str:
    """How server stamps were put on the client's clock."""
    if clock.same_clock:
        return "client and server share CLOCK_MONOTONIC: breakdown is exact"
    return (
        "clocks differ: server stamps converted through wall_minus_monotonic_ns; "
        "to_server/to_client include the offset between the two machines' wall clocks"
    )


def run_json(run: RunResult) -> dict:
    """One run's summary and raw records."""
    return {
        "transport": run.transport,
        "url": run.url,
        "concurrency": run.concurrency,
        "request_rate": run.request_rate,
        "same_clock": run.clock.same_clock,
        "clock_note": run.note or clock_note(run.clock),
        "summary": summarize(run.records, run.clock),
        "requests": [record_json(r, run.clock) for r in run.records],
    }


def build_report(config: dict, runs: Sequence[RunResult], created: str) -> dict:
    """The whole JSON document."""
    return {
        "schema": SCHEMA,
        "created": created,
        "config": config,
        "definitions": {
            "ttft": "first response - request sent",
            "time_to_first_text": "first response with printable text - request sent",
            "itl": "(request latency - ttft) / (output tokens - 1)",
            "request_latency": "last response - request sent",
            "output_token_throughput": "output tokens / (last response - first request sent)",
            "output_tokens": "sum of the server's num_output_tokens",
            "ttft_breakdown": BREAKDOWN_HELP,
            "multi_turn": "per turn index: the TTFT above, the server's num_input_tokens and the "
            "prompt tokens it reused from its prefix cache (timing.cached_tokens); later_turns: "
            f"every turn from {LATER_TURNS_FROM} on",
        },
        "runs": [run_json(r) for r in runs],
    }


def _require(cond: bool, where: str) -> None:
    if not cond:
        raise ValueError(f"not a {SCHEMA} document: {where}")


def _check_stats(s: object, where: str) -> None:
    _require(isinstance(s, dict) and isinstance(s.get("count"), int), f"{where}.count")
    for key in STAT_COLS:
        _require(key in s and (s[key] is None or isinstance(s[key], int | float)), f"{where}.{key}")


def _check_turns(mt: object, where: str) -> None:
    """The multi_turn block of a summary: per-turn figures and the later turns'."""
    _require(isinstance(mt, dict) and isinstance(mt.get("per_turn"), list), f"{where}.per_turn")
    later = mt.get("later_turns")
    _require(isinstance(later, dict) and isinstance(later.get("from_turn"), int), f"{where}.later")
    for i, figures in enumerate([*mt["per_turn"], later]):
        at = f"{where}.per_turn[{i}]" if i < len(mt["per_turn"]) else f"{where}.later_turns"
        _require(isinstance(figures, dict), at)
        for key in ("requests", "completed"):
            _require(isinstance(figures.get(key), int), f"{at}.{key}")
        for key in TURN_STATS:
            _check_stats(figures.get(key), f"{at}.{key}")


def validate_report(doc: dict) -> None:
    """Raise ValueError naming the first field that does not match the schema."""
    _require(doc.get("schema") == SCHEMA, "schema")
    _require(isinstance(doc.get("config"), dict), "config")
    _require(isinstance(doc.get("runs"), list), "runs")
    for i, run in enumerate(doc["runs"]):
        where = f"runs[{i}]"
        _require(run.get("transport") in TRANSPORTS, f"{where}.transport")
        _require(isinstance(run.get("same_clock"), bool), f"{where}.same_clock")
        s = run.get("summary")
        _require(isinstance(s, dict), f"{where}.summary")
        for key in ("requests", "completed", "errors", "cancelled", "total_output_tokens"):
            _require(isinstance(s.get(key), int), f"{where}.summary.{key}")
        for key, _, _ in STAT_ROWS:
            _check_stats(s.get(key), f"{where}.summary.{key}")
        for part in BREAKDOWN_PARTS:
            _check_stats(s["ttft_breakdown_ms"].get(part), f"{where}.summary.ttft_breakdown_ms")
        if s.get("multi_turn") is not None:
            _check_turns(s["multi_turn"], f"{where}.summary.multi_turn")
        _require(isinstance(run.get("requests"), list), f"{where}.requests")
        _require(len(run["requests"]) == s["requests"], f"{where}.requests length")
        for j, r in enumerate(run["requests"]):
            _require(r.get("status") in ("ok", "error", "cancelled"), f"{where}.requests[{j}]")
            _require(isinstance(r.get("sent_ns"), int), f"{where}.requests[{j}].sent_ns")
            rows = r.get("responses")
            _require(isinstance(rows, list), f"{where}.requests[{j}].responses")
            _require(all(len(x) == 4 for x in rows), f"{where}.requests[{j}].responses rows")


def load_report(path: Path) -> dict:
    """Read and validate a JSON report."""
    doc = json.loads(Path(path).read_text())
    validate_report(doc)
    return doc


# --- terminal tables --------------------------------------------------------------------------


def fmt(v: float | None, digits: int = 2) -> str:
    """A number for a table cell; '-' when undefined."""
    return "-" if v is None else f"{v:,.{digits}f}"


def level_label(run: dict) -> str:
    """c=4 or rate=2/s."""
    if run.get("concurrency") is not None:
        return f"c={run['concurrency']}"
    return f"rate={run['request_rate']:g}/s"


def format_run(run: dict) -> str:
    """A genai-perf-style table of one run: a row per metric, avg/min/max/percentiles."""
    s = run["summary"]
    head = f"{'':<26}" + "".join(f"{c:>10}" for c in STAT_COLS)
    lines = [
        f"== {run['transport']} {level_label(run)}  ({run['url']})",
        f"requests {s['requests']}: completed {s['completed']}, errors {s['errors']}, "
        f"cancelled {s['cancelled']}",
        head,
    ]
    rows = [(s[k], f"{label} ({unit})") for k, label, unit in STAT_ROWS]
    rows += [(s["ttft_breakdown_ms"][p], f"  TTFT {p} (ms)") for p in BREAKDOWN_PARTS]
    for st, label in rows:
        if st["count"]:
            lines.append(f"{label:<26}" + "".join(f"{fmt(st[c]):>10}" for c in STAT_COLS))
    lines.append(
        f"output token throughput {fmt(s['output_token_throughput'])} tok/s, "
        f"request throughput {fmt(s['request_throughput'], 3)} req/s, "
        f"duration {fmt(s['duration_s'])} s"
    )
    lines.append(f"clock: {run['clock_note']}")
    if s.get("multi_turn"):
        lines += format_turns(s["multi_turn"])
    return "\n".join(lines)


def turn_rows(mt: dict) -> list[tuple[str, dict]]:
    """(label, figures) per turn index, then the later turns' when the run reached them."""
    rows = [(str(t["turn"]), t) for t in mt["per_turn"]]
    later = mt["later_turns"]
    if later["requests"]:
        rows.append((f"{later['from_turn']}-{later['to_turn']}", later))
    return rows


def format_turns(mt: dict) -> list[str]:
    """A multi-turn run's TTFT per turn index, with its prompt and cached prompt tokens."""
    lines = [
        "TTFT per turn (ms); prompt: average prompt tokens, cached: of them, the average reused",
        "from the prefix cache",
        f"{'turn':<8}{'ok/sent':>9}{'p50':>10}{'p90':>10}{'avg':>10}{'prompt':>10}{'cached':>10}",
    ]
    for label, f in turn_rows(mt):
        t, counts = f["ttft_ms"], f"{f['completed']}/{f['requests']}"
        lines.append(
            f"{label:<8}{counts:>9}{fmt(t['p50']):>10}{fmt(t['p90']):>10}{fmt(t['avg']):>10}"
            f"{fmt(f['input_tokens']['avg'], 1):>10}{fmt(f['cached_tokens']['avg'], 1):>10}"
        )
    return lines


OVERVIEW_COLS = (
    ("TTFT p50", lambda s: s["ttft_ms"]["p50"]),
    ("TTFT p99", lambda s: s["ttft_ms"]["p99"]),
    ("ITL p50", lambda s: s["itl_ms"]["p50"]),
    ("ITL p99", lambda s: s["itl_ms"]["p99"]),
    ("tok/s", lambda s: s["output_token_throughput"]),
) + tuple((p, (lambda s, p=p: s["ttft_breakdown_ms"][p]["avg"])) for p in BREAKDOWN_PARTS)


def format_overview(doc: dict) -> str:
    """One row per run: headline figures (ms) and the average TTFT breakdown."""
    head = f"{'transport':<10}{'level':<12}{'ok/err/canc':>12}" + "".join(
        f"{name:>11}" for name, _ in OVERVIEW_COLS
    )
    lines = [head]
    for run in doc["runs"]:
        s = run["summary"]
        counts = f"{s['completed']}/{s['errors']}/{s['cancelled']}"
        cells = "".join(f"{fmt(get(s)):>11}" for _, get in OVERVIEW_COLS)
        lines.append(f"{run['transport']:<10}{level_label(run):<12}{counts:>12}{cells}")
    lines.append("latencies in ms; breakdown columns are averages that add up to the average TTFT:")
    lines += [f"  {p:<10} {BREAKDOWN_HELP[p]}" for p in BREAKDOWN_PARTS]
    for run in doc["runs"]:
        later = (run["summary"].get("multi_turn") or {}).get("later_turns")
        if later and later["requests"]:
            lines.append(
                f"TTFT p50 of turns {later['from_turn']}-{later['to_turn']}: {run['transport']} "
                f"{level_label(run)} {fmt(later['ttft_ms']['p50'])} ms"
            )
    return "\n".join(lines)


# --- comparison -------------------------------------------------------------------------------

COMPARE_ROWS = (
    ("TTFT avg (ms)", lambda s: s["ttft_ms"]["avg"]),
    ("TTFT p50 (ms)", lambda s: s["ttft_ms"]["p50"]),
    ("TTFT p90 (ms)", lambda s: s["ttft_ms"]["p90"]),
    ("TTFT p99 (ms)", lambda s: s["ttft_ms"]["p99"]),
    ("first text avg (ms)", lambda s: s["time_to_first_text_ms"]["avg"]),
    ("ITL avg (ms)", lambda s: s["itl_ms"]["avg"]),
    ("ITL p50 (ms)", lambda s: s["itl_ms"]["p50"]),
    ("ITL p99 (ms)", lambda s: s["itl_ms"]["p99"]),
    ("latency avg (ms)", lambda s: s["request_latency_ms"]["avg"]),
    ("output tok/s", lambda s: s["output_token_throughput"]),
    ("requests/s", lambda s: s["request_throughput"]),
    ("errors", lambda s: s["errors"]),
    ("cancelled", lambda s: s["cancelled"]),
) + tuple(
    (f"TTFT {p} avg (ms)", (lambda s, p=p: s["ttft_breakdown_ms"][p]["avg"]))
    for p in BREAKDOWN_PARTS
)


def run_key(run: dict) -> tuple:
    """What makes two runs comparable: transport and load level."""
    return (run["transport"], run.get("concurrency"), run.get("request_rate"))


def ratio(a: float | None, b: float | None) -> str:
    """b / a as 'x1.23', or '-' when undefined."""
    if a is None or b is None or a == 0:
        return "-"
    return f"x{b / a:.2f}"


def format_compare(a: dict, b: dict, names: tuple[str, str] = ("A", "B")) -> str:
    """Two reports side by side, matched by transport and level, with B/A ratios."""
    b_runs = {run_key(r): r for r in b["runs"]}
    a_keys = {run_key(r) for r in a["runs"]}
    lines = [f"A = {names[0]}", f"B = {names[1]}"]
    for ra in a["runs"]:
        rb = b_runs.get(run_key(ra))
        lines.append(f"\n== {ra['transport']} {level_label(ra)}")
        if rb is None:
            lines.append("   only in A")
            continue
        lines.append(f"{'':<26}{'A':>12}{'B':>12}{'B/A':>9}")
        for label, get in COMPARE_ROWS:
            va, vb = get(ra["summary"]), get(rb["summary"])
            lines.append(f"{label:<26}{fmt(va):>12}{fmt(vb):>12}{ratio(va, vb):>9}")
        lines += compare_turns(ra["summary"].get("multi_turn"), rb["summary"].get("multi_turn"))
    for rb in b["runs"]:
        if run_key(rb) not in a_keys:
            lines.append(f"\n== {rb['transport']} {level_label(rb)}\n   only in B")
    return "\n".join(lines)


def compare_turns(mta: dict | None, mtb: dict | None) -> list[str]:
    """Two multi-turn runs' TTFT per turn index side by side, with B/A ratios; [] unless both
    ran conversations."""
    if not mta or not mtb:
        return []
    a_rows, b_rows = dict(turn_rows(mta)), dict(turn_rows(mtb))
    labels = [*a_rows, *(label for label in b_rows if label not in a_rows)]
    lines = [
        "TTFT per turn (ms); B/A = B's figure / A's, below 1 when B's first tokens come sooner;",
        "cached: average prompt tokens reused from the prefix cache",
        f"{'turn':<8}{'A p50':>10}{'B p50':>10}{'B/A':>8}{'A p90':>10}{'B p90':>10}{'B/A':>8}"
        f"{'A cached':>10}{'B cached':>10}",
    ]
    empty = {"ttft_ms": {"p50": None, "p90": None}, "cached_tokens": {"avg": None}}
    for label in labels:
        fa, fb = a_rows.get(label, empty), b_rows.get(label, empty)
        cells = ""
        for p in ("p50", "p90"):
            va, vb = fa["ttft_ms"][p], fb["ttft_ms"][p]
            cells += f"{fmt(va):>10}{fmt(vb):>10}{ratio(va, vb):>8}"
        ca, cb = fa["cached_tokens"]["avg"], fb["cached_tokens"]["avg"]
        lines.append(f"{label:<8}{cells}{fmt(ca, 1):>10}{fmt(cb, 1):>10}")
    return lines
