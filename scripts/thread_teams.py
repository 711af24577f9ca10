"""Does a second torch thread team slow the engine's thread on this machine?

torch's CPU operators run on OpenMP, whose worker threads form one team per calling thread. The
engine steps on its own thread; when another thread (the process's main thread, say) has also run
a multi-threaded operator, this measures how a lone stream's decode step on the engine-like thread
changes. Each case runs in a fresh process:

- `fresh`: a new thread loads the model, builds the compact forward and decodes (the engine now);
- `after-main`: the same, after the main thread ran one multi-threaded matmul.

    PYTHONPATH=. .venv/bin/python scripts/thread_teams.py --quantize int4 --repeat 2
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time

STEPS, WARMUP = 100, 10


def decode_ms(dtype: str, quantize: str) -> float:
    """Median ms of a lone-stream decode step, built and run on the calling thread."""
    from streaming_backend.forward.runner import ForwardConfig, SlotForward
    from streaming_backend.forward.slots import CacheBudget
    from streaming_backend.model.loading import load_model

    loaded = load_model(None, dtype=dtype)
    config = ForwardConfig(quantize=quantize, budget=CacheBudget(fraction=0.05), max_slots=2)
    forward = SlotForward.create(loaded, config)
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        forward.decode([0], [5])
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[WARMUP:])


def child(case: str, dtype: str, quantize: str) -> None:
    import torch

    if case == "after-main":
        torch.randn(2048, 2048) @ torch.randn(2048, 2048)  # the main thread's team
    result = []
    thread = threading.Thread(target=lambda: result.append(decode_ms(dtype, quantize)))
    thread.start()
    thread.join()
    print(f"{result[0]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantize", default="int4")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.dtype, args.quantize)
        return
    figures: dict[str, list[float]] = {"fresh": [], "after-main": []}
    for _ in range(args.repeat):
        for case, values in figures.items():
            command = [sys.executable, __file__, "--child", case]
            command += ["--dtype", args.dtype, "--quantize", args.quantize]
            out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            values.append(float(out.split()[-1]))
    for case, values in figures.items():
        listed = ", ".join(f"{v:.1f}" for v in values)
        print(f"{case:>10}: decode step median {statistics.median(values):.1f} ms ({listed})")
    ratio = statistics.median(figures["after-main"]) / statistics.median(figures["fresh"])
    print(f"a second thread team makes the step {ratio:.2f}x as long")


if __name__ == "__main__":
    main()
