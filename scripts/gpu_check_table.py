"""The one table of scripts/gpu_check.sh: every figure its steps wrote under OUT.

    python scripts/gpu_check_table.py OUT [FAILED_STEP ...]

Reads OUT/forward.json (scripts/forward_bench.py), OUT/engine.json (`tokenstream engine-bench`)
and OUT/served-compile-{off,on}-c{1,16}/bench.json (`tokenstream bench`); a file that is missing
or unreadable leaves its rows out, and the last line names the steps that failed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HEADER = ("what", "streams", "tok/s", "TTFT p50 ms", "ITL avg ms", "ITL p99 ms")
SERVED = [(compile_, c) for compile_ in ("off", "on") for c in (1, 16)]


def load(path: Path) -> dict | None:
    """A JSON file, or None when it is missing or not JSON."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def num(value: float | None) -> str:
    """One decimal, or '-'."""
    return "-" if value is None else f"{value:,.1f}"


def latency_cells(ttft: dict, itl: dict) -> tuple[str, str, str]:
    """TTFT p50, ITL avg and p99 of a stats mapping (clients/library/metrics.py)."""
    return num(ttft.get("p50")), num(itl.get("avg")), num(itl.get("p99"))


def rows(out: Path) -> list[tuple[str, ...]]:
    """The table's rows, header first."""
    table = [HEADER]
    forward = load(out / "forward.json") or {}
    for batch, figures in forward.get("batches", {}).items():
        for system, rate in figures["tokens_per_s"].items():
            table.append((f"decode step: {system}", str(batch), num(rate), "-", "-", "-"))
    engine = load(out / "engine.json") or {}
    for r in engine.get("results", []):
        what, streams = f"engine: {r['system']} {r['dtype']}", str(r["concurrency"])
        cells = latency_cells(r["ttft_ms"], r["itl_ms"])
        table.append((what, streams, num(r["tokens_per_s"]), *cells))
    for compile_, c in SERVED:
        bench = load(out / f"served-compile-{compile_}-c{c}" / "bench.json") or {}
        for run in bench.get("runs", []):
            s = run["summary"]
            rate = num(s["output_token_throughput"])
            cells = latency_cells(s["ttft_ms"], s["itl_ms"])
            table.append((f"served: --compile {compile_}", str(c), rate, *cells))
    return table


def render(table: list[tuple[str, ...]], failed: list[str]) -> str:
    """Aligned columns and a last line naming the failed steps."""
    widths = [max(len(row[i]) for row in table) for i in range(len(HEADER))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    return "\n".join(lines + ["failed steps: " + (", ".join(failed) or "none")])


if __name__ == "__main__":
    print(render(rows(Path(sys.argv[1])), sys.argv[2:]))
