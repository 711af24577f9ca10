"""The linear weights of a model's decode step by kernel and weight format: ms, GB/s of weights
streamed and GMAC/s, formats interleaved round by round.

    PYTHONPATH=. .venv/bin/python scripts/matmul_bench.py                  # the 1B shapes, 1 row
    PYTHONPATH=. .venv/bin/python scripts/matmul_bench.py --rows 1,8 --threads 1,2
    PYTHONPATH=. .venv/bin/python scripts/matmul_bench.py --formats c-int4,c-int8 --amx both \\
        --rows 1,2,4,8,16,32
    PYTHONPATH=. .venv/bin/python scripts/matmul_bench.py --hidden 576 --intermediate 1536 \\
        --heads 9 --kv-heads 3 --layers 30 --vocab 49152 --rows 1,16,64 \\
        --formats float32,bfloat16,c-int8/bf16,c-int8,c-int4/bf16,c-int4   # the default model

A decode step reads every weight once, so what bounds one stream is how fast a kernel streams
them. This holds --layers layers of one decoder layer's linears (q/k/v fused, o, gate/up fused,
down) of random weights, and the head where --vocab is given, in each format (the defaults, the
1B shape's 4 layers, are 152 MB in int4: more than the caches hold), and runs an activation of
--rows rows through all of them: one pass. Formats (FORMATS): ours (c-int4, c-int8: the C
kernels, kernels/csrc/), torch's weight-only kernels (aten-int4, aten-int8) and dense float32 /
bfloat16, each with the activations the forward feeds it, or the other dtype after a slash
(c-int4/bf16, aten-int8/fp32). --amx both times our kernels with their block dots on AMX and
without (the same bits) where the CPU has it. The formats (and AMX settings) take turns within
each of --rounds rounds of --passes passes, since the machine is shared and noisy; printed per
threads and rows: the median round's ms per pass, the best pass, the weights' bytes (with their
scales) read per second and rows x inputs x outputs multiply-adds per second in the best pass,
and each format's speed against the first one's (medians). The machine's copy bandwidth (a 1 GiB
float32 copy_), the integer dot products' peak on one core (`dot_peak`: the instruction our
matmuls' block dots run on, AVX-512 VNNI's vpdpbusd or AVX2's vpmaddubsw, in independent chains;
AMX is not measured) and the CPU's bfloat16, AVX-512 and AMX flags are printed first; a GMAC/s
of the table is to be read against that peak over two (each activation is multiplied as two
int8 halves) times the threads.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from streaming_backend.forward import quant
from streaming_backend.kernels import build
from streaming_backend.kernels.matmul import matmul_kernel
from streaming_backend.model.hardware import cpu_flags

FP32, BF16 = torch.float32, torch.bfloat16
# name -> (the weight in its format, from a float32 one [out, in]; the activations' dtype)
FORMATS: dict[str, tuple[Callable[[torch.Tensor], quant.Weight], torch.dtype]] = {
    "c-int4": (quant.quantize_int4_native, FP32),  # ours take float32 activations in the forward
    "aten-int4": (lambda w: quant.quantize_int4(w, quant.INT4_GROUP), BF16),
    "c-int8": (quant.quantize_int8_native, FP32),
    "aten-int8": (quant.quantize_int8, BF16),
    "float32": (lambda w: w, FP32),
    "bfloat16": (lambda w: w.to(BF16), BF16),
    "c-int4/bf16": (quant.quantize_int4_native, BF16),
    "aten-int4/fp32": (lambda w: quant.quantize_int4(w, quant.INT4_GROUP), FP32),
    "c-int8/bf16": (quant.quantize_int8_native, BF16),
    "aten-int8/fp32": (quant.quantize_int8, FP32),
}
DEFAULT_FORMATS = ("c-int4", "aten-int4", "c-int8", "aten-int8", "float32", "bfloat16")


def shapes(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(in, out) of every linear weight of one pass: --layers layers, then the head if any."""
    head_dim = args.hidden // args.heads
    qkv = (args.heads + 2 * args.kv_heads) * head_dim
    layer = [
        (args.hidden, qkv),
        (args.heads * head_dim, args.hidden),
        (args.hidden, 2 * args.intermediate),
        (args.intermediate, args.hidden),
    ]
    return layer * args.layers + ([(args.hidden, args.vocab)] if args.vocab else [])


def one_pass(pairs: list[tuple[int, quant.Weight]], xs: dict[int, torch.Tensor]) -> float:
    """Seconds to run the activation of each weight's width through every weight."""
    started = time.perf_counter()
    for inputs, w in pairs:
        quant.linear(xs[inputs], w)
    return time.perf_counter() - started


def copy_gbps() -> float:
    """A 1 GiB float32 copy_, bytes of one side per second (the best of 5, after one)."""
    a = torch.ones(256 << 20)
    b = torch.zeros_like(a)  # its pages touched, so no first-touch faults are timed
    b.copy_(a)
    best = min(_timed(lambda: b.copy_(a)) for _ in range(5))
    return a.numel() * 4 / best / 1e9


# The peak's loop: CHAINS accumulators, each a dot instruction of its own weights against the
# activations, which an empty asm statement "changes" every turn so that nothing is hoisted.
PEAK_SOURCE = r"""
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#define CHAINS 12
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}
int main(int argc, char **argv) {
    const long turns = atol(argv[1]);
    VEC acc[CHAINS], w[CHAINS], x = SET1(5);
    for (int j = 0; j < CHAINS; j++) { acc[j] = ZERO(); w[j] = SET1(j + 1); }
    double best = 1e30;
    for (int round = 0; round < 3; round++) {
        const double started = now();
        for (long i = 0; i < turns; i++) {
            __asm__ volatile("" : "+x"(x));
            for (int j = 0; j < CHAINS; j++) acc[j] = DOT(acc[j], w[j], x);
        }
        const double took = now() - started;
        best = took < best ? took : best;
    }
    int sink = 0;
    for (int j = 0; j < CHAINS; j++) sink += FIRST(acc[j]);
    printf("%.6f %d\n", (double)turns * CHAINS / best, sink);
    return 0;
}
"""
PEAK_KINDS = {  # name -> (the CPU flags it needs, compiler flags, macros, u8 x s8 products a dot)
    "vpdpbusd": (
        {"avx512f", "avx512bw", "avx512_vnni"},
        ["-mavx512f", "-mavx512bw", "-mavx512vnni"],
        "-DVEC=__m512i -DSET1=_mm512_set1_epi8 -DZERO=_mm512_setzero_si512 "
        "-DDOT=_mm512_dpbusd_epi32 -DFIRST=_mm512_cvtsi512_si32",
        64,
    ),
    "vpmaddubsw": (
        {"avx2"},
        ["-mavx2"],
        "-DVEC=__m256i -DSET1=_mm256_set1_epi8 -DZERO=_mm256_setzero_si256 "
        "-DDOT(a,w,x)=_mm256_add_epi16(a,_mm256_maddubs_epi16(w,x)) "
        "-DFIRST(a)=_mm256_extract_epi16(a,0)",
        32,
    ),
}


def dot_peak(turns: int = 20_000_000) -> tuple[str, float] | None:
    """(instruction, u8 x s8 products a second on one core) of the integer dot our block dots
    run on, the best of 3 timed loops; None where no compiler or no such instruction is here."""
    cc, flags = build.compiler(), cpu_flags()
    kind = next((name for name, row in PEAK_KINDS.items() if row[0] <= flags), None)
    if cc is None or kind is None:
        return None
    _, isa, macros, products = PEAK_KINDS[kind]
    with tempfile.TemporaryDirectory() as folder:
        source, binary = Path(folder) / "peak.c", Path(folder) / "peak"
        source.write_text(PEAK_SOURCE)
        command = [cc, "-O3", "-funroll-all-loops", *isa, *macros.split(), str(source)]
        if subprocess.run([*command, "-o", str(binary)], capture_output=True).returncode:
            return None
        out = subprocess.run([str(binary), str(turns)], capture_output=True, text=True)
    if out.returncode:
        return None
    return kind, float(out.stdout.split()[0]) * products


def _timed(run: Callable[[], object]) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def systems(formats: list[str], amx: str) -> list[tuple[str, bool]]:
    """(format, AMX on) to time: our kernels once per AMX setting asked for, the others once."""
    kernel = matmul_kernel()
    settings = {"auto": [bool(kernel and kernel.amx)], "off": [False], "both": [True, False]}
    return [
        (name, on)
        for name in formats
        for on in (settings[amx] if name.startswith("c-") else [False])
    ]


def measure(prepared, xs, runs: list[tuple[str, bool]], rounds: int, passes: int) -> dict:
    """(format, AMX) -> every pass's seconds, the runs taking turns round by round."""
    kernel = matmul_kernel()
    amx = kernel.amx if kernel else False
    times: dict[tuple[str, bool], list[list[float]]] = {run: [] for run in runs}
    for run in runs:  # warm up
        one_pass(prepared[run[0]], xs[FORMATS[run[0]][1]])
    for _ in range(rounds):
        for name, on in runs:
            if kernel:
                kernel.amx = on
            pairs, x = prepared[name], xs[FORMATS[name][1]]
            times[name, on].append([one_pass(pairs, x) for _ in range(passes)])
    if kernel:
        kernel.amx = amx
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (4)")
    parser.add_argument("--vocab", type=int, default=0, help="the head's rows (0: no head)")
    parser.add_argument("--rows", default="1", help="activation rows, comma-separated (1)")
    parser.add_argument("--threads", default="2", help="torch threads, comma-separated (2)")
    parser.add_argument("--formats", default=",".join(DEFAULT_FORMATS), help=", ".join(FORMATS))
    parser.add_argument("--amx", choices=("auto", "off", "both"), default="auto")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--passes", type=int, default=3, help="passes per format and round")
    args = parser.parse_args()
    formats = args.formats.split(",")
    unknown = [name for name in formats if name not in FORMATS]
    if unknown:
        parser.error(f"unknown formats {unknown}; choose from {', '.join(FORMATS)}")
    if matmul_kernel() is None and any(name.startswith("c-") for name in formats):
        parser.error("our C kernels do not build here: leave out the c-* formats")
    flags = sorted(f for f in cpu_flags() if "bf16" in f or f.startswith(("avx512", "amx")))
    capability = torch.backends.cpu.get_cpu_capability()
    print(f"torch {torch.__version__}, capability {capability}, flags: {' '.join(flags)}")
    print(f"1 GiB float32 copy_: {copy_gbps():.1f} GB/s (one side)")
    peak = dot_peak()
    if peak is None:
        print("integer dot peak: not measured here (no compiler, or no vpdpbusd / vpmaddubsw)")
    else:
        kind, products = peak
        print(
            f"integer dot peak, one core ({kind}): {products / 1e9:.1f} G u8 x s8 products/s; "
            f"our quantized matmuls (two int8 halves) at most {products / 2e9:.1f} GMAC/s a core"
        )
    generator = torch.Generator().manual_seed(0)
    linear_shapes = shapes(args)
    dense = [torch.randn(n, k, generator=generator) * 0.02 for k, n in linear_shapes]
    prepared = {
        name: [(k, FORMATS[name][0](w)) for (k, _), w in zip(linear_shapes, dense)]
        for name in formats
    }
    del dense
    size = {name: sum(quant.weight_bytes(w) for _, w in pairs) for name, pairs in prepared.items()}
    macs = sum(k * n for k, n in linear_shapes)
    runs = systems(formats, args.amx)
    print("| format | AMX | threads | rows | MB | ms | best ms | GB/s | GMAC/s | speed |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    with torch.inference_mode():
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, max(k for k, _ in linear_shapes), generator=generator)
                widths = {k for k, _ in linear_shapes}
                xs = {d: {k: x[:, :k].contiguous().to(d) for k in widths} for d in (FP32, BF16)}
                times = measure(prepared, xs, runs, args.rounds, args.passes)
                base = statistics.median(statistics.mean(r) for r in times[runs[0]])
                for (name, on), rounds in times.items():
                    median = statistics.median(statistics.mean(r) for r in rounds)
                    best = min(min(r) for r in rounds)
                    print(
                        f"| {name} | {'on' if on else 'off'} | {threads} | {rows} "
                        f"| {size[name] / 1e6:.0f} | {median * 1e3:.2f} | {best * 1e3:.2f} "
                        f"| {size[name] / best / 1e9:.1f} | {rows * macs / best / 1e9:.1f} "
                        f"| {base / median:.2f}x |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
