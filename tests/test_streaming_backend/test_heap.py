"""heap.freeze_loaded_objects: a load's garbage collected, what survives out of later walks."""

from __future__ import annotations

import gc
import weakref

from streaming_backend.heap import freeze_loaded_objects


class _Node:
    def __init__(self):
        self.other = None


def test_a_loads_garbage_is_collected_and_its_survivors_frozen():
    kept = [{"layer": i} for i in range(1000)]  # what a load keeps: tracked containers
    cycle_a, cycle_b = _Node(), _Node()  # what it leaves: a reference cycle only gc frees
    cycle_a.other, cycle_b.other = cycle_b, cycle_a
    gone = weakref.ref(cycle_a)
    del cycle_a, cycle_b
    gc.unfreeze()
    try:
        freeze_loaded_objects()
        assert gone() is None  # collected before the freeze, not kept frozen for good
        assert gc.get_freeze_count() >= len(kept)
        # a full collection now walks only what came after: none of the frozen objects
        assert not any(obj is kept[0] for obj in gc.get_objects(generation=2))
    finally:
        gc.unfreeze()  # the rest of the suite's process as it was
