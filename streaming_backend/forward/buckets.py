"""The few shapes a decode step is run with: attended windows and batch sizes, as powers of two."""

from __future__ import annotations

MIN_WINDOW = 64  # smallest attended window


def window_for(length: int, max_len: int) -> int:
    """Positions attended by a step whose longest slot holds `length`: a power of two, capped."""
    window = MIN_WINDOW
    while window < length:
        window *= 2
    return min(window, max_len)


def window_buckets(max_len: int) -> list[int]:
    """Every window `window_for` can return for this cache."""
    windows, window = [], MIN_WINDOW
    while window < max_len:
        windows.append(window)
        window *= 2
    return [*windows, max_len]


def batch_for(batch: int, buckets: list[int]) -> int:
    """The smallest bucket that holds `batch` rows."""
    return next(size for size in buckets if size >= batch)


def batch_buckets(slots: int) -> list[int]:
    """Batch sizes a graphed step is captured for: powers of two below `slots`, and `slots`."""
    sizes, size = [], 1
    while size < slots:
        sizes.append(size)
        size *= 2
    return [*sizes, slots]
