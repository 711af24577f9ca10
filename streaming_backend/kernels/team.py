"""The C kernels' thread team (csrc/team.c, csrc/team.h): what it did, and a test's hold on its
workers. The kernels take their thread count per call (torch's, which the engine's StepThreads
sets per step); the calling thread never waits for a worker the scheduler has parked, it computes
that worker's chunk itself (docs/design.md, "The served path on two cores")."""

from __future__ import annotations

import ctypes
from typing import NamedTuple

from streaming_backend.kernels.build import library


class TeamStats(NamedTuple):
    """What the kernels' thread team (csrc/team.c) did since load."""

    jobs: int  # jobs run with workers
    worker_chunks: int  # chunks a worker computed and stored
    takeovers: int  # chunks the calling thread computed in place of a parked worker
    contended: int  # calls run on the calling thread alone: another thread held the team
    workers: int  # worker threads started
    busy: int  # workers inside a job now (none between calls)


def stats() -> TeamStats | None:
    """The team's counts; None where the library cannot be built."""
    loaded = library()
    if loaded is None:
        return None
    out = (ctypes.c_int64 * 6)()
    loaded[0].ts_team_stats(out)
    return TeamStats(*out)


def hold_workers(seconds: float) -> None:
    """Tests only: every worker of the team pauses this long after computing a chunk, before it
    commits it (as a thread the scheduler parks); 0 ends it."""
    loaded = library()
    if loaded is not None:
        fn = loaded[0].ts_team_test_hold
        fn.argtypes = [ctypes.c_int64]
        fn(int(seconds * 1e9))
