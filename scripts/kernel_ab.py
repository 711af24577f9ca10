"""The decode step on two builds of our C kernels in one process, their steps alternated: the
working tree's build against another revision's (or a library file), on the same weights and
prompts, so that a kernel change is measured as a ratio on a shared, noisy machine.

    PYTHONPATH=$PWD .venv/bin/python scripts/kernel_ab.py --against HEAD~1 --batch 1,16
    PYTHONPATH=$PWD .venv/bin/python scripts/kernel_ab.py --library other.so --prompt-tokens 512

The other build is compiled from `git archive REV streaming_backend/kernels/csrc` with this
CPU's flags (kernels/build.py), or loaded from --library; both must share the kernels' C
interface (the decoder stack's and the matmuls' arguments). For each batch size and round, each
build prefills the same B prompts of --prompt-tokens tokens into slots of its own, then both
decode --steps greedy steps, a step of one and a step of the other, the order swapped every
step; only the decode steps are timed, after --warmup-steps. The decoder stack and the head run
on the build whose step it is (the compact forward's native path: int4 or int8 weights on our
kernels). Printed per batch: each build's median step and tokens/s, the median of the per-pair
ratios (other / this: above 1 means this tree is faster), and whether the two builds' logits
of the first step are the same bits (a change that keeps the arithmetic must say yes).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path

import streaming_backend  # noqa: F401 - before torch: OpenMP's wait policy, as served

# isort: split
import torch
from forward_bench import prompt_ids  # this folder's

from streaming_backend.forward import quant
from streaming_backend.forward.runner import ForwardConfig, PromptChunk, SlotForward
from streaming_backend.forward.slots import CacheBudget
from streaming_backend.kernels import build, stack
from streaming_backend.kernels.matmul import MatmulKernel
from streaming_backend.model.loading import load_model

ROOT = Path(__file__).resolve().parents[1]
CSRC = "streaming_backend/kernels/csrc"


@dataclass
class Build:
    """One build of the kernels as the forward takes it: the decoder stack and the matmuls."""

    name: str
    matmul: MatmulKernel
    stack: stack.DecoderStack


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    other = parser.add_mutually_exclusive_group(required=True)
    other.add_argument("--against", metavar="REV", help="git revision whose kernels to build")
    other.add_argument("--library", type=Path, help="a built kernels library to load")
    parser.add_argument("--model", default=None, help="model folder (default model)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantize", choices=("int4", "int8"), default="int4")
    parser.add_argument("--batch", default="1,16", help="comma-separated batch sizes")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=16, help="timed steps a build, a round")
    parser.add_argument("--warmup-steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=None, help="kernel threads (torch's)")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    args.batch = [int(b) for b in args.batch.split(",")]
    return args


def build_revision(rev: str, folder: Path) -> Path:
    """The kernels of `rev` compiled for this CPU into folder -> the library."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", rev, CSRC],
        capture_output=True,
        check=False,
    )
    if archive.returncode:
        raise SystemExit(f"kernel_ab: git archive {rev}: {archive.stderr.decode().strip()}")
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(folder, filter="data")
    return compile_kernels(folder / CSRC, folder / "kernels.so")


def compile_kernels(csrc: Path, target: Path) -> Path:
    """The C files of `csrc` compiled as kernels/build.py compiles this CPU's build -> target."""
    cc = build.compiler()
    if cc is None:
        raise SystemExit("kernel_ab: no C compiler")
    try:
        build.compile_library(cc, build.variant(), target, csrc)
    except subprocess.CalledProcessError as exc:
        message = f"kernel_ab: building the kernels of {csrc} failed:\n{exc.stderr}"
        raise SystemExit(message) from None
    return target


def use(forward: SlotForward, chosen: Build) -> None:
    """Run the forward's decoder stack and head on `chosen`'s build."""
    forward.model.native_stack = chosen.stack
    quant.matmul_kernel = lambda: chosen.matmul


def measure(forward: SlotForward, builds: list[Build], prompts, args) -> dict:
    """Both builds' decode steps at one batch size, alternated step by step."""
    times: dict[str, list[float]] = {b.name: [] for b in builds}
    ratios, first = [], {}
    with torch.inference_mode():
        for _ in range(args.rounds):
            slots, tokens = {}, {}
            for chosen in builds:
                use(forward, chosen)
                slots[chosen.name] = [forward.cache.allocate() for _ in prompts]
                chunks = [PromptChunk(s, p) for s, p in zip(slots[chosen.name], prompts)]
                tokens[chosen.name] = forward.prefill(chunks).argmax(-1).tolist()
            for step in range(args.warmup_steps + args.steps):
                pair = {}
                for chosen in builds if step % 2 == 0 else builds[::-1]:
                    use(forward, chosen)
                    started = time.perf_counter()
                    logits = forward.decode(slots[chosen.name], tokens[chosen.name])
                    pair[chosen.name] = time.perf_counter() - started
                    if chosen.name not in first:
                        first[chosen.name] = logits.clone()
                    tokens[chosen.name] = logits.argmax(-1).tolist()
                if step >= args.warmup_steps:
                    for name, seconds in pair.items():
                        times[name].append(seconds)
                    ratios.append(pair["other"] / pair["this"])
            for chosen in builds:
                for slot in slots[chosen.name]:
                    forward.cache.free(slot)
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {
        "step_ms": {name: 1e3 * m for name, m in medians.items()},
        "tokens_per_s": {name: len(prompts) / m for name, m in medians.items()},
        "this_vs_other": statistics.median(ratios),
        "same_bits": bool(torch.equal(first["this"], first["other"])),
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = build.library()
    if loaded is None:
        raise SystemExit("kernel_ab: this tree's kernels cannot be built here")
    library, kind = loaded
    with tempfile.TemporaryDirectory() as folder:
        path = args.library or build_revision(args.against, Path(folder))
        other = ctypes.CDLL(str(path))
        model = load_model(args.model, dtype=args.dtype)
        config = ForwardConfig(
            CacheBudget(fraction=0.25),
            args.prompt_tokens + args.warmup_steps + args.steps + 8,
            2 * max(args.batch),
            quantize=args.quantize,
        )
        forward = SlotForward.create(model, config)
        here = forward.model.native_stack
        if here is None:
            raise SystemExit("kernel_ab: this model's layers do not run as one native stack")
        builds = [
            Build("this", MatmulKernel(library, kind), here),
            Build(
                "other",
                MatmulKernel(other, kind),
                stack.DecoderStack(other, here._keep, here.hidden, here.dims),
            ),
        ]
        figures = {"against": str(args.library or args.against), "batches": {}}
        for batch in args.batch:
            result = measure(forward, builds, prompt_ids(model, batch, args.prompt_tokens), args)
            figures["batches"][str(batch)] = result
            ms, rate = result["step_ms"], result["tokens_per_s"]
            print(
                f"batch {batch:3d}: this {ms['this']:.2f} ms ({rate['this']:.1f} tok/s), "
                f"other {ms['other']:.2f} ms ({rate['other']:.1f} tok/s); this "
                f"{result['this_vs_other']:.3f}x as fast (median pair); same bits: "
                f"{'yes' if result['same_bits'] else 'NO'}",
                flush=True,
            )
        use(forward, builds[0])
    if args.out:
        args.out.write_text(json.dumps(figures, indent=1))
    return figures


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
