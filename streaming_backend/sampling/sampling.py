"""Sampling as small pure functions: (logits [B, V], per-row settings, uniforms [B]) -> ids [B].

Each row has its own settings and its own seeded generator. A row draws exactly one uniform
number per step from its generator, so its random choices do not depend on which other streams
share the batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from streaming_backend.sampling.settings import SamplingSettings


@dataclass(frozen=True)
class BatchSampling:
    """The sampling settings of one batch as per-row tensors; rebuilt when the batch changes."""

    temperature: torch.Tensor  # [B] float; 1.0 on greedy rows so division is harmless
    top_p: torch.Tensor  # [B] float
    top_k: torch.Tensor  # [B] long; 0 = off
    greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_greedy: bool = True  # False: no row needs the greedy ids (`sample` skips them)
    all_unit_temperature: bool = False  # every temperature 1.0: the logits need no division

    @classmethod
    def from_settings(
        cls, settings: Sequence[SamplingSettings], device: torch.device | str = "cpu"
    ) -> BatchSampling:
        """Stack per-request settings into tensors on `device`."""
        greedy = [s.greedy for s in settings]
        return cls(
            temperature=torch.tensor(
                [1.0 if g else s.temperature for s, g in zip(settings, greedy)], device=device
            ),
            top_p=torch.tensor([s.top_p for s in settings], device=device),
            top_k=torch.tensor([s.top_k for s in settings], dtype=torch.long, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all(greedy),
            any_top_k=any(s.top_k > 0 and not g for s, g in zip(settings, greedy)),
            any_top_p=any(s.top_p < 1.0 and not g for s, g in zip(settings, greedy)),
            any_greedy=any(greedy),
            all_unit_temperature=all(g or s.temperature == 1.0 for s, g in zip(settings, greedy)),
        )


def new_generator(seed: int | None) -> torch.Generator:
    """A CPU generator for one request: seeded when asked, else from fresh entropy."""
    generator = torch.Generator(device="cpu")
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def draw_uniforms(generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One uniform in [0, 1) per row, each from that row's own generator -> [B]."""
    return torch.cat([torch.rand(1, generator=g) for g in generators])


def apply_repetition_penalty(
    logits: torch.Tensor, rows: Sequence[tuple[int, float, Sequence[int]]]
) -> torch.Tensor:
    """Penalise tokens already seen (CTRL-style); rows: (row index, penalty, seen ids).

    Every row's (row, id, penalty) goes to the device in one copy, and one gather and one
    scatter penalise them all: no per-row transfer. An id seen twice is gathered twice and
    written twice with the same value.
    """
    if not rows:
        return logits
    # built with tensor operations, not a Python object per id, so a long history stays cheap
    # on the per-token path; float64 holds every token id exactly
    seen = torch.cat([torch.tensor(ids, dtype=torch.float64) for _, _, ids in rows])
    counts = torch.tensor([len(ids) for _, _, ids in rows])
    meta = torch.tensor([(row, penalty) for row, penalty, _ in rows], dtype=torch.float64)
    meta = meta.repeat_interleave(counts, dim=0)  # [M, 2]: each id's row and penalty
    packed = torch.stack([meta[:, 0], seen, meta[:, 1]]).to(logits.device)  # [3, M]: one copy
    row_ids, token_ids = packed[0].long(), packed[1].long()
    penalty = packed[2].float()  # in fp32 whatever the logits' dtype, as a Python scalar would be
    scores = logits[row_ids, token_ids].float()  # [M]
    penalised = torch.where(scores > 0, scores / penalty, scores * penalty)
    logits[row_ids, token_ids] = penalised.to(logits.dtype)
    return logits


def apply_min_p(logits: torch.Tensor, rows: Sequence[tuple[int, float, float]]) -> torch.Tensor:
    """Drop the tokens less likely than min_p times the likeliest at the row's temperature
    (vLLM's min_p); rows: (row index, min_p > 0, temperature > 0). At temperature T,
    p_i < min_p * p_max exactly when logit_i < logit_max + T * ln(min_p): no softmax needed."""
    if not rows:
        return logits
    index = torch.tensor([row for row, _, _ in rows], device=logits.device)
    floor = torch.tensor([t * math.log(p) for _, p, t in rows], device=logits.device)  # [R]
    picked = logits[index].float()
    cut = picked < picked.max(dim=-1, keepdim=True).values + floor[:, None]
    logits[index] = logits[index].masked_fill(cut, float("-inf"))
    return logits


def suppress_tokens(logits: torch.Tensor, rows: Sequence[int], token_ids: Sequence[int]):
    """Make `token_ids` impossible in `rows` (EOS before min_tokens)."""
    if rows and token_ids:
        pairs = [(row, token) for row in rows for token in token_ids]
        index = torch.tensor(pairs, dtype=torch.long).to(logits.device).T  # one copy: [2, R*E]
        logits[index[0], index[1]] = float("-inf")
    return logits


# Top-k / top-p rows usually keep a few dozen tokens: find them among the 64 (then 1024) most
# likely ones instead of sorting the whole vocabulary (a full sort of [16, 49152] costs tens of
# milliseconds on a 2-core CPU). Rows whose kept set does not fit fall back to a full sort.
CANDIDATES = (64, 1024)


def mask_top_k(sorted_probs: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Zero descending probs past the k-th of each row with k > 0; sorted_probs: [B, K]."""
    rank = torch.arange(sorted_probs.shape[-1], device=sorted_probs.device)  # [K]
    cut = (top_k[:, None] > 0) & (rank[None, :] >= top_k[:, None])  # [B, K]
    return sorted_probs.masked_fill(cut, 0.0)


def mask_top_p(sorted_probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero the tail of descending probs past the top_p mass; the first token always stays."""
    # Probability mass strictly before each position: position 0 has 0, so it is always kept.
    mass_before = sorted_probs.cumsum(-1) - sorted_probs  # [B, K]
    return sorted_probs.masked_fill(mass_before >= top_p[:, None], 0.0)


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: probs [B, V] (need not sum to 1), uniforms [B] in [0, 1) -> ids [B]."""
    cdf = probs.cumsum(-1)  # [B, V]
    target = uniforms.to(cdf.device, cdf.dtype)[:, None] * cdf[:, -1:]  # [B, 1]
    # right=True: the first index whose cdf exceeds the target has non-zero probability.
    ids = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return ids.clamp_(max=probs.shape[-1] - 1)


def _draw_truncated(sorted_probs, order, top_k, top_p, uniforms) -> torch.Tensor:
    """Apply top-k then top-p to descending probs [B, K] (order: their ids) and draw -> ids [B]."""
    kept = mask_top_p(mask_top_k(sorted_probs, top_k), top_p)
    return order.gather(-1, draw(kept, uniforms)[:, None]).squeeze(-1)


def sample(
    logits: torch.Tensor,
    params: BatchSampling,
    uniforms: torch.Tensor,
    sync_free: bool | None = None,
) -> torch.Tensor:
    """Pick one token per row: temperature, top-k, top-p, then an inverse-CDF draw.

    sync_free (default: on any device but the CPU) draws every row with tensor operations only,
    sorting whole rows instead of choosing rows by value, so the host never waits for the device
    mid-step. Both ways pick the same ids for the same uniforms.
    """
    # the first largest, as argmax, which took 3x as long on a CPU (64 against 22 us for 49152);
    # a pass over every logit, so skipped where no row is greedy (the ids are the same)
    greedy_ids = logits.max(-1).indices if params.any_greedy else None  # [B]
    if params.all_greedy:
        return greedy_ids
    uniforms = uniforms.to(logits.device)  # drawn on the CPU generators
    # x / 1.0 is x: at temperature 1 on every row the division is a pass that changes nothing
    scaled = logits.float()
    if not params.all_unit_temperature:
        scaled = scaled / params.temperature[:, None]
    probs = torch.softmax(scaled, dim=-1)  # [B, V]
    if not (params.any_top_k or params.any_top_p):
        return _greedy_where(params, greedy_ids, draw(probs, uniforms))
    if sync_free is None:
        sync_free = logits.device.type != "cpu"
    if sync_free:
        return _greedy_where(params, greedy_ids, _draw_without_syncs(probs, params, uniforms))
    ids = (
        greedy_ids.clone()
        if greedy_ids is not None
        else torch.zeros_like(uniforms, dtype=torch.long)
    )
    plain = ~params.greedy & (params.top_k == 0) & (params.top_p >= 1.0)  # no truncation
    if plain.any():
        ids[plain] = draw(probs[plain], uniforms[plain])
    rest = (~params.greedy & ~plain).nonzero().flatten()  # rows still to draw
    for k in (*CANDIDATES, probs.shape[-1]):
        if k >= probs.shape[-1]:  # the full sort: exact for every row
            sorted_probs, order = probs[rest].sort(dim=-1, descending=True)
        else:
            sorted_probs, order = probs[rest].topk(k, dim=-1)  # [R, k] descending
        top_k, top_p = params.top_k[rest], params.top_p[rest]
        # A row's kept set lies among these k if its top-k fits, or they hold its top-p mass.
        fits = ((top_k > 0) & (top_k <= k)) | ((top_p < 1.0) & (sorted_probs.sum(-1) >= top_p))
        if k >= probs.shape[-1]:
            fits = torch.ones_like(fits)
        done = fits.nonzero().flatten()
        ids[rest[done]] = _draw_truncated(
            sorted_probs[done], order[done], top_k[done], top_p[done], uniforms[rest[done]]
        )
        rest = rest[~fits]
        if not len(rest):
            break
    return _greedy_where(params, greedy_ids, ids)


def _greedy_where(params: BatchSampling, greedy_ids: torch.Tensor | None, drawn: torch.Tensor):
    """The greedy rows' ids from `greedy_ids`, the others' from `drawn` -> ids [B]."""
    return drawn if greedy_ids is None else torch.where(params.greedy, greedy_ids, drawn)


def _draw_without_syncs(probs, params: BatchSampling, uniforms: torch.Tensor) -> torch.Tensor:
    """Every row drawn as `sample` draws it, with no host-device synchronisation: rows without
    top-k or top-p from their probabilities as they are, the others after a full sort (cheap on
    a GPU, where the candidate tiers would need a sync per tier)."""
    plain = (params.top_k == 0) & (params.top_p >= 1.0)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    truncated = _draw_truncated(sorted_probs, order, params.top_k, params.top_p, uniforms)
    return torch.where(plain, draw(probs, uniforms), truncated)
