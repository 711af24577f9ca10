"""Incremental detokenising: text deltas that never split a UTF-8 character or a stop string."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

try:  # transformers 5's fast tokenizers (`decoder`)
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    from transformers.tokenization_utils_tokenizers import TokenizersBackend
except ImportError:  # another layout: every tokenizer decodes through its own decode
    PreTrainedTokenizerBase = TokenizersBackend = None

REPLACEMENT = "\ufffd"


def decoder(tokenizer: Any) -> Callable[[Sequence[int]], str]:
    """ids -> text as `tokenizer.decode(ids, skip_special_tokens=True)` gives it. For a Hugging
    Face fast tokenizer whose decode adds nothing to its backend's (no clean-up of spaces, no
    override), the backend's own decode: the same text without the wrapper's Python, which a
    token's two decodes paid after each decode step with the caches cold (28 us of a 3.1 ms
    step of the default model, in the history of docs/performance.md)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    plain = (
        TokenizersBackend is not None
        and isinstance(tokenizer, TokenizersBackend)
        and type(tokenizer).decode is PreTrainedTokenizerBase.decode
        and type(tokenizer)._decode is TokenizersBackend._decode
        and not tokenizer.clean_up_tokenization_spaces
        and backend is not None
    )
    if plain:
        return functools.partial(backend.decode, skip_special_tokens=True)
    return functools.partial(tokenizer.decode, skip_special_tokens=True)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas (prefix/read offsets, as TGI and vLLM).

    `prefix_offset..read_offset` is a window of ids already turned into text; decoding the window
    plus the new ids and cutting off the window's text gives the delta. While that delta ends in
    U+FFFD the last token holds part of a character: hold it back until the character completes.
    """

    def __init__(self, tokenizer: Any):
        self._decode = decoder(tokenizer)
        self.ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._emitted: list[str] = []

    def add(self, token_ids: Sequence[int]) -> str:
        """Append ids; return the text that is now complete (possibly "")."""
        self.ids.extend(token_ids)
        prefix_text = self._decode(self.ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self.ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.ids)
        self._emitted.append(delta)
        return delta

    def flush(self) -> str:
        """At the end of a stream: the text still held back, less a character it ends inside of.

        A stream stopped (by length, say) after the first bytes of a multi-byte character decodes
        to text ending in one U+FFFD for those bytes: that U+FFFD is dropped, so a stream's text
        never ends in half a character. U+FFFD for invalid bytes before it stay, as in the full
        decode. (From text alone an invalid byte at the very end looks the same and is dropped too.)
        """
        full = self._decode(self.ids)
        emitted = "".join(self._emitted)
        # The windows' texts concatenate to a prefix of the full decode; hand out the rest.
        rest = full[len(emitted) :] if full.startswith(emitted) else ""
        rest = rest.removesuffix(REPLACEMENT)  # the incomplete character (one U+FFFD at most)
        self._emitted.append(rest)
        self._prefix_offset = self._read_offset = len(self.ids)
        return rest
