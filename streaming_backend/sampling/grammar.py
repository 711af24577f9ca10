"""Constrained decoding: a request's guided_* setting -> a per-row token mask (llguidance).

A request with a grammar gets its own `GrammarMatcher`; each step, `apply_grammar_masks` sets the
logits of the tokens its grammar forbids to -inf in that row only, so rows with and without a
grammar share one batch, and a batch without any grammar pays nothing. After a token is chosen,
the row's matcher `accept`s it; once the grammar is complete (`done`), the stream ends with STOP.
EOS is allowed only where the grammar accepts.

A row whose mask cannot be made (llguidance failing mid-stream) is reported, not raised: its
stream ends with MaskFailed and the batch goes on. Where the host is idle while the forward runs
(a GPU), the engine has the next step's masks filled on a worker thread meanwhile
(`compute_masks_ahead`), and the step only waits for them.

Compiled grammars are cached by their text: every request with the same schema starts from a
copy of one compiled matcher. A grammar that does not compile (a bad schema, regex or Lark text)
fails its request alone with InvalidRequest, at submit.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import threading
from collections.abc import Collection, Sequence
from typing import Any

import torch

from streaming_backend.errors import InvalidRequest, MaskFailed
from streaming_backend.sampling.request_keys import (
    GUIDED_CHOICE,
    GUIDED_GRAMMAR,
    GUIDED_JSON,
    GUIDED_JSON_OBJECT,
    GUIDED_REGEX,
)
from streaming_backend.sampling.settings import SamplingSettings

# JSON as json.dumps writes it ({"a": 1, "b": [2, 3]}): no free whitespace, which a small model
# could otherwise repeat until max_tokens. A schema's own "x-guidance" options override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 64  # compiled grammars kept
BITS = 32  # tokens per word of llguidance's bitmask


def grammar_source(settings: SamplingSettings) -> tuple[str, str] | None:
    """(the guided_* key, llguidance's grammar text) of a request; None when unconstrained."""
    import llguidance

    build = llguidance.LLMatcher
    if settings.guided_json is not None:
        schema = json.loads(settings.guided_json)
        return GUIDED_JSON, build.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if settings.guided_json_object:
        schema = {"type": "object"}
        return GUIDED_JSON_OBJECT, build.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if settings.guided_regex is not None:
        return GUIDED_REGEX, build.grammar_from_regex(settings.guided_regex)
    if settings.guided_choice is not None:
        # JSON string literals are Lark string literals: quotes and backslashes stay escaped
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in settings.guided_choice)
        return GUIDED_CHOICE, build.grammar_from_lark(f"start: {alternatives}")
    if settings.guided_grammar is not None:
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            lark = any_to_lark(settings.guided_grammar)
        except Exception as exc:  # the GBNF converter's own parse errors
            raise InvalidRequest(f"sampling_parameters.{GUIDED_GRAMMAR}: {exc}") from None
        return GUIDED_GRAMMAR, build.grammar_from_lark(lark)
    return None


class GrammarMatcher:
    """One row's grammar state: fills its mask, accepts chosen tokens, says when it is done."""

    live = 0  # matchers created and not yet released, across all engines (for tests and health)
    _count_lock = threading.Lock()

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher
        self._ahead: Any = None  # its next mask, being computed (compute_masks_ahead)
        with GrammarMatcher._count_lock:
            GrammarMatcher.live += 1

    def native(self) -> Any:
        """llguidance's matcher; MaskFailed once released."""
        if self._matcher is None:
            raise MaskFailed("the grammar's matcher was released")
        return self._matcher

    def set_ahead(self, ahead: Any) -> None:
        self._ahead = ahead

    def take_ahead(self) -> Any:
        """The mask being computed ahead for the current state (None if none), handed once."""
        ahead, self._ahead = self._ahead, None
        return ahead

    @property
    def done(self) -> bool:
        """True once the grammar is complete (nothing may follow): the stream ends here."""
        return self._matcher is None or self._matcher.is_stopped()

    def accept(self, token: int) -> bool:
        """Advance past a chosen token; False when the grammar forbids it."""
        ahead = self.take_ahead()  # a mask of the state before this token: let it finish
        if ahead is not None:
            ahead.wait()
        return self._matcher is not None and self._matcher.consume_token(token)

    def error(self) -> str:
        """Why the grammar rejected the last token."""
        return self._matcher.get_error() if self._matcher is not None else "released"

    def release(self) -> None:
        """Drop the matcher's state (its stream ended); safe to call twice."""
        if self._matcher is not None:
            self._matcher = None
            with GrammarMatcher._count_lock:
                GrammarMatcher.live -= 1

    def __del__(self) -> None:  # a request refused at submit (queue full) is never released
        self.release()


class GrammarCompiler:
    """Compiles requests' grammars against one model's tokenizer; caches them by grammar text."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Collection[int]) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width, which may exceed the tokenizer's
        self._eos_ids = sorted(eos_ids)
        self._tokenizer = None  # llguidance's, built at the first grammar (about 0.3 s)
        self._compiled: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, settings: SamplingSettings) -> GrammarMatcher | None:
        """A fresh matcher for a request's grammar, None without one; InvalidRequest if it does
        not compile. Called where the request is submitted, on any thread."""
        if not settings.constrained:
            return None
        key, source = grammar_source(settings)
        with self._lock:
            prototype = self._compiled.get(source)
            if prototype is None:
                prototype = self._compile(key, source)
                self._compiled[source] = prototype
                if len(self._compiled) > CACHE_SIZE:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(source)
            return GrammarMatcher(prototype.deep_copy())

    def _compile(self, key: str, source: str) -> Any:
        import llguidance

        tokenizer = self._llg_tokenizer()
        problem = llguidance.LLMatcher.validate_grammar(source, tokenizer)
        matcher = None if problem else llguidance.LLMatcher(tokenizer, source, log_level=0)
        if matcher is not None and matcher.is_error():
            problem = matcher.get_error()
        if problem:
            raise InvalidRequest(f"sampling_parameters.{key} does not compile: {problem.strip()}")
        return matcher

    def _llg_tokenizer(self) -> Any:
        if self._tokenizer is None:
            import llguidance.hf

            try:
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos_ids
                )
            except Exception as exc:  # e.g. a slow (Python) tokenizer
                message = f"this model's tokenizer cannot take a grammar: {exc}"
                raise InvalidRequest(message) from None
        return self._tokenizer


_executor = None  # llguidance's thread pool for filling many rows' masks at once
_ahead_worker = None  # the thread that fills next steps' masks while a forward runs


def apply_grammar_masks(
    logits: torch.Tensor, matchers: Sequence[GrammarMatcher | None]
) -> dict[int, MaskFailed]:
    """Set forbidden tokens' logits to -inf in rows with a matcher; logits [B, V], in place.

    matchers[row] is None for an unconstrained row; when every row's is None nothing is done.
    A mask computed ahead (`compute_masks_ahead`) is used when there is one. Returns the rows
    whose mask failed, each with its error: those rows are left unmasked, and their streams
    must end with the error (the other rows are masked and go on).
    """
    rows = [row for row, m in enumerate(matchers) if m is not None and m._matcher is not None]
    if not rows:
        return {}
    vocab_size = logits.shape[-1]
    masks, failed = {}, {}
    for row in rows:  # masks filled ahead, on the worker, while this step's forward ran
        ahead = matchers[row].take_ahead()
        if ahead is not None:
            try:
                masks[row] = ahead.result()
            except Exception:  # computed again below, where a failure is this row's alone
                pass
    now = [row for row in rows if row not in masks]
    if now:
        masks.update(_masks_now([matchers[row] for row in now], now, vocab_size, failed))
    if masks:
        masked = sorted(masks)
        allowed = torch.stack([masks[row] for row in masked])  # [R, V] bool, on the CPU
        index = torch.tensor(masked).to(logits.device)
        forbidden = ~allowed.to(logits.device, non_blocking=True)
        logits[index] = logits[index].masked_fill(forbidden, float("-inf"))
    return failed


def _masks_now(
    matchers: list[GrammarMatcher], rows: list[int], vocab_size: int, failed: dict
) -> dict[int, torch.Tensor]:
    """Every row's mask at once; should that fail, each row alone, recording which failed."""
    try:
        return dict(zip(rows, allowed_tokens(matchers, vocab_size)))
    except Exception:
        pass
    masks = {}
    for row, matcher in zip(rows, matchers):
        try:
            masks[row] = allowed_tokens([matcher], vocab_size)[0]
        except Exception as exc:
            failed[row] = MaskFailed(f"the grammar's token mask failed: {exc}")
    return masks


def compute_masks_ahead(matchers: Sequence[GrammarMatcher | None], vocab_size: int) -> None:
    """Start filling these matchers' next masks on a worker thread, to overlap the next forward.

    Call after each has accepted its latest token; `apply_grammar_masks` picks the masks up
    (or computes a row's now if its matcher was not given here). A matcher must not accept a
    token before its mask ahead was taken.
    """
    live = [m for m in matchers if m is not None and m._matcher is not None and not m.done]
    if not live:
        return
    future = _worker().submit(allowed_tokens, live, vocab_size)
    for index, matcher in enumerate(live):
        matcher.set_ahead(_Row(future, index))


class _Row:
    """One row of a batch of masks being computed: result() waits for it."""

    def __init__(self, future: concurrent.futures.Future, index: int) -> None:
        self._future, self._index = future, index

    def result(self) -> torch.Tensor:
        return self._future.result()[self._index]

    def wait(self) -> None:
        concurrent.futures.wait([self._future])


def _worker() -> concurrent.futures.ThreadPoolExecutor:
    global _ahead_worker
    if _ahead_worker is None:
        _ahead_worker = concurrent.futures.ThreadPoolExecutor(1, "grammar-masks")
    return _ahead_worker


def allowed_tokens(matchers: Sequence[GrammarMatcher], vocab_size: int) -> torch.Tensor:
    """Which tokens each matcher allows next -> bool [R, vocab_size], on the CPU."""
    global _executor
    import llguidance  # not llguidance.torch: it runs torch.compile when imported

    words = (vocab_size + BITS - 1) // BITS
    bitmask = torch.full((len(matchers), words), -1, dtype=torch.int32)  # [R, W], contiguous
    if _executor is None:
        _executor = llguidance.LLExecutor()
    pairs = [(m.native(), row) for row, m in enumerate(matchers)]
    # every row's mask at once, on llguidance's threads, written straight into the tensor
    _executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), words * 4, len(matchers))
    shifts = torch.arange(BITS, dtype=torch.int32)  # [32]
    bits = (bitmask[:, :, None] >> shifts) & 1  # [R, W, 32], token w*32+b is bit b of word w
    return bits.reshape(len(matchers), words * BITS)[:, :vocab_size].bool()
