"""Pick the forward a model runs on (EngineConfig.forward) and build its steps."""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

from streaming_backend.configuration.models import EngineConfig, parse_memory
from streaming_backend.model.loading import LoadedModel, progress, resolve_quantize, with_weights
from streaming_backend.steps import OnFailure, Steps
from streaming_backend.steps.forward_choice import fall_back
from streaming_backend.steps.hf import ASKED_FOR, HfSteps
from streaming_backend.steps.pacing import PrefillPacer

log = logging.getLogger(__name__)

PREFIX_ENTRIES_PER_STREAM = 2  # KV cache slots per max_streams (the budget may allow fewer)


class Carried(NamedTuple):
    """What compact steps rebuilt with another slot length keep: the compact model (no weights
    converted again), the caches' memory (the draft model's included), the measured pacing (no
    calibration) and the draft model (steps/draft_model.py: not loaded again; its cache is
    made anew)."""

    model: Any  # forward.llama.CompactLlama
    cache_bytes: int
    pacer: PrefillPacer
    draft: Any = None  # steps.draft_model.DraftWeights, where one drafts

    @classmethod
    def of(cls, steps: Any) -> Carried:
        """From compact steps (steps/slots.py SlotSteps), which are then no longer used."""
        cache, draft = steps.cache, steps.draft_model
        bytes_ = (cache.slots + 1) * cache.slot_bytes
        if draft is not None:
            bytes_ += draft.cache.bytes
        return cls(steps.forward.model, bytes_, steps.pacer, draft and draft.weights)


def build_steps(
    loaded: LoadedModel, config: EngineConfig, on_failure: OnFailure, carried: Carried | None = None
) -> Steps:
    """The compact forward's steps when asked for or possible ("auto"), else Hugging Face's;
    `carried`: rebuilding compact steps with another slot length (`config.max_len`)."""
    if config.forward == "hf":
        log.info("the Hugging Face forward runs this model: %s", ASKED_FOR)
        _check_hf_cache(loaded, config)
        return HfSteps(with_weights(loaded), config, on_failure)
    from streaming_backend.forward.llama import UnsupportedModel
    from streaming_backend.forward.runner import ForwardConfig, SlotForward
    from streaming_backend.forward.slots import CacheBudget
    from streaming_backend.model.weight_cache import compact_model
    from streaming_backend.steps.slots import SlotSteps

    size, fraction = parse_memory(config.kv_cache_memory)
    model = draft = None
    if carried is not None:
        model, size, fraction, draft = carried.model, carried.cache_bytes, None, carried.draft
    forward_config = ForwardConfig(
        budget=CacheBudget(bytes=size, fraction=fraction),
        max_len=config.max_len,
        compile=config.compile,
        cuda_graphs=config.compile and loaded.device.type == "cuda",
        quantize=resolve_quantize(config.quantize, loaded),
        kv_cache_dtype=config.kv_cache_dtype,
        # live streams plus as many idle prefix entries: each admission compares its prompt
        # with every entry, and more entries rarely hit
        max_slots=PREFIX_ENTRIES_PER_STREAM * config.max_streams,
    )
    try:
        if model is None:  # mapped from its weight file where loaded is a skeleton
            model = compact_model(
                loaded, forward_config.quantize, forward_config.matmul, forward_config.huge_pages
            )
        draft = _draft_weights(loaded, config, draft)
        draft_slots = 0
        if draft is not None:  # its KV cache comes out of the budget
            forward_config, draft_slots = _share_budget(
                loaded, forward_config, model, draft, config.max_streams
            )
        forward = SlotForward.create(loaded, forward_config, model)
    except UnsupportedModel as exc:
        why = fall_back(exc, config.forward)
        _check_hf_cache(loaded, config)
        return HfSteps(with_weights(loaded), config, on_failure, why=why)
    cache = forward.cache
    if draft is not None:
        draft = draft.with_cache(draft_slots, cache.max_len)
    steps = SlotSteps(forward, config, on_failure, loaded.eos_ids, draft)
    if carried is None:
        steps.calibrate()
    else:
        steps.pacer = carried.pacer
    if (report := steps.memory()) is not None:
        progress(report.describe())
    log.info(
        "compact forward: %d KV cache slots of %d positions (%.0f MiB%s)%s, prefix cache %s, %s%s",
        cache.slots,
        cache.max_len,
        cache.bytes / 2**20,
        cache.describe_rings(),
        f"; {draft.describe()}, kv_cache_memory holding both" if draft is not None else "",
        config.prefix_cache,
        steps.pacer.describe(),
        f", decode step compiled in {forward.compile_seconds:.1f} s"
        if forward.compile_seconds is not None
        else "",
    )
    return steps


def _check_hf_cache(loaded: LoadedModel, config: EngineConfig) -> None:
    """ValueError where kv_cache_dtype asks Hugging Face's forward (its cache is in the model's
    dtype) for another dtype."""
    dtype = str(loaded.dtype).removeprefix("torch.")
    if config.kv_cache_dtype not in ("auto", dtype):
        raise ValueError(
            f"kv_cache_dtype {config.kv_cache_dtype}: the Hugging Face forward keeps its KV "
            f"cache in the model's dtype ({dtype}); use kv_cache_dtype auto"
        )


def _draft_weights(loaded: LoadedModel, config: EngineConfig, carried: Any) -> Any:
    """speculative=draft's draft model (steps/draft_model.py DraftWeights), without a cache:
    `carried` (the draft model of the steps rebuilt), else loaded now; None in any other mode.
    ValueError when its vocabulary is not the model's."""
    if config.speculative != "draft":
        return None
    if carried is not None:
        return carried
    from streaming_backend.steps.draft_model import load_draft_model

    return load_draft_model(config.draft_model, loaded, config)


def _share_budget(
    loaded: LoadedModel, forward_config: Any, model: Any, draft: Any, streams: int
) -> tuple[Any, int]:
    """The forward's config with the KV cache budget left to the model once the draft model's
    cache has its share, and that cache's slot count: a draft slot for each model slot, at most
    one a stream (`streams`: max_streams), the scratch slots of both counted
    (forward/slots.py draft_slots_for_budget). kv_cache_memory bounds the two caches together."""
    from dataclasses import replace

    from streaming_backend.forward.runner import cache_dtype, cache_positions
    from streaming_backend.forward.slots import CacheBudget, draft_slots_for_budget, slot_bytes

    budget = forward_config.budget.resolve(loaded.device)
    max_len = cache_positions(loaded, forward_config, model)
    dtype = cache_dtype(forward_config, loaded.dtype, model)
    slot = slot_bytes(model.shape, max_len, dtype, forward_config.window_chunk)
    draft_slot = draft.slot_bytes(max_len)
    slots = draft_slots_for_budget(budget, slot, draft_slot, streams)
    left = CacheBudget(bytes=budget - (slots + 1) * draft_slot)
    return replace(forward_config, budget=left), slots
