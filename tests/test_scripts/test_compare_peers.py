"""scripts/compare_peers.py's contention option: busy cores and the slowdown table."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "compare_peers.py"


def load_script():
    """The script as a module (it is not a package)."""
    spec = importlib.util.spec_from_file_location("compare_peers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["compare_peers"] = module
    spec.loader.exec_module(module)
    return module


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_busy_cores_keep_a_core_busy_and_end_with_the_block():
    """Each busy process burns CPU while the block runs, and none is left after it."""
    script = load_script()
    with script.busy_cores(1) as processes:
        (process,) = processes
        time.sleep(0.5)
        assert process.poll() is None and cpu_seconds(process.pid) > 0.2
    assert process.poll() is not None


def test_the_slowdown_table_divides_each_servers_idle_figures_by_its_busy_ones():
    """One row per server and busy count: its idle tokens/s over its busy tokens/s."""
    script = load_script()
    level = lambda tok_s: {"output_token_throughput": tok_s}  # noqa: E731
    results = {
        "tokenstream serve": {"single": level(50.0), "many": level(170.0)},
        "tokenstream serve, 1 core busy": {"single": level(25.0), "many": level(85.0)},
    }
    lines = script.slowdowns(results, [0, 1], 16).splitlines()
    assert lines[-1] == "| tokenstream serve | 1 | 2.00x | 2.00x |"
    assert len(lines) == 3
    assert script.label("llama.cpp", 2) == "llama.cpp, 2 cores busy"


def test_another_model_is_served_by_all_from_its_folder_and_gguf(tmp_path):
    """--model DIR: ours serves DIR, transformers serve loads DIR and llama.cpp --llama-gguf, its
    row named by the file; EOS (banned for the peers) from DIR's config."""
    import argparse
    import json

    script = load_script()
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [7, 8]}))
    gguf = tmp_path / "model-q4_0.gguf"
    args = argparse.Namespace(
        model=tmp_path, llama_gguf=gguf, llama_env="/peers/llama", transformers_env="/peers/hf",
        output_tokens=16, ours_args="", only=None,
    )  # fmt: skip
    assert script.models(args) == (gguf, tmp_path, 7)
    ours, *peers = script.servers(args)
    assert ours.command[ours.command.index("--model") + 1] == str(tmp_path)
    assert all(str(tmp_path) in p.command for p in peers if "transformers" in p.name)
    (llama,) = [p for p in peers if p.name.startswith("llama.cpp")]
    assert "model-q4_0.gguf" in llama.name and str(gguf) in llama.command
    assert '"7": -100.0' in " ".join(llama.fixed_length)
