"""The matmuls of one decode step of the default model, by weight format and batch rows.

    .venv/bin/python scripts/matmul_bench.py --rows 1,16,64 --rounds 5

Every linear weight of SmolLM2-135M (30 layers of q/k/v, o, gate/up and down, plus the head),
random, held once per format (float32, bfloat16, int8 and int4 weight-only with bfloat16 and
float32 activations); one pass runs x [rows, in] through all of them. Formats are interleaved
round by round and the median round is reported, with each format's time relative to float32,
since the machine is shared and noisy. Prints the CPU's bfloat16-related flags first.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from streaming_backend.forward.quant import linear, quantize_weight
from streaming_backend.model.hardware import cpu_flags

LAYERS, HIDDEN, INTERMEDIATE, QKV, VOCAB = 30, 576, 1536, 960, 49152
# (name, weight dtype, activation dtype, quantization)
FORMATS = (
    ("float32", torch.float32, "none"),
    ("bfloat16", torch.bfloat16, "none"),
    ("int8/bf16", torch.bfloat16, "int8"),
    ("int8/fp32", torch.float32, "int8"),
    ("int4/bf16", torch.bfloat16, "int4"),
    ("int4/fp32", torch.float32, "int4"),
)


def shapes() -> list[tuple[int, int]]:
    """(out, in) of every linear weight of one step."""
    layer = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
    return layer * LAYERS + [(VOCAB, HIDDEN)]


def weights(dtype: torch.dtype, kind: str) -> list:
    """One random weight per shape, in `dtype`, quantized as `kind`."""
    gen = torch.Generator().manual_seed(0)
    return [
        quantize_weight((torch.randn(o, i, generator=gen) * 0.05).to(dtype), kind)
        for o, i in shapes()
    ]


def one_pass(xs: dict[int, torch.Tensor], ws: list) -> float:
    """Seconds to run the input of each weight's width through every weight."""
    started = time.perf_counter()
    for (_, inputs), w in zip(shapes(), ws):
        linear(xs[inputs], w)
    return time.perf_counter() - started


def main() -> None:
    """Measure and print."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--passes", type=int, default=3, help="passes per round (mean)")
    parser.add_argument(
        "--formats",
        default=",".join(name for name, _, _ in FORMATS),
        help="comma-separated, from: " + ", ".join(name for name, _, _ in FORMATS),
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    wanted = args.formats.split(",")
    flags = sorted(f for f in cpu_flags() if "bf16" in f or f.startswith(("avx512", "amx")))
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"capability {torch.backends.cpu.get_cpu_capability()}, flags: {' '.join(flags)}"
    )
    prepared = {name: weights(dtype, kind) for name, dtype, kind in FORMATS if name in wanted}
    dtypes = {name: dtype for name, dtype, _ in FORMATS}
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            times = {name: [] for name in prepared}
            xs = {
                n: {i: torch.randn(rows, i).to(dtypes[n]) for i in (HIDDEN, INTERMEDIATE)}
                for n in prepared
            }
            for name in prepared:  # warm up
                one_pass(xs[name], prepared[name])
            for _ in range(args.rounds):
                for name, ws in prepared.items():
                    times[name].append(
                        statistics.mean(one_pass(xs[name], ws) for _ in range(args.passes))
                    )
            first = next(iter(times))  # the first format in FORMATS' order: the baseline
            base = statistics.median(times[first])
            for name, ts in times.items():
                median = statistics.median(ts)
                print(
                    f"rows {rows:>3} {name:<10} {median * 1e3:8.1f} ms per step "
                    f"({base / median:.2f}x {first}'s speed)",
                    flush=True,
                )


if __name__ == "__main__":
    main()
