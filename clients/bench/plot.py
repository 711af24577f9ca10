"""A PNG of a benchmark report: latency percentiles and throughput vs load, TTFT breakdown."""

from __future__ import annotations

from pathlib import Path

from clients.bench.report import level_label
from clients.bench.summary import BREAKDOWN_PARTS

PERCENTILES = (("p50", "-"), ("p90", "--"), ("p99", ":"))
PART_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3")


def load_of(run: dict) -> float:
    """The x value of a run: its concurrency, or its request rate."""
    return run["concurrency"] if run.get("concurrency") is not None else run["request_rate"]


def by_transport(doc: dict) -> dict[str, list[dict]]:
    """Runs grouped by transport, each group sorted by load."""
    groups: dict[str, list[dict]] = {}
    for run in doc["runs"]:
        groups.setdefault(run["transport"], []).append(run)
    return {t: sorted(rs, key=load_of) for t, rs in groups.items()}


def _percentile_lines(ax, groups: dict, key: str, title: str, xlabel: str) -> None:
    """One line per transport and percentile of summary[key] against load."""
    for i, (transport, runs) in enumerate(groups.items()):
        xs = [load_of(r) for r in runs]
        for p, style in PERCENTILES:
            ys = [r["summary"][key][p] for r in runs]
            if any(y is not None for y in ys):
                ax.plot(xs, ys, style, marker="o", color=f"C{i}", label=f"{transport} {p}")
    ax.set(title=title, xlabel=xlabel, ylabel="ms")
    ax.legend(fontsize=7)


def _throughput(ax, groups: dict, xlabel: str) -> None:
    """Output tokens per second against load, per transport."""
    for i, (transport, runs) in enumerate(groups.items()):
        ys = [r["summary"]["output_token_throughput"] for r in runs]
        ax.plot([load_of(r) for r in runs], ys, marker="o", color=f"C{i}", label=transport)
    ax.set(title="Output token throughput", xlabel=xlabel, ylabel="tokens/s")
    ax.legend(fontsize=7)


def _breakdown(ax, doc: dict) -> None:
    """Stacked bars of the average TTFT parts per run, with the client's TTFT as a marker."""
    runs = doc["runs"]
    xs = range(len(runs))
    bottoms = [0.0] * len(runs)
    for part, color in zip(BREAKDOWN_PARTS, PART_COLORS, strict=True):
        hs = [r["summary"]["ttft_breakdown_ms"][part]["avg"] or 0.0 for r in runs]
        ax.bar(xs, hs, bottom=bottoms, color=color, label=part)
        bottoms = [b + h for b, h in zip(bottoms, hs, strict=True)]
    ttft = [r["summary"]["ttft_ms"]["avg"] for r in runs]
    ax.plot(xs, [t if t is not None else float("nan") for t in ttft], "k_", ms=14, label="TTFT")
    ax.set_xticks(list(xs), [f"{r['transport']}\n{level_label(r)}" for r in runs], fontsize=7)
    ax.set(title="TTFT breakdown (averages)", ylabel="ms")
    ax.legend(fontsize=7)


def plot_report(doc: dict, path: Path) -> Path:
    """Write the 2x2 figure to `path` and return it."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    groups = by_transport(doc)
    rate = all(r.get("concurrency") is None for r in doc["runs"])
    xlabel = "request rate (req/s)" if rate else "concurrency"
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    _percentile_lines(axes[0][0], groups, "ttft_ms", "Time to first token", xlabel)
    _percentile_lines(axes[0][1], groups, "itl_ms", "Inter-token latency", xlabel)
    _throughput(axes[1][0], groups, xlabel)
    _breakdown(axes[1][1], doc)
    loads = sorted({load_of(r) for r in doc["runs"]})
    for ax in (axes[0][0], axes[0][1], axes[1][0]):
        if len(loads) > 2:
            ax.set_xscale("log", base=2)  # levels like 1, 4, 16 spread evenly
        ax.set_xticks(loads, [f"{x:g}" for x in loads])
        ax.set_ylim(bottom=0)  # absolute scale: a flat line should look flat
    fig.suptitle(f"tokenstream bench ({doc.get('created', '')})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
