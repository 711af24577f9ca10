"""The compact forward: chunked prefill under a token budget, prefix reuse, decode over slots.

Every admitted stream holds one slot of the preallocated KV cache. Its prompt is prefilled in
chunks: each engine step prefills at most the pacer's budget of prompt tokens (all admitted
prompts together, oldest first; about one decode step's time, or `prefill_chunk_tokens`) and
then runs one decode step for the streams already decoding, so a long new prompt delays running
streams by about one step per step instead of its whole prefill. With nothing decoding, the
budget is `max_prefill_tokens`: no one is waiting.

A new stream first looks for a slot whose tokens share a prefix with its prompt (PrefixCache): an
idle slot left by an ended stream is taken over as it is; a live stream's slot is copied. Either
way only the rest of the prompt is prefilled, and `cached_tokens` says how much was reused. A
slot whose sliding-window layers' rings have moved past a prefix's window cannot give that
prefix: the cache's one rule (SlotCache.reusable) decides which prefixes count, here and when
an ended stream's slot is kept.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterator, Sequence

import torch

from streaming_backend.configuration.models import EngineConfig
from streaming_backend.forward.runner import PromptChunk, SlotForward
from streaming_backend.model.memory import MemoryReport
from streaming_backend.model.prefix_cache import PrefixCache
from streaming_backend.steps import Decoded, OnFailure, Prefilled
from streaming_backend.steps.batch import RunningBatch, SlotRows
from streaming_backend.steps.draft_model import DraftModel, DraftRequest
from streaming_backend.steps.drafts import MAX_DRAFTING_ROWS, DraftCounts, Drafter
from streaming_backend.steps.pacing import PrefillPacer, timed

log = logging.getLogger(__name__)


class SlotSteps:
    """Streams on the compact forward's slot cache."""

    name = "compact"
    why = None  # the compact forward runs wherever it can: no reason to give
    prompt_tokens_per_step = None  # admission is by slots; prefill is chunked

    def __init__(
        self,
        forward: SlotForward,
        config: EngineConfig,
        on_failure: OnFailure,
        eos_ids: Collection[int] = (),
        draft_model: DraftModel | None = None,
    ):
        self.forward = forward
        self.cache = forward.cache
        self.config = config
        self.prefix = PrefixCache() if config.prefix_cache != "off" else None
        self._answers = config.prefix_cache == "on"  # else only prompt KV (prefill's) is reused
        self._on_failure = on_failure
        self._slot: dict[int, int] = {}  # id(stream) -> its slot, prefilling or decoding
        self._prefilling: list = []  # admitted, prompt not wholly in the cache; oldest first
        self._batch: RunningBatch = RunningBatch(SlotRows(forward), eos_ids, forward.device)
        self.pacer = PrefillPacer(
            fixed=config.prefill_chunk_tokens, ceiling=config.max_prefill_tokens
        )
        # speculative decoding (steps/drafts.py): off until the engine turns it on; the drafts
        # come from the context, or from a draft model where one was loaded (steps/build.py)
        self.draft_counts: DraftCounts | None = None
        self.draft_model = draft_model
        self._drafters: dict[int, Drafter] = {}  # id(stream) -> its drafts

    @property
    def quantize(self) -> str:
        """The linear weights' format the forward runs on (forward/quant.py)."""
        return self.forward.model.quantize

    @property
    def attention(self) -> str:
        """What computes the exact attention: the C kernel as built, or torch (forward/llama.py)."""
        return self.forward.model.attention

    @property
    def matmul(self) -> str:
        """What runs the linear weights: our C kernels, aten or dense (forward/quant.py)."""
        return self.forward.model.matmul

    @property
    def weights_digest(self) -> str:
        """numerics.weights_digest of the model the forward was derived from, where its
        builder knew it (a weight file's); "" where the loaded model tells it."""
        return self.forward.model.weights_digest

    @property
    def kv_cache(self) -> dict:
        """The slot cache's size and rings (SlotCache.report), for /status."""
        return self.cache.report()

    @property
    def kv_cache_dtype(self) -> str:
        """The slot cache's dtype (forward/runner.py cache_dtype), for the numerics."""
        return str(self.cache.dtype).removeprefix("torch.")

    @property
    def draft_kv_cache(self) -> dict | None:
        """The draft model's slot cache (SlotCache.report), for /status; None without one."""
        return self.draft_model.cache.report() if self.draft_model is not None else None

    def memory(self) -> MemoryReport | None:
        """What the weights and the KV cache cost the host now; None on a GPU."""
        if self.forward.device.type != "cpu":
            return None
        weights, kv = [*self.forward.model.tensors()], [*self.cache.k, *self.cache.v]
        if self.draft_model is not None:  # the draft model's, where one drafts
            weights += self.draft_model.forward.model.tensors()
            kv += [*self.draft_model.cache.k, *self.draft_model.cache.v]
        return MemoryReport.of(weights, kv)

    @property
    def decode_path(self) -> str:
        """eager, or the faster step steps/build.py set up: CUDA graphs on a GPU, else compiled."""
        if self.forward.compile_seconds is None:  # not asked for, or it failed: eager
            return "eager"
        return "cuda_graphs" if self.forward.device.type == "cuda" else "compiled"

    # ---- admission ------------------------------------------------------------------------------

    def capacity(self) -> int:
        """Streams that can start: free slots, idle prefix entries, and the max_streams limit."""
        idle = len(self.prefix) if self.prefix is not None else 0
        room = self.config.max_streams - len(self._slot)
        return min(room, self.cache.free_slots + idle)

    def live(self) -> list:
        return [*self._prefilling, *self._batch.rows]

    def admit(self, streams: list) -> None:
        """Give each stream a slot, starting from the longest cached prefix of its prompt."""
        for stream in streams:
            slot, reused = self._place(stream.prompt_ids)
            self._slot[id(stream)] = slot
            stream.cached_tokens = reused
            self._prefilling.append(stream)

    def _place(self, prompt: list[int]) -> tuple[int, int]:
        """(slot, prompt tokens already in it) for a new prompt."""
        match = None
        if self.prefix is not None:
            live = [(self._slot[id(s)], self._reusable(s)) for s in self.live()]
            # at least the last prompt token is run again: its logits give the first new token
            match = self.prefix.best(
                prompt,
                live,
                lambda slot, shared: self.cache.reusable(slot, min(shared, len(prompt) - 1)),
            )
        reused = match.length if match else 0
        if match is None or reused < self.prefix.min_reuse:
            return self._allocate(), 0
        if match.idle:
            self.prefix.take(match.slot)
            self.cache.truncate(match.slot, reused)
            return match.slot, reused
        slot = self._allocate()
        self.cache.copy_prefix(match.slot, slot, reused)
        return slot, reused

    def _allocate(self) -> int:
        """A free slot, or the least recently used idle one."""
        if self.cache.free_slots:
            return self.cache.allocate()
        if self.prefix is None or not len(self.prefix):
            raise RuntimeError("no KV cache slot is free: admission went past capacity()")
        slot = self.prefix.evict()
        self.cache.truncate(slot, 0)
        return slot

    def _reusable(self, stream) -> Sequence[int]:
        """The tokens of the stream's slot that other prompts may reuse."""
        written = self._written(stream)
        return written if self._answers else written[: len(stream.prompt_ids)]

    def _written(self, stream) -> Sequence[int]:
        """The tokens whose keys and values are in the stream's slot."""
        length = self.cache.lengths[self._slot[id(stream)]]
        prompt = stream.prompt_ids
        if length <= len(prompt):
            return prompt[:length]
        return prompt + stream.output_ids[: length - len(prompt)]

    # ---- prefill --------------------------------------------------------------------------------

    def prefill(self) -> Iterator[Prefilled]:
        """Prefill the next chunks of the admitted prompts; yield the streams now complete."""
        if not self._prefilling:
            return
        budget = self.pacer.budget() if self._batch.rows else None
        chunks = self._chunks(budget or self.config.max_prefill_tokens)
        now = time.monotonic_ns()
        for stream, _ in chunks:
            stream.scheduled_ns = stream.scheduled_ns or now
        ready, logits = self._run(chunks)
        if ready:
            yield Prefilled(ready, torch.cat(logits))

    def _chunks(self, budget: int) -> list[tuple[object, PromptChunk]]:
        """This step's chunks, oldest prompts first: `budget` tokens at most, one chunk at least."""
        chunks = []
        for stream in self._prefilling:
            if budget <= 0:
                break
            slot = self._slot[id(stream)]
            start = self.cache.lengths[slot]
            tokens = stream.prompt_ids[start : start + budget]
            chunks.append((stream, PromptChunk(slot, tokens)))
            budget -= len(tokens)
        return chunks

    def _run(self, chunks: list) -> tuple[list, list[torch.Tensor]]:
        """Run the chunks in one pass (each alone if that fails: only a bad one fails)."""
        try:
            logits, seconds = timed(
                lambda: self.forward.prefill([chunk for _, chunk in chunks]), self._sync
            )
            self.pacer.observe_prefill(sum(len(c.tokens) for _, c in chunks), seconds)
        except Exception as exc:
            if len(chunks) == 1:
                stream = chunks[0][0]
                log.exception("prefill failed for %s", stream.handle.request_id)
                self.remove([stream], keep=False)
                self._on_failure([stream], exc)
                return [], []
            ready, parts = [], []
            for chunk in chunks:
                more, logit = self._run([chunk])
                ready += more
                parts += logit
            return ready, parts
        done = [r for r, (s, _) in enumerate(chunks) if self._prompt_done(s)]
        ready = [chunks[r][0] for r in done]
        for stream in ready:
            self._prefilling.remove(stream)
        if ready:
            self._batch.add(ready, [self._slot[id(s)] for s in ready])
        return ready, ([logits[done]] if done else [])

    def _prompt_done(self, stream) -> bool:
        return self.cache.lengths[self._slot[id(stream)]] == len(stream.prompt_ids)

    # ---- decode ---------------------------------------------------------------------------------

    def decoding(self) -> bool:
        return bool(self._batch.rows)

    def decode(self) -> Decoded:
        """One token for every decoding stream, at its slot's next position; with drafts on,
        the drafted tokens of a few rows too (their logits after each; `settle` after)."""
        drafts = self._propose() if self.draft_counts is not None else ()
        step, seconds = timed(lambda: self._batch.step(drafts), self._sync)
        if not any(drafts):
            self.pacer.observe_decode(seconds)
        return step

    # ---- speculative decoding -------------------------------------------------------------------

    def enable_drafts(self, counts: DraftCounts) -> str | None:
        """Draft from the context from now on, counting into `counts`; None when on, else why
        not (a compiled or graphed decode step verifies nothing: it runs one token a row)."""
        if self.forward.compile_seconds is not None:
            return f"the decode step is {self.decode_path}"
        self.draft_counts = counts
        return None

    def _propose(self) -> list[list[int]]:
        """Each decoding row's draft ([] for most): none past MAX_DRAFTING_ROWS rows, none for
        a request that turned speculation off, and none past its max_tokens or its slot."""
        rows = self._batch.rows
        if len(rows) > MAX_DRAFTING_ROWS:
            return []
        drafts: list[list[int]] = [[] for _ in rows]
        wanted = []  # a draft model's: (row, its drafter, its request)
        for row, stream in enumerate(rows):
            if not stream.settings.speculate:
                continue
            drafter = self._drafters.get(id(stream))
            if drafter is None:
                from_context = self.draft_model is None
                drafter = self._drafters[id(stream)] = Drafter(self.draft_counts, from_context)
            room = self._draft_room(stream)
            if self.draft_model is None:
                drafts[row] = drafter.propose(stream.prompt_ids, stream.output_ids, room)
            elif count := drafter.budget(stream.prompt_ids, stream.output_ids, room):
                context = stream.prompt_ids + stream.output_ids
                wanted.append((row, drafter, DraftRequest(id(stream), context, count)))
        if wanted:
            for (row, drafter, _), draft in zip(wanted, self._drafted([r for *_, r in wanted])):
                drafter.drafted(draft, rows[row].output_ids)
                drafts[row] = draft
        return drafts

    def _drafted(self, requests: list[DraftRequest]) -> list[list[int]]:
        """The draft model's drafts; where it fails, none, and none from it again: the streams
        go on decoding without it (a failing draft must not fail them)."""
        try:
            return self.draft_model.propose(requests)
        except Exception:
            log.exception("the draft model failed: speculative decoding stops")
            self.draft_model = self.draft_counts = None
            return [[] for _ in requests]

    def _draft_room(self, stream) -> int:
        """The most tokens a stream may draft now: within its max_tokens, its slot's context
        and, where the cache keeps rings, their spare (which keeps the window behind any
        rollback)."""
        spare = self.cache.chunk_limit
        length = self.cache.lengths[self._slot[id(stream)]]
        return min(
            stream.settings.max_tokens - len(stream.output_ids) - 1,
            self.cache.max_len - length - 1,
            spare - 1 if spare is not None else self.cache.max_len,
        )

    def settle(self, step: Decoded) -> None:
        """After a step's tokens were emitted: each row that verified drafts keeps the keys and
        values of its context but the newest token (as a decode step leaves it); those of its
        rejected drafts are dropped. Its drafter learns what was accepted."""
        for stream, drafted in zip(step.streams, step.drafts):
            slot = self._slot.get(id(stream))
            if not drafted or slot is None:
                continue
            kept = len(stream.prompt_ids) + len(stream.output_ids) - 1
            self.cache.truncate(slot, min(kept, self.cache.lengths[slot]))
            self._drafters[id(stream)].observe(stream.prompt_ids, stream.output_ids)

    def _sync(self) -> None:
        """Wait for the device's queued work, so a step's time is its real cost."""
        if self.forward.device.type == "cuda":
            torch.cuda.synchronize(self.forward.device)

    def calibrate(self, sizes: tuple[int, ...] = (32, 160), rounds: int = 3) -> None:
        """Time prefill chunks of two sizes (their fixed and per-token costs) and one decode
        step on a spare slot, so the first steps' budget is already sized in time (the
        engine's own steps keep it current). A round whose times give no positive per-token
        cost (another process took the cores mid-round, or the per-token cost is below the
        timer's noise, as on a tiny model) is followed by another, `rounds` at most; after
        that the fastest prefill of the larger size bounds the per-token cost (its average,
        fixed part included) until the steps' own prefills fit a slope."""
        if self.pacer.fixed is not None or not self.cache.free_slots:
            return
        slot = self.cache.allocate()
        try:
            self._time_prefill(slot, sizes[0])  # pays allocations and kernel selection: not counted
            largest = None  # (tokens, seconds) of the fastest prefill of the larger size
            for _ in range(rounds):
                for size in (*sizes, *sizes):
                    tokens, seconds = self._time_prefill(slot, size)
                    self.pacer.observe_prefill(tokens, seconds)
                    if size == max(sizes) and (largest is None or seconds < largest[1]):
                        largest = (tokens, seconds)
                if self.pacer.seconds_per_token is not None:
                    break
            if largest is not None:
                self.pacer.bound_per_token(*largest)
            _, seconds = timed(lambda: self.forward.decode([slot], [0]), self._sync)
            self.pacer.observe_decode(seconds)
        finally:
            self.cache.free(slot)

    def _time_prefill(self, slot: int, size: int) -> tuple[int, float]:
        """(tokens, seconds) of one prefill of `size` tokens (at most the slot's room) from
        the start of `slot`."""
        tokens = [0] * min(size, self.cache.max_len - 1)
        self.cache.truncate(slot, 0)
        _, seconds = timed(lambda: self.forward.prefill([PromptChunk(slot, tokens)]), self._sync)
        return len(tokens), seconds

    # ---- forks (beam search) --------------------------------------------------------------------

    def fork(self, pairs: Sequence[tuple]) -> None:
        """Each child takes a slot holding a copy of its decoding parent's (every position the
        parent has written) and decodes on from there."""
        slots = []
        for parent, child in pairs:
            source = self._slot[id(parent)]
            slot = self._allocate()
            self.cache.copy_prefix(source, slot, self.cache.lengths[source])
            self._slot[id(child)] = slot
            slots.append(slot)
        if pairs:
            self._batch.add([child for _, child in pairs], slots)

    # ---- leaving --------------------------------------------------------------------------------

    def remove(self, streams: Collection, keep: bool = True) -> None:
        """Free the streams' slots; with `keep`, their KV stays reusable as a prefix."""
        for stream in streams:
            slot = self._slot.get(id(stream))
            if slot is None:
                continue
            reusable = self._reusable(stream) if keep and self.prefix is not None else ()
            reusable = reusable[: self.cache.reusable(slot, len(reusable))]  # all, or none
            if reusable:
                self.cache.truncate(slot, len(reusable))
                self.prefix.keep(slot, reusable)
            else:
                self.cache.free(slot)
            del self._slot[id(stream)]
            self._drafters.pop(id(stream), None)
            if self.draft_model is not None:
                self.draft_model.release(id(stream))
            if stream in self._prefilling:
                self._prefilling.remove(stream)
        self._batch.remove(streams)

    def clear(self) -> list:
        """Drop every stream (their KV may be half written: nothing is kept)."""
        streams = self.live()
        self.remove(streams, keep=False)
        return streams
