"""GB/s of weights streamed by each quantized matmul kernel, at a model's linear shapes.

    PYTHONPATH=. .venv/bin/python scripts/kernel_bench.py                  # the 1B shapes, 1 row
    PYTHONPATH=. .venv/bin/python scripts/kernel_bench.py --rows 1,8 --threads 1,2
    PYTHONPATH=. .venv/bin/python scripts/kernel_bench.py --formats c-int4,c-int8 --amx both \
        --rows 1,2,4,8,16,32
    PYTHONPATH=. .venv/bin/python scripts/kernel_bench.py --hidden 576 --intermediate 1536 \\
        --heads 9 --kv-heads 3 --layers 30

A decode step reads every weight once, so what bounds one stream is how fast a kernel streams
them. This runs one decoder layer's linears (q/k/v fused, o, gate/up fused, down) of --layers
layers of random weights, cycled so that they do not sit in the caches (the defaults, the 1B
shape's 4 layers, are 152 MB in int4), with one activation of --rows rows, and prints the bytes of
weights (with their scales) read per second for each format: ours (c-int4, c-int8: the C kernels,
forward/csrc/quant_matmul.c), torch's weight-only kernels (aten-int4, aten-int8: bfloat16
activations, as the forward feeds them) and dense float32 / bfloat16. Best of --repeats.
Compare with the machine's copy bandwidth (a 1 GiB float32 copy_, printed first). GMAC/s is
rows x inputs x outputs multiply-adds per second. --amx both times our kernels with their block
dots on AMX and without (the same bits), alternated, where the CPU has it.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch

from streaming_backend.forward import native, quant

FORMATS: dict[str, Callable[[torch.Tensor], quant.Weight]] = {
    "c-int4": quant.quantize_int4_native,
    "aten-int4": lambda w: quant.quantize_int4(w, quant.INT4_GROUP),
    "c-int8": quant.quantize_int8_native,
    "aten-int8": quant.quantize_int8,
    "float32": lambda w: w,
    "bfloat16": lambda w: w.to(torch.bfloat16),
}


def best_seconds(run: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` timed runs, after one untimed."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def step(weights, layer_shapes, xs: dict[int, torch.Tensor]) -> None:
    """Every layer's linears once, each on its activation."""
    for layer in weights:
        for (k, _), w in zip(layer_shapes, layer):
            quant.linear(xs[k], w)


def copy_gbps(repeats: int) -> float:
    """A 1 GiB float32 copy_, bytes of one side per second."""
    a = torch.ones(256 << 20)
    b = torch.zeros_like(a)  # its pages touched, so no first-touch faults are timed
    return a.numel() * 4 / best_seconds(lambda: b.copy_(a), repeats) / 1e9


def shapes(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(in, out) of one layer's linears."""
    head_dim = args.hidden // args.heads
    qkv = (args.heads + 2 * args.kv_heads) * head_dim
    return [
        (args.hidden, qkv),
        (args.heads * head_dim, args.hidden),
        (args.hidden, 2 * args.intermediate),
        (args.intermediate, args.hidden),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4, help="layers cycled (4)")
    parser.add_argument("--rows", default="1", help="activation rows, comma-separated (1)")
    parser.add_argument("--threads", default="2", help="torch threads, comma-separated (2)")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--amx", choices=("auto", "off", "both"), default="auto")
    args = parser.parse_args()
    kernel = native.matmul_kernel()
    amx = {"auto": [kernel.amx], "off": [False], "both": [True, False]}[args.amx]
    print(f"1 GiB float32 copy_: {copy_gbps(args.repeats):.1f} GB/s (one side)")
    generator = torch.Generator().manual_seed(0)
    layer_shapes = shapes(args)
    dense = [
        [torch.randn(n, k, generator=generator) * 0.02 for k, n in layer_shapes]
        for _ in range(args.layers)
    ]
    print("| format | AMX | threads | rows | MB | ms | GB/s | GMAC/s |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    macs = sum(k * n for k, n in layer_shapes) * args.layers
    for name in args.formats.split(","):
        weights = [[FORMATS[name](w) for w in layer] for layer in dense]
        size = sum(quant.weight_bytes(w) for layer in weights for w in layer)
        dtype = torch.bfloat16 if name == "bfloat16" else torch.float32
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            for rows in (int(r) for r in args.rows.split(",")):
                xs = {k: torch.randn(rows, k, generator=generator) for k, _ in layer_shapes}
                xs = {k: x.to(dtype) for k, x in xs.items()}
                run = functools.partial(step, weights, layer_shapes, xs)
                for on in amx if name.startswith("c-") else [False]:
                    kernel.amx = on
                    seconds = best_seconds(run, args.repeats)
                    print(
                        f"| {name} | {'on' if on else 'off'} | {threads} | {rows} "
                        f"| {size / 1e6:.0f} | {seconds * 1e3:.2f} | {size / seconds / 1e9:.1f} "
                        f"| {rows * macs / seconds / 1e9:.1f} |",
                        flush=True,
                    )
    kernel.amx = amx[0]


if __name__ == "__main__":
    main()
