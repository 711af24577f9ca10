"""The `tokenstream` command: one CLI with a subcommand per tool."""

# The subcommands with no package of their own live beside this file: `serve` (serve.py:
# tritonserver under its supervisor, and the bridge), `reload` (reload.py) and `chat` (chat.py,
# with prompt.py's terminal prompt). `python -m clients.cli` runs the command too (__main__.py).

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module exposing `add_arguments(parser)` and `main(args) -> int`.
# Modules are imported lazily so `tokenstream chat` does not pay for torch.
SUBCOMMANDS = {
    "serve": (
        "clients.cli.serve",
        "start and supervise tritonserver (and the bridge) on repository/",
    ),
    "reload": ("clients.cli.reload", "swap the model of a running serve without downtime"),
    "chat": ("clients.cli.chat", "chat with a running server in the terminal over gRPC"),
    "bridge": ("clients.bridge", "run the websocket bridge and chat page on its own"),
    "bench": ("clients.bench.cli", "measure TTFT, inter-token latency and throughput"),
    "engine-bench": ("clients.bench.engine", "benchmark the in-process engine vs HF generate"),
    "stress": ("clients.stress.cli", "load-test a model with many concurrent requests"),
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `tokenstream` console script."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="tokenstream", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        p.set_defaults(_module=module_name)
        if argv[:1] == [name]:
            importlib.import_module(module_name).add_arguments(p)
    args = parser.parse_args(argv)
    return int(importlib.import_module(args._module).main(args) or 0)
