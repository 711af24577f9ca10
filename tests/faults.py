"""Fault injection for engine tests: make the prompt forward of chosen requests raise."""

from __future__ import annotations

from collections.abc import Callable

from streaming_backend.steps.hf import HfSteps


def on_prefill(engine, hook: Callable[[list[str]], None]) -> None:
    """Call hook(request ids of the pass) before every prompt forward pass; it may raise."""
    steps = engine._steps
    if isinstance(steps, HfSteps):
        original = steps._forward_prompts

        def hf_pass(streams):
            hook([s.handle.request_id for s in streams])
            return original(streams)

        steps._forward_prompts = hf_pass
        return
    forward_prefill = steps.forward.prefill

    def slot_pass(chunks):
        owners = {steps._slot[id(s)]: s.handle.request_id for s in steps.live()}
        hook([owners[chunk.slot] for chunk in chunks])
        return forward_prefill(chunks)

    steps.forward.prefill = slot_pass
