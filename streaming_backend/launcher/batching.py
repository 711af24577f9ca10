"""How the dialogue model batches: the config.pbtxt rewrites (instance count, queue delay,
dynamic batching on or off) the launcher applies to its runtime copy of the repository.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from streaming_backend.launcher.repository import mask_comments
from streaming_backend.wire import DIALOGUE_MODEL

_INSTANCE_COUNT = re.compile(r"(instance_group\s*\[\s*\{[^}]*?\bcount\s*:\s*)\d+")
_QUEUE_DELAY = re.compile(r"(max_queue_delay_microseconds\s*:\s*)\d+")
_DYNAMIC_BATCHING = re.compile(r"\bdynamic_batching\s*\{")


@dataclass(frozen=True)
class DialogueBatching:
    """The dialogue model's instance count and batching; None keeps config.pbtxt's value."""

    instances: int | None = None
    queue_delay_us: int | None = None
    dynamic_batching: bool = True  # False: no batcher, one request per execute()

    def __post_init__(self) -> None:
        if self.instances is not None and self.instances < 1:
            raise ValueError("the dialogue model needs at least one instance")
        if self.queue_delay_us is not None and self.queue_delay_us < 0:
            raise ValueError("the queue delay must not be negative")

    def rewrite(self, config_text: str) -> str:
        """The dialogue model's config.pbtxt with these settings applied."""
        if self.instances is not None:
            config_text = _replace_number(_INSTANCE_COUNT, config_text, self.instances)
        if self.queue_delay_us is not None:
            config_text = _replace_number(_QUEUE_DELAY, config_text, self.queue_delay_us)
        if not self.dynamic_batching:
            config_text = drop_block(config_text, _DYNAMIC_BATCHING)
        return config_text

    def rewrites(self) -> dict[str, Callable[[str], str]]:
        """Model name -> its config.pbtxt rewrite, for the launcher's runtime repository."""
        return {DIALOGUE_MODEL: self.rewrite}


def _replace_number(pattern: re.Pattern, text: str, value: int) -> str:
    """Replace the number after each match of `pattern` (outside comments); it must match."""
    matches = list(pattern.finditer(mask_comments(text)))
    if not matches:
        raise ValueError(f"config.pbtxt has no entry matching {pattern.pattern!r}")
    for match in reversed(matches):
        text = text[: match.end(1)] + str(value) + text[match.end() :]
    return text


def drop_block(text: str, opening: re.Pattern) -> str:
    """Remove a `name { ... }` block (nested braces allowed); unchanged when there is none."""
    masked = mask_comments(text)
    match = opening.search(masked)
    if match is None:
        return text
    depth = 0
    for index in range(match.end() - 1, len(masked)):
        depth += {"{": 1, "}": -1}.get(masked[index], 0)
        if depth == 0:
            return text[: match.start()] + text[index + 1 :]
    raise ValueError("config.pbtxt has an unclosed block")
