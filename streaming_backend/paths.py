"""Where tokenstream keeps its files: the cache folder and the model repository it serves.

Standard library only, so the launcher and the model loader share these without importing torch.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_VARIABLE = "TOKENSTREAM_CACHE"  # the one variable that moves the cache (Docker sets it)
REPOSITORY_VARIABLE = "TOKENSTREAM_REPOSITORY"  # where an installed (non-editable) copy looks
CHECKOUT_REPOSITORY = Path(__file__).resolve().parent.parent / "repository"  # a source checkout


def cache_dir() -> Path:
    """$TOKENSTREAM_CACHE, else $XDG_CACHE_HOME/tokenstream, else ~/.cache/tokenstream."""
    explicit = os.environ.get(CACHE_VARIABLE)
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tokenstream"


def default_repository() -> Path:
    """$TOKENSTREAM_REPOSITORY if set, else the checkout's repository/ folder."""
    return Path(os.environ.get(REPOSITORY_VARIABLE) or CHECKOUT_REPOSITORY)


def admin_key_file(supervisor_port: int) -> Path:
    """Where `tokenstream serve` keeps its admin key for `tokenstream reload` (mode 0600)."""
    return cache_dir() / "run" / f"admin-key-{supervisor_port}"
