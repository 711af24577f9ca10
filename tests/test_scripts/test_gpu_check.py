"""scripts/gpu_check.sh: refuses clearly without a GPU, and its table reads what the steps write."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def run_check(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """The check with OUT under tmp_path and these environment variables."""
    environment = os.environ | {"OUT": str(tmp_path / "out")} | env
    return subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, timeout=120, env=environment
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the check would run")
def test_without_a_gpu_it_says_so_and_runs_nothing(tmp_path):
    """No CUDA GPU: exit 2, one line saying why, no results folder."""
    tokenstream = Path(sys.executable).with_name("tokenstream")  # this environment's own
    done = run_check(tmp_path, PYTHON=sys.executable, TOKENSTREAM=str(tokenstream))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no CUDA GPU visible to torch" in done.stderr and "nothing run" in done.stderr
    assert not (tmp_path / "out").exists()


def test_without_the_environment_it_says_so(tmp_path):
    """No project .venv: exit 2 naming scripts/setup.sh."""
    done = run_check(tmp_path, PYTHON=str(tmp_path / "missing-python"))
    assert done.returncode == 2
    assert "run scripts/setup.sh first" in done.stderr


def stats(p50: float, avg: float, p99: float) -> dict:
    return {"count": 3, "avg": avg, "min": 0.0, "max": p99, "p50": p50, "p90": p99, "p99": p99}


def test_the_table_has_a_row_per_figure_and_names_failed_steps(load_script, tmp_path):
    """Decode-step, engine and served figures each become a row; missing files leave theirs out."""
    forward = {"batches": {"1": {"tokens_per_s": {"hf": 100.0, "graphs": 250.5}}}}
    (tmp_path / "forward.json").write_text(json.dumps(forward))
    engine = {"results": [{"system": "eng-compact", "dtype": "bfloat16", "concurrency": 16,
                           "tokens_per_s": 900.0, "ttft_ms": stats(40, 45, 60),
                           "itl_ms": stats(9, 10, 12)}]}  # fmt: skip
    (tmp_path / "engine.json").write_text(json.dumps(engine))
    served = tmp_path / "served-compile-on-c16"
    served.mkdir()
    summary = {"output_token_throughput": 1234.5, "ttft_ms": stats(50, 55, 80),
               "itl_ms": stats(11, 12, 20)}  # fmt: skip
    (served / "bench.json").write_text(json.dumps({"runs": [{"summary": summary}]}))
    module = load_script("gpu_check_table")
    text = module.render(module.rows(tmp_path), ["served-compile-off"])
    lines = text.splitlines()
    assert lines[0].split()[:2] == ["what", "streams"]
    assert any(line.startswith("decode step: graphs") and "250.5" in line for line in lines)
    assert any("engine: eng-compact bfloat16" in line and "900.0" in line for line in lines)
    served_line = next(line for line in lines if "--compile on" in line)
    assert served_line.split()[-5:] == ["16", "1,234.5", "50.0", "12.0", "20.0"]
    assert len(lines) == 1 + 2 + 1 + 1 + 1
    assert lines[-1] == "failed steps: served-compile-off"


def test_the_table_of_nothing_is_a_header_and_no_failures(load_script, tmp_path):
    """No results at all (every step failed before writing): the header, and the failure line."""
    module = load_script("gpu_check_table")
    assert module.render(module.rows(tmp_path), []).splitlines()[1] == "failed steps: none"
