"""Log-probabilities of chosen tokens and their most likely alternatives, independent of how the
token was drawn: (logits [B, V], chosen ids [B], k) -> tensors, for one host transfer per step.

The logits given are the ones the sampler starts from: after the repetition penalty, EOS
suppression (min_tokens) and grammar masks, before temperature, top-k and top-p. With none of
those set they are the model's own log-softmax.
"""

from __future__ import annotations

import torch


def chosen_and_top(
    logits: torch.Tensor, chosen: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob of each chosen id [B], the top k logprobs [B, k] descending, their ids [B, k])."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [B, V]
    picked = logprobs.gather(-1, chosen[:, None]).squeeze(-1)  # [B]
    if k <= 0:
        empty = logprobs.new_zeros((logprobs.shape[0], 0))
        return picked, empty, empty.long()
    values, ids = logprobs.topk(k, dim=-1)  # [B, k], sorted descending
    return picked, values, ids


def host_columns(picked: torch.Tensor, values: torch.Tensor, ids: torch.Tensor) -> list:
    """The [B] columns to stack into a step's one host transfer: picked, then k values, k ids."""
    return [picked, *values.T, *ids.T]


def rows_from_host(host: list[list[float]], start: int, k: int) -> list[tuple]:
    """Undo host_columns on the transferred rows: per batch row (picked, ((id, logprob), ...))."""
    picked = host[start]
    values, ids = host[start + 1 : start + 1 + k], host[start + 1 + k : start + 1 + 2 * k]
    return [
        (picked[row], tuple((int(ids[j][row]), values[j][row]) for j in range(k)))
        for row in range(len(picked))
    ]
