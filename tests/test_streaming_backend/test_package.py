"""What importing the package does before torch loads (streaming_backend/__init__.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT


def _spin_count(**env: str) -> str:
    """libgomp's GOMP_SPINCOUNT in a fresh process that imports the engine (and so torch) as
    the model processes do, with `env` on top of this one's, OMP_WAIT_POLICY removed."""
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    done = subprocess.run(
        [sys.executable, "-c", "import streaming_backend.engine"],
        env={**base, "OMP_DISPLAY_ENV": "VERBOSE", **env},
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    (line,) = [s for s in done.stderr.splitlines() if "GOMP_SPINCOUNT" in s]
    return line.split("=")[1].strip().strip("'")


def test_openmp_threads_wait_asleep():
    """Imported before torch, the package makes torch's OpenMP threads sleep between parallel
    regions (no spin) rather than spin for a while and take a core from the kernels' team."""
    assert _spin_count() == "0"


@pytest.mark.parametrize("policy", ("ACTIVE", "PASSIVE"))
def test_the_environments_own_wait_policy_is_kept(policy):
    """An operator's OMP_WAIT_POLICY is theirs: ACTIVE spins."""
    assert (_spin_count(OMP_WAIT_POLICY=policy) == "0") == (policy == "PASSIVE")
