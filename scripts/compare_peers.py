"""`tokenstream serve` against its peers on this machine, one run, each server's OpenAI API.

The peers are `transformers serve --continuous-batching` (float32 and bfloat16) and llama.cpp
(`llama-cpp-python[server]`, the Q4_1 GGUF the default model ships as, one thread per core). They
live in virtual environments of their own, never in .venv; give their paths, or skip them:

    python3 -m venv ../peers/hf && ../peers/hf/bin/pip install torch==2.13.0 \\
        'transformers[serving]==5.24.0'
    python3 -m venv ../peers/llama && ../peers/llama/bin/pip install \\
        'llama-cpp-python[server]==0.3.36'          # compiles llama.cpp: ~10 min on 2 cores
    PYTHONPATH=. .venv/bin/python scripts/compare_peers.py \\
        --transformers-env ../peers/hf --llama-env ../peers/llama

Every server gets the same workload, one after another on an otherwise idle machine: the shipped
chats, temperature 0, exactly --output-tokens new tokens (ours: ignore_eos; the peers: EOS banned
with logit_bias, which both honour), first one stream (--single requests), then --streams
closed-loop streams (--many requests), measured by `tokenstream bench --transport openai`.
Prints one table (tokens/s, TTFT p50, ITL mean) with ratios and writes the bench documents to
--out. Each server runs as shipped: ours with its defaults (prefix cache on), the peers with
theirs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from streaming_backend.launcher import free_port

REPO = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 300


@dataclass
class Server:
    name: str
    command: list[str]
    port: int  # of its OpenAI API, on 127.0.0.1
    model: str  # the name its OpenAI API serves the model under
    fixed_length: list[str]  # bench options that make every answer --output-tokens long
    env: dict[str, str] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def default_model() -> tuple[Path, Path, int]:
    """The shipped GGUF, its safetensors conversion (what our server loads) and its EOS id."""
    from streaming_backend.loading import convert_gguf, default_model_path

    gguf = Path(default_model_path())
    folder = Path(convert_gguf(gguf))
    eos = json.loads((folder / "config.json").read_text())["eos_token_id"]
    return gguf, folder, eos[0] if isinstance(eos, list) else eos


def servers(args: argparse.Namespace) -> list[Server]:
    gguf, folder, eos = default_model()
    n = str(args.output_tokens)
    ban_eos = ["--max-tokens", n, "--extra-params", json.dumps({"logit_bias": {str(eos): -100.0}})]
    port = free_port()
    ours = [sys.executable, "-m", "clients.cli", "serve", "--bridge-port", str(port)]
    for option in ("--http-port", "--grpc-port", "--metrics-port", "--supervisor-port"):
        ours += [option, str(free_port())]
    ours += args.ours_args.split()
    found = [
        Server("tokenstream serve", ours, port, "chat", ["--output-tokens", n]),
    ]
    if args.transformers_env:
        for dtype in ("float32", "bfloat16"):
            port = free_port()
            command = [str(Path(args.transformers_env) / "bin" / "transformers"), "serve"]
            command += ["--continuous-batching", "--dtype", dtype, "--device", "cpu"]
            command += ["--host", "127.0.0.1", "--port", str(port), str(folder)]
            env = {**os.environ, "HF_HUB_OFFLINE": "1"}
            name = f"transformers serve --continuous-batching, {dtype}"
            found.append(Server(name, command, port, str(folder), ban_eos, env))
    if args.llama_env:
        port = free_port()
        command = [str(Path(args.llama_env) / "bin" / "python"), "-m", "llama_cpp.server"]
        command += ["--model", str(gguf), "--model_alias", "chat"]
        command += ["--n_threads", str(os.cpu_count()), "--host", "127.0.0.1", "--port", str(port)]
        # its default lets a new request cut off the one running: queue them instead
        command += ["--interrupt_requests", "False"]
        name = f"llama.cpp (llama-cpp-python server, Q4_1, {os.cpu_count()} threads)"
        found.append(Server(name, command, port, "chat", ban_eos))
    return [s for s in found if not args.only or any(o in s.name for o in args.only)]


def wait_ready(server: Server, process: subprocess.Popen) -> None:
    """Until GET /v1/models lists the model; fails if the process exits or time runs out."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{server.name} exited with status {process.returncode}")
        try:
            with opener.open(f"{server.base_url}/v1/models", timeout=5) as response:
                if f'"{server.model}"' in response.read().decode():
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{server.name} not ready after {READY_TIMEOUT_S} s")


def bench(server: Server, streams: int, requests: int, out: Path) -> dict:
    """One `tokenstream bench` level; its summary."""
    command = [sys.executable, "-m", "clients.cli", "bench", "--transport", "openai"]
    command += ["--openai", server.base_url, "--model", server.model, "--temperature", "0"]
    command += ["--concurrency", str(streams), "--requests", str(requests), "--warmup", "2"]
    command += [*server.fixed_length, "--out", str(out), "--no-plot", "--no-progress"]
    subprocess.run(command, check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    return json.loads((out / "bench.json").read_text())["runs"][0]["summary"]


def measure(server: Server, args: argparse.Namespace) -> dict:
    """Start the server, bench one stream then many, stop it (its whole process group)."""
    log = (args.out / f"{slug(server.name)}.log").open("w")
    process = subprocess.Popen(
        server.command, env=server.env, stdout=log, stderr=subprocess.STDOUT,
        cwd=REPO, start_new_session=True,
    )  # fmt: skip
    try:
        wait_ready(server, process)
        print(f"== {server.name}: ready", flush=True)
        single = bench(server, 1, args.single, args.out / slug(server.name) / "1")
        many = bench(server, args.streams, args.many, args.out / slug(server.name) / "many")
        return {"single": single, "many": many}
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.close()


def slug(name: str) -> str:
    words = "".join(c if c.isalnum() else " " for c in name.lower()).split()
    return "-".join(w for w in words if w not in ("continuous", "batching", "server", "python"))


def row(name: str, r: dict) -> list[str]:
    s, m = r["single"], r["many"]
    return [
        name,
        f"{s['output_token_throughput']:.1f}",
        f"{s['ttft_ms']['p50']:.0f} ms",
        f"{m['output_token_throughput']:.1f}",
        f"{m['ttft_ms']['p50'] / 1000:.2f} s",
        f"{m['itl_ms']['avg']:.0f} ms",
        f"{s['output_tokens']['avg']:.1f} / {m['output_tokens']['avg']:.1f}",
        f"{s['errors'] + m['errors']}",
    ]


def table(results: dict[str, dict], streams: int) -> str:
    head = ["server", "1 stream: tok/s", "TTFT p50", f"{streams} streams: tok/s", "TTFT p50"]
    head += ["ITL mean", "tokens/answer", "errors"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    lines += ["| " + " | ".join(row(name, r)) + " |" for name, r in results.items()]
    ours = results.get("tokenstream serve")
    for name, r in results.items():
        if ours is None or r is ours:
            continue
        one = ours["single"]["output_token_throughput"] / r["single"]["output_token_throughput"]
        many = ours["many"]["output_token_throughput"] / r["many"]["output_token_throughput"]
        ttft = ours["many"]["ttft_ms"]["p50"] / r["many"]["ttft_ms"]["p50"]
        lines.append(
            f"\nours / {name}: 1 stream {one:.2f}x tok/s; {streams} streams {many:.2f}x tok/s, "
            f"TTFT p50 {ttft:.2f}x"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transformers-env", help="venv with transformers[serving]")
    parser.add_argument("--llama-env", help="venv with llama-cpp-python[server]")
    parser.add_argument(
        "--ours-args", default="", help="more `tokenstream serve` options, e.g. '--quantize int4'"
    )
    parser.add_argument("--only", type=lambda t: t.split(","), help="names containing these")
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--single", type=int, default=16, help="requests with one stream (16)")
    parser.add_argument("--streams", type=int, default=16, help="streams at once (16)")
    parser.add_argument("--many", type=int, default=48, help="requests with --streams (48)")
    parser.add_argument("--out", type=Path, default=Path("bench-results/peers"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for server in servers(args):
        results[server.name] = measure(server, args)
    (args.out / "peers.json").write_text(json.dumps(results, indent=1))
    print(table(results, args.streams))


if __name__ == "__main__":
    main()
