"""scripts/forward_bench.py: its command line read and written back, and the tiny model's decode
step measured on the main thread, on a fresh one, and fresh against after-main in a process each
(--thread-teams, what scripts/thread_teams.py measured)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "forward_bench.py"
ROOT = SCRIPT.parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def test_the_command_line_of_a_config_reads_back_as_that_config(load_script):
    """arguments() writes what parse_args() reads: the children of --thread-teams get the bench
    asked for."""
    script = load_script("forward_bench")
    argv = ["--systems", "hf,int4@float32", "--batch", "1,16", "--threads", "1", "--model", "m"]
    cfg = script.parse_args([*argv, "--thread", "after-main", "--thread-teams", "--out", "x"])
    assert script.parse_args(script.arguments(cfg)) == cfg
    assert cfg.thread == "after-main" and cfg.thread_teams and cfg.systems == ("hf", "int4@float32")


def run(tiny_model_dir, tmp_path, *options: str) -> dict:
    out = tmp_path / "out.json"
    command = [sys.executable, str(SCRIPT), "--model", str(tiny_model_dir), "--dtype", "float32"]
    command += ["--systems", "eager,int8", "--batch", "1,2", "--prompt-tokens", "8"]
    command += ["--steps", "3", "--warmup-steps", "1", "--threads", "1", "--out", str(out)]
    subprocess.run([*command, *options], cwd=ROOT, env=ENV, check=True, capture_output=True)
    return json.loads(out.read_text())


def test_the_systems_are_measured_on_a_fresh_thread_as_on_the_main_one(tiny_model_dir, tmp_path):
    """Each system's tokens/s at each batch size, and the same greedy tokens, wherever it runs."""
    for thread in ("main", "fresh"):
        figures = run(tiny_model_dir, tmp_path, "--thread", thread, "--rounds", "1")
        for batch in ("1", "2"):
            assert set(figures["batches"][batch]["tokens_per_s"]) == {"eager", "int8"}
            assert figures["batches"][batch]["greedy_agreement_with_baseline"]["eager"] == 1.0


def test_thread_teams_compare_a_fresh_thread_with_one_after_main(tiny_model_dir, tmp_path):
    """--thread-teams: per batch and system, each case's tokens/s and how much longer the step
    is after the main thread ran its own team (the ratio of the two rates)."""
    figures = run(tiny_model_dir, tmp_path, "--thread-teams", "--rounds", "1")
    assert set(figures) == {f"{b} {s}" for b in (1, 2) for s in ("eager", "int8")}
    for rates in figures.values():
        assert rates["fresh"] > 0 and rates["after-main"] > 0
        ratio = rates["fresh"] / rates["after-main"]
        assert rates["step_after_main_vs_fresh"] == ratio
