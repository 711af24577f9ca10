"""A served model's memory: PSS summed over the server's processes after one request, each
process's share, the model stubs' peaks, and the time until the server was ready; or llama.cpp's
the same way, for the ratio.

    PYTHONPATH=. .venv/bin/python scripts/measure_memory.py --model ../models/llama-1b \\
        --serve-args "--models chat"
    PYTHONPATH=. .venv/bin/python scripts/measure_memory.py --model ../models/llama-1b   # both
    PYTHONPATH=. .venv/bin/python scripts/measure_memory.py --llama-env ../peers/llama \\
        --llama-gguf ../models/llama-1b-q4_0.gguf      # llama.cpp's server, n_ctx 8192

Starts `tokenstream serve` (no bridge, free ports), waits for the supervisor's /ready, sends the
chat model one short greedy request over Triton's generate_stream, then reads
/proc/PID/smaps_rollup of every process of the server (the launcher, tritonserver and its
model stubs): PSS counts a page shared by N processes as 1/N in each, so the sum counts it
once, as llama.cpp's one process counts its own. With --llama-env, llama-cpp-python's server
(that virtual environment's, scripts/compare_peers.py says how to make it) serves the GGUF file
with a context of --n-ctx positions and one thread per core instead, is sent one short greedy
request over its OpenAI API, and is measured alike. Prints one JSON document and stops the
server.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import psutil
from served import Served  # this folder's

from streaming_backend.launcher import free_port

REPO = Path(__file__).resolve().parents[1]
FIELDS = ("Rss", "Pss", "Pss_Anon", "Pss_File", "Pss_Shmem")  # of smaps_rollup, in kB
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy
QUESTION = "What is the capital of France?"  # the one short request's


def memory(pid: int) -> dict[str, float]:
    """A process's smaps_rollup figures and its peak resident size (VmHWM), in MB."""
    figures = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":")
        if key in FIELDS:
            figures[key] = int(value.split()[0]) / 1000
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            figures["VmHWM"] = int(line.split()[1]) / 1000
    return figures


def one_request(http_port: int, max_tokens: int) -> str:
    """One greedy chat request over generate_stream; the text it streamed."""
    body = {
        "messages": json.dumps([{"role": "user", "content": QUESTION}]),
        "stream": True,
        "sampling_parameters": json.dumps({"temperature": 0, "max_tokens": max_tokens}),
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{http_port}/v2/models/chat/generate_stream",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    text = []
    with OPENER.open(request, timeout=300) as response:
        for line in response:
            if line.startswith(b"data: "):
                text.append(json.loads(line[6:]).get("text_output", ""))
    return "".join(text)


def llama_request(port: int, max_tokens: int) -> str:
    """One greedy chat request over llama.cpp's OpenAI API; its text."""
    body = {
        "messages": [{"role": "user", "content": QUESTION}],
        "temperature": 0,
        "max_tokens": max_tokens,
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with OPENER.open(request, timeout=300) as response:
        return json.loads(response.read())["choices"][0]["message"]["content"]


class Server(NamedTuple):
    """A server to measure: how to start it and wait for it (scripts/served.py), and send it its
    one request."""

    served: Served
    request: Callable[[], str]


def ours(args: argparse.Namespace) -> Server:
    """`tokenstream serve` without its bridge, on free ports; ready at the supervisor's /ready."""
    ports = {name: free_port() for name in ("http", "grpc", "metrics", "supervisor")}
    command = [sys.executable, "-m", "clients.cli", "serve", "--no-bridge"]
    command += [arg for name, port in ports.items() for arg in (f"--{name}-port", str(port))]
    command += ["--model", args.model] if args.model else []
    command += args.serve_args.split()
    ready = [f"http://127.0.0.1:{ports['supervisor']}/ready"]
    return Server(
        Served(command, ready, "serve"), lambda: one_request(ports["http"], args.max_tokens)
    )


def llama_cpp(args: argparse.Namespace) -> Server:
    """llama-cpp-python's server on the GGUF file: --n-ctx positions, a thread per core."""
    port = free_port()
    command = [str(Path(args.llama_env) / "bin" / "python"), "-m", "llama_cpp.server"]
    command += ["--model", args.llama_gguf, "--n_ctx", str(args.n_ctx)]
    command += ["--n_threads", str(os.cpu_count()), "--host", "127.0.0.1", "--port", str(port)]
    ready = [f"http://127.0.0.1:{port}/v1/models"]
    return Server(
        Served(command, ready, "llama.cpp's server"), lambda: llama_request(port, args.max_tokens)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="--model for serve (default: the shipped model)")
    parser.add_argument("--serve-args", default="", help="more serve options, one string")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--llama-env", help="measure llama.cpp: llama-cpp-python's venv")
    parser.add_argument("--llama-gguf", help="the GGUF file llama.cpp serves (--llama-env)")
    parser.add_argument("--n-ctx", type=int, default=8192, help="llama.cpp's context (positions)")
    args = parser.parse_args()
    if args.llama_env and not args.llama_gguf:
        parser.error("--llama-env needs --llama-gguf")
    server = llama_cpp(args) if args.llama_env else ours(args)
    with server.served as served:
        text = server.request()
        pid = served.process.pid
        processes = [psutil.Process(pid), *psutil.Process(pid).children(True)]
        each = {f"{p.pid} {' '.join(p.cmdline()[:2])[-60:]}": memory(p.pid) for p in processes}
        total = {key: round(sum(m.get(key, 0) for m in each.values()), 1) for key in FIELDS}
        result = {"command": served.command[2:], "ready_s": round(served.ready_s, 1), "text": text}
        print(json.dumps(result | {"total_mb": total, "processes_mb": each}, indent=1))


if __name__ == "__main__":
    main()
