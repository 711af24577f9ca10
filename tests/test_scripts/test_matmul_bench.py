"""scripts/matmul_bench.py: every format on tiny shapes, our kernels with AMX on and off, a row of
the table for each (format, AMX, threads, rows), formats it does not know refused, and the
integer dot peak it prints first."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "matmul_bench.py"
ROOT = SCRIPT.parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def test_the_shapes_are_a_layers_linears_times_the_layers_then_the_head(load_script):
    """q/k/v fused, o, gate/up fused and down per layer, then the head when --vocab is given."""
    script = load_script("matmul_bench")
    args = argparse.Namespace(hidden=576, intermediate=1536, heads=9, kv_heads=3, layers=30)
    layer = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
    assert script.shapes(argparse.Namespace(**vars(args), vocab=0)) == layer * 30
    assert script.shapes(argparse.Namespace(**vars(args), vocab=49152))[-1] == (576, 49152)


def test_our_kernels_run_once_per_amx_setting_and_the_others_once(load_script):
    """--amx both: (c-int4, on), (c-int4, off); aten and dense formats once, AMX off."""
    script = load_script("matmul_bench")
    runs = script.systems(["c-int4", "aten-int8", "float32"], "both")
    assert runs == [("c-int4", True), ("c-int4", False), ("aten-int8", False), ("float32", False)]
    assert script.systems(["c-int8"], "off") == [("c-int8", False)]


def test_every_format_runs_and_has_its_rows_in_the_table(load_script):
    """A tiny run of all formats at 1 and 4 rows: a row each, with its MB and a speed."""
    script = load_script("matmul_bench")
    command = [sys.executable, str(SCRIPT), "--hidden", "128", "--intermediate", "256"]
    command += ["--heads", "4", "--kv-heads", "2", "--layers", "2", "--vocab", "256"]
    command += ["--rows", "1,4", "--threads", "1", "--rounds", "1", "--passes", "1"]
    command += ["--formats", ",".join(script.FORMATS), "--amx", "off"]
    out = subprocess.run(
        command, cwd=ROOT, env=ENV, capture_output=True, text=True,
        check=True,
    ).stdout  # fmt: skip
    cells = [line.strip("| ").split(" | ") for line in out.splitlines() if line.startswith("| ")]
    rows = [c for c in cells if c[1] in ("on", "off")]  # not the header
    expected = [(name, n) for name in script.FORMATS for n in ("1", "4")]
    assert sorted((c[0], c[3]) for c in rows) == sorted(expected)
    assert all(c[-1].endswith("x") for c in rows) and "GB/s (one side)" in out
    assert "integer dot peak" in out


def test_the_dot_peak_counts_the_products_of_the_instruction_it_timed(load_script):
    """dot_peak: on a CPU with AVX2 (or AVX-512 VNNI) and a compiler, the instruction's name and
    a positive rate of u8 x s8 products (its instructions a second times their products each)."""
    script = load_script("matmul_bench")
    peak = script.dot_peak(turns=200_000)
    flags = script.cpu_flags()
    if script.build.compiler() is None or not any(
        r[0] <= flags for r in script.PEAK_KINDS.values()
    ):
        assert peak is None
        return
    kind, products = peak
    assert kind in script.PEAK_KINDS and products > 1e9


def test_a_format_it_does_not_know_is_refused():
    """An unknown format: a usage error naming the known ones, before anything is timed."""
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--formats", "c-int3"], cwd=ROOT,
        env=ENV, capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 2 and "unknown formats ['c-int3']" in run.stderr
