"""Soak test: mixed streaming load with cancels against `tokenstream serve`, reporting the RSS of
tritonserver and its backend stubs over time and every error. Not part of CI (scripts/soak.sh).

Starts its own `tokenstream serve --no-bridge` on free ports (or uses --grpc-url of a running one
and --pid of its tritonserver), runs --concurrency generations at a time for --minutes: random
lengths, a --cancel-share of them cancelled part-way. Every --sample-s it prints one line: time,
requests done, errors, RSS of tritonserver and of the stubs. At the end: RSS growth after the
warm-up (the goal is under 5 %) and the errors by message.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from served import Served  # this folder's

from clients.library.grpc_client import AsyncChatClient, GenerateRequest, GenerationError
from streaming_backend.launcher import free_port
from streaming_backend.launcher.processes import descendants


def rss_mb(pid: int) -> float:
    """Resident set size of a process in MiB (0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def tree_rss(server_pid: int) -> tuple[float, float]:
    """(tritonserver RSS, sum of its descendants' RSS) in MiB."""
    return rss_mb(server_pid), sum(rss_mb(pid) for pid in descendants(server_pid))


class Load:
    """Keeps `concurrency` generations running; counts outcomes and errors."""

    def __init__(self, url: str, concurrency: int, cancel_share: float, max_tokens: int):
        self.url, self.concurrency = url, concurrency
        self.cancel_share, self.max_tokens = cancel_share, max_tokens
        self.done = collections.Counter()
        self.errors = collections.Counter()
        self.rng = random.Random(0)

    async def run(self, until: float) -> None:
        async with AsyncChatClient(self.url, idle_timeout_s=120) as client:
            workers = [self._worker(client, until) for _ in range(self.concurrency)]
            await asyncio.gather(*workers)

    async def _worker(self, client: AsyncChatClient, until: float) -> None:
        while time.monotonic() < until:
            tokens = self.rng.randint(1, self.max_tokens)
            request = GenerateRequest(
                prompt=f"Soak {self.rng.random():.6f}: tell me a story",
                sampling={
                    "max_tokens": tokens,
                    "temperature": 0.8,
                    "seed": self.rng.randint(0, 99),
                },
            )
            cancel_after = (
                self.rng.randint(1, tokens) if self.rng.random() < self.cancel_share else 0
            )
            await self._one(client, request, cancel_after)

    async def _one(self, client: AsyncChatClient, request: GenerateRequest, cancel_after: int):
        received = 0
        chunks = client.generate(request)
        try:
            async for chunk in chunks:
                received += chunk.tokens
                if cancel_after and received >= cancel_after:
                    self.done["cancelled"] += 1
                    return
            self.done["finished"] += 1
        except GenerationError as error:
            self.errors[f"{error.code}: {error.message[:100]}"] += 1
        finally:
            await chunks.aclose()


def start_serve(args: argparse.Namespace) -> tuple[Served, str]:
    """`tokenstream serve --no-bridge` on free ports, ready (scripts/served.py; its output
    discarded); returns it and its gRPC address."""
    ports = {name: free_port() for name in ("http", "grpc", "metrics", "supervisor")}
    command = [sys.executable, "-m", "clients.cli", "serve", "--no-bridge"]
    command += [f"--{name}-port={port}" for name, port in ports.items()]
    command += [f"--model={args.model}"] if args.model else []
    command += [f"--max-streams={args.concurrency}"]
    ready = [f"http://127.0.0.1:{ports['supervisor']}/ready"]
    served = Served(command, ready, "serve", log=Path(os.devnull))
    served.start()
    return served, f"127.0.0.1:{ports['grpc']}"


def server_pid(serve: subprocess.Popen) -> int:
    """The tritonserver under a serve process (the child running the binary)."""
    for pid in descendants(serve.pid):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"tritonserver" in command.split(b"\0")[0]:
            return pid
    raise SystemExit("no tritonserver under serve")


async def sample(load: Load, pid: int, until: float, every: float, rows: list) -> None:
    """One line every `every` seconds: time, outcomes, errors, RSS."""
    started = time.monotonic()
    while time.monotonic() < until:
        server, stubs = tree_rss(pid)
        row = (time.monotonic() - started, sum(load.done.values()), sum(load.errors.values()))
        rows.append((*row, server, stubs))
        print(
            f"{row[0]:7.0f} s  done {row[1]:7d}  errors {row[2]:4d}  "
            f"tritonserver {server:8.1f} MiB  stubs {stubs:8.1f} MiB",
            flush=True,
        )
        await asyncio.sleep(min(every, max(0.0, until - time.monotonic())) or every)


async def soak(args: argparse.Namespace, url: str, pid: int) -> list:
    until = time.monotonic() + args.minutes * 60
    load = Load(url, args.concurrency, args.cancel_share, args.max_tokens)
    rows: list = []
    await asyncio.gather(load.run(until), sample(load, pid, until, args.sample_s, rows))
    print(f"outcomes: {dict(load.done)}")
    print(f"errors: {dict(load.errors) or 'none'}")
    return rows


def report_growth(rows: list, warmup_s: float) -> None:
    """RSS growth from the first sample after warm-up to the last."""
    after = [row for row in rows if row[0] >= warmup_s]
    if len(after) < 2:
        print("run longer than the warm-up for a growth figure")
        return
    first, last = after[0], after[-1]
    for index, name in ((3, "tritonserver"), (4, "stubs")):
        growth = (last[index] - first[index]) / max(first[index], 1e-9) * 100
        print(
            f"{name}: {first[index]:.1f} -> {last[index]:.1f} MiB after warm-up ({growth:+.1f} %)"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--cancel-share", type=float, default=0.3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--sample-s", type=float, default=30.0)
    parser.add_argument("--warmup-s", type=float, default=120.0)
    parser.add_argument("--model", help="served model (default: serve's default)")
    parser.add_argument("--grpc-url", help="a running server instead of our own serve")
    parser.add_argument("--pid", type=int, help="its tritonserver's pid (with --grpc-url)")
    args = parser.parse_args()
    serve = None
    if args.grpc_url:
        url, pid = args.grpc_url, args.pid
        if pid is None:
            raise SystemExit("--grpc-url needs --pid (tritonserver's) for the RSS figures")
    else:
        serve, url = start_serve(args)
    try:
        if serve is not None:
            pid = server_pid(serve.process)
        rows = asyncio.run(soak(args, url, pid))
        report_growth(rows, args.warmup_s)
    finally:
        if serve is not None:
            serve.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
