"""scripts/kernel_ab.py: two builds of the kernels in one process, their decode steps alternated on
the tiny model; the same build gives the same bits, a build whose arithmetic differs is told
apart, and a revision git does not know is refused with its reason."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "kernel_ab.py"
ROOT = SCRIPT.parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def run(tiny_model_dir, tmp_path, *options: str) -> dict:
    out = tmp_path / "out.json"
    command = [sys.executable, str(SCRIPT), "--model", str(tiny_model_dir), "--batch", "1,3"]
    command += ["--prompt-tokens", "8", "--steps", "2", "--warmup-steps", "1", "--rounds", "1"]
    command += ["--threads", "1", "--out", str(out), *options]
    subprocess.run(command, cwd=ROOT, env=ENV, check=True, capture_output=True)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def own_library():
    from streaming_backend.kernels import build

    loaded = build.library()
    if loaded is None:
        pytest.skip("no C compiler: the kernels cannot be built")
    return build.library_path(build.compiler(), loaded[1])


def test_the_same_build_against_itself_gives_the_same_bits(tiny_model_dir, tmp_path, own_library):
    """Each batch: both builds' step time, their ratio and the first step's logits equal."""
    figures = run(tiny_model_dir, tmp_path, "--library", str(own_library))
    assert set(figures["batches"]) == {"1", "3"}
    for result in figures["batches"].values():
        assert result["same_bits"] is True
        assert result["step_ms"]["this"] > 0 and result["step_ms"]["other"] > 0
        assert result["this_vs_other"] > 0


def test_a_build_whose_arithmetic_differs_is_told_apart(
    tiny_model_dir, tmp_path, own_library, load_script
):
    """The attention's exponential with another second-order coefficient (0.5 -> 0.51): other
    logits, said so."""
    script = load_script("kernel_ab")
    csrc = tmp_path / "csrc"
    shutil.copytree(ROOT / script.CSRC, csrc)
    common = csrc / "common.h"
    text = common.read_text()
    assert "#define P5 5.0000001201e-1f" in text
    common.write_text(text.replace("#define P5 5.0000001201e-1f", "#define P5 5.1e-1f"))
    changed = script.compile_kernels(csrc, tmp_path / "changed.so")
    figures = run(tiny_model_dir, tmp_path, "--library", str(changed))
    assert all(result["same_bits"] is False for result in figures["batches"].values())


def test_a_revision_git_does_not_know_is_refused_with_its_reason(tmp_path, load_script):
    script = load_script("kernel_ab")
    with pytest.raises(SystemExit, match="git archive no-such-revision"):
        script.build_revision("no-such-revision", tmp_path)
