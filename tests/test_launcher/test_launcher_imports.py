"""The launcher needs only the standard library: no torch, numpy, transformers or clients."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO_ROOT

LIGHT_MODULES = [
    "streaming_backend.launcher",
    "streaming_backend.launcher.binary",
    "streaming_backend.launcher.processes",
    "streaming_backend.launcher.repository",
    "streaming_backend.launcher.server",
    "streaming_backend.launcher.control",
    "streaming_backend.launcher.watch",
    "streaming_backend.launcher.supervisor",
    "streaming_backend.launcher.health",
    "streaming_backend.config",
    "streaming_backend.paths",
]
HEAVY = ["torch", "numpy", "transformers", "clients", "tritonclient", "websockets"]


def test_the_launcher_imports_nothing_heavy() -> None:
    """Imported in a fresh interpreter, the launcher and its settings pull in no heavy package."""
    code = (
        "import importlib, json, sys\n"
        f"for name in {LIGHT_MODULES!r}: importlib.import_module(name)\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    loaded = set(json.loads(result.stdout))
    assert loaded.isdisjoint(HEAVY), sorted(loaded & set(HEAVY))
