"""scripts/measure_memory.py: the command lines of the servers it measures (no server started)."""

from __future__ import annotations

import argparse
import os


def arguments(**values) -> argparse.Namespace:
    defaults = dict(model=None, serve_args="", max_tokens=16, llama_env=None, llama_gguf=None)
    return argparse.Namespace(**(defaults | {"n_ctx": 8192} | values))


def test_llama_cpp_serves_the_gguf_file_with_its_context_and_a_thread_per_core(
    load_script, monkeypatch
):
    """llama.cpp: the venv's llama_cpp.server on the GGUF file, n_ctx 8192 (the issue's way),
    one thread per core, on loopback."""
    script = load_script("measure_memory")
    served = script.llama_cpp(arguments(llama_env="/peers/llama", llama_gguf="/m/q4_0.gguf")).served
    command = served.command
    assert command[:3] == ["/peers/llama/bin/python", "-m", "llama_cpp.server"]
    pairs = dict(zip(command[3::2], command[4::2], strict=True))
    assert pairs["--model"] == "/m/q4_0.gguf" and pairs["--n_ctx"] == "8192"
    assert pairs["--n_threads"] == str(os.cpu_count()) and pairs["--host"] == "127.0.0.1"
    assert served.ready == [f"http://127.0.0.1:{pairs['--port']}/v1/models"]


def test_ours_is_serve_without_the_bridge_with_the_options_given(load_script, monkeypatch):
    """Ours: `tokenstream serve --no-bridge` on free ports, the model and the options given."""
    script = load_script("measure_memory")
    served = script.ours(arguments(model="/m/llama-1b", serve_args="--models chat")).served
    command = served.command
    assert command[1:5] == ["-m", "clients.cli", "serve", "--no-bridge"]
    assert command[-4:] == ["--model", "/m/llama-1b", "--models", "chat"]
    assert "--supervisor-port" in command and "--http-port" in command
    supervisor = command[command.index("--supervisor-port") + 1]
    assert served.ready == [f"http://127.0.0.1:{supervisor}/ready"]
