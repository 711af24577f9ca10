"""The math of a decoder layer: norms, RoPE, the attention over a slot cache, the MLP (dense or a
mixture of experts), and a layer from them, in torch (decoder_layer) or in a few C calls
(native_layer).

decoder_layer is the one torch layer: a prefill call runs it with tokens_attention, a decode step
with rows_attention (each token attends over exactly its own positions: exact_attention), and the
step torch.compile compiles (masked_layer) with masked_attention (each row over its slot's first
`window` positions, masked). A sliding-window layer's cache may be a ring shorter than the context
(forward/slots.py): position p lives in row p mod rows, which every path here and the C kernel
address alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from streaming_backend.forward.convert import Block, Experts
from streaming_backend.forward.family import Dims
from streaming_backend.forward.quant import linear, native_linear
from streaming_backend.kernels.attention import Placed


def decoder_layer(
    x: torch.Tensor, block: Block, dims: Dims, attention: Callable[..., torch.Tensor], *where: Any
) -> torch.Tensor:
    """One decoder layer in torch, whichever its attention: x plus `attention`(x normalised,
    block, *where, dims) (normalised first where the family says), then plus the MLP of that.
    x: [N, T, hidden] (tokens_attention, masked_attention) or [N, hidden] (rows_attention)."""
    out = attention(pre_norm(x, block.norm1, dims.eps), block, *where, dims)
    return mlp(add_branch(x, out, block.attn_out_norm, dims.eps), block, dims)


def masked_layer(
    x: torch.Tensor,  # [N, T, hidden]
    block: Block,
    kv: tuple[torch.Tensor, torch.Tensor],  # this layer's K, V [slots, kv_heads, rows, D]
    cos: torch.Tensor,  # [N, 1, T, head_dim]
    sin: torch.Tensor,
    mask: torch.Tensor,  # [N, 1, groups * T, W] bool, True = attend
    write_slots: torch.Tensor,  # [N, T]: see llama.Rows
    positions: torch.Tensor,  # [N, T]: the rows of this layer's cache they are written to
    read_slots: torch.Tensor,  # [N]
    window: int,
    dims: Dims,
) -> torch.Tensor:
    """decoder_layer with masked_attention, its arguments spelled out: the unit torch.compile
    compiles once and reuses for every layer (forward/compiled.py)."""
    where = (write_slots, positions, read_slots, window)
    return decoder_layer(x, block, dims, masked_attention, kv, cos, sin, mask, where)


def mlp(x: torch.Tensor, block: Block, dims: Dims) -> torch.Tensor:
    """The second half of a decoder layer: x plus the MLP of its normalised self."""
    h = pre_norm(x, block.norm2, dims.eps)
    if block.experts is not None:
        return add_branch(x, mixture(h, block.experts, dims), block.mlp_out_norm, dims.eps)
    out = gated_mlp(h, block.gate_up, block.gate_up_bias, block.down, block.down_bias, dims)
    return add_branch(x, out, block.mlp_out_norm, dims.eps)


def gated_mlp(h, gate_up, gate_up_bias, down, down_bias, dims: Dims) -> torch.Tensor:
    """down(act(gate) * up) of h [..., hidden], gate and up from one matmul."""
    gate, up = linear(h, gate_up, gate_up_bias).chunk(2, dim=-1)
    act = F.silu(gate) if dims.activation == "silu" else F.gelu(gate, approximate="tanh")
    return linear(act * up, down, down_bias)


def mixture(h: torch.Tensor, experts: Experts, dims: Dims) -> torch.Tensor:
    """A mixture-of-experts MLP of h [..., hidden]: each token's top-k experts by the router's
    softmax (in float32), their outputs times its weights (cast to h's dtype) summed in the
    order of the experts' numbers, as Hugging Face's. A token's sum depends on it alone: its
    experts run it among whichever tokens chose them too, in kernels whose rows do not depend
    on each other (quant.linear; dense in calls of one size)."""
    flat = h.reshape(-1, h.shape[-1])
    probs = torch.softmax(linear(flat, experts.router).float(), dim=-1)
    top, chosen = torch.topk(probs, experts.top_k, dim=-1)  # [M, k]
    if experts.renormalise:
        top = top / top.sum(dim=-1, keepdim=True)
    top = top.to(h.dtype)
    out = torch.zeros_like(flat)
    for expert in chosen.unique().tolist():  # ascending
        rows, rank = torch.where(chosen == expert)
        weights = (experts.gate_up[expert], None, experts.down[expert], None)
        y = gated_mlp(flat[rows], *weights, dims) * top[rows, rank, None]
        out.index_add_(0, rows, y)
    return out.view(h.shape)


def pre_norm(x: torch.Tensor, norm: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x normalised for the attention or the MLP, or x itself (Family.pre_norms False)."""
    return x if norm is None else rms_norm(x, norm, eps)


def add_branch(x: torch.Tensor, out: torch.Tensor, norm: torch.Tensor | None, eps: float):
    """The residual stream x plus a branch's output, normalised first (Family.post_norms)."""
    return x + (out if norm is None else rms_norm(out, norm, eps))


def masked_attention(h, block: Block, kv, cos, sin, mask, where, dims: Dims) -> torch.Tensor:
    """Self-attention of one layer: write this step's K/V into the cache, then attend over each
    row's first `window` positions, masked (where: write_slots, positions, read_slots, window)."""
    n, t, _ = h.shape
    write_slots, positions, read_slots, window = where
    q = _project_and_write(h, block, kv, (cos, sin), (write_slots, positions), dims)
    keys = kv[0][read_slots, :, :window]  # [N, Hkv, W, D]
    values = kv[1][read_slots, :, :window]
    # grouped-query attention without repeating K/V: the query heads that share a key/value
    # head are stacked along the query axis -> [N, Hkv, groups * T, D]
    groups = dims.heads // dims.kv_heads
    q = q.reshape(n, dims.kv_heads, groups * t, dims.head_dim)
    out = _attend(q, keys, values, dims.scale, dims.cap, mask)
    q_size = dims.heads * dims.head_dim
    out = out.reshape(n, dims.heads, t, dims.head_dim).transpose(1, 2).reshape(n, t, q_size)
    return linear(out, block.o, block.o_bias)


def _project_and_write(h, block: Block, kv, rope, where, dims: Dims) -> torch.Tensor:
    """q/k/v of N rows of T tokens (h [N, T, hidden]), RoPE on q and k, and k, v written into
    this layer's cache at (write_slots, positions) (padding tokens: the scratch slot); returns
    q [N, H, T, D]."""
    n, t, _ = h.shape
    (k_layer, v_layer), (cos, sin), (write_slots, positions) = kv, rope, where
    q_size, kv_size = dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim
    qkv = linear(h, block.qkv, block.qkv_bias)  # [N, T, (H + 2 Hkv) D]
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = head_norms(q.view(n, t, dims.heads, -1), k.view(n, t, dims.kv_heads, -1), block, dims)
    q, k = q.transpose(1, 2), k.transpose(1, 2)  # [N, H, T, D], [N, Hkv, T, D]
    q = q * cos + _rotate_half(q) * sin
    k = (k * cos + _rotate_half(k) * sin).transpose(1, 2)  # [N, T, Hkv, D]
    k_layer[write_slots, :, positions] = k  # the indexed view is [N, T, Hkv, D]
    v_layer[write_slots, :, positions] = v.view(n, t, dims.kv_heads, dims.head_dim)
    return q


def tokens_attention(h, block: Block, kv, cos, sin, where, kernel, dims: Dims) -> torch.Tensor:
    """`masked_attention` with every token on its own (h [N, T, hidden]): each attends over exactly
    its own positions, as a decode step attends for it (`exact_attention`).

    where: (write_slots [N, T] and positions [N, T] on the device, the real tokens' Placed
    and their (row, column) index as llama.py's `_placed_tokens` gives them, this layer's
    sliding window). Writes every token's K/V first, so a token
    sees the chunk's earlier ones; padding tokens (past a row's count) get zeros.
    """
    write_slots, positions, (placed, index), window = where
    n, t, _ = h.shape
    q = _project_and_write(h, block, kv, (cos, sin), (write_slots, positions), dims)
    # [N, T, Hkv, groups, D]: a token's query heads grouped by the key/value head they share
    q = q.transpose(1, 2).reshape(n, t, dims.kv_heads, dims.heads // dims.kv_heads, -1)
    if index is None:  # no padding: every token of every row
        out = exact_attention(
            q.reshape(n * t, *q.shape[2:]), kv, placed, window, kernel, dims.scale, dims.cap
        )
        out = out.view(n, t, -1)
    else:
        out = h.new_zeros(n, t, dims.heads * dims.head_dim)
        out[index[0], index[1]] = exact_attention(
            q[index[0], index[1]], kv, placed, window, kernel, dims.scale, dims.cap
        )
    return linear(out, block.o, block.o_bias)


def exact_attention(q, kv, placed: Placed, window: int, kernel, scale=None, cap: float = 0.0):
    """Attention of n tokens, each over exactly its own positions -> [n, H * D].

    q: [n, Hkv, groups, D], each token's query heads grouped by the key/value head they share;
    kv: this layer's K, V [places, Hkv, rows, D] (position p in row p mod rows: a sliding
    window's ring); placed: each token's place and position.
    A token's numbers depend on its own query and positions alone, never on what shares the
    call: the C kernel (kernels/attention.py) computes each token on its own in a fixed order;
    without it, one torch call per token whose shapes its position alone fixes (torch's
    attention orders its sums by the call's shapes, so a call padded to a batch mate's length
    with a mask, or one of several query tokens, would round differently).
    """
    k_layer, v_layer = kv
    q = q.contiguous()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if kernel is not None:
        return kernel(q, k_layer, v_layer, placed, window, scale, cap)
    outs = []
    for token, (place, position) in enumerate(placed.rows):
        first = max(0, position + 1 - window)  # the sliding window
        keys = _positions(k_layer[place], first, position + 1)[None]  # [1, Hkv, L, D]
        values = _positions(v_layer[place], first, position + 1)[None]
        outs.append(_attend(q[token][None], keys, values, scale, cap))
    return torch.cat(outs).reshape(len(placed.rows), -1)  # [n, Hkv * groups * D]


def _positions(layer: torch.Tensor, first: int, end: int) -> torch.Tensor:
    """Positions [first, end) of one place's keys or values [Hkv, rows, D], in order: a view
    where they lie in one piece, else (a ring that wrapped) the two pieces joined."""
    rows = layer.shape[1]
    start, stop = first % rows, end % rows or rows
    if end <= rows or start < stop:
        return layer[:, start:stop]
    return torch.cat((layer[:, start:], layer[:, :stop]), dim=1)


def _attend(q, keys, values, scale: float, cap: float, mask=None) -> torch.Tensor:
    """torch's attention of q over keys and values (mask: True = attend), the scores times
    `scale`; soft-capped at `cap` (cap * tanh(score / cap)) where it is not 0, written out,
    as torch's fused attention takes no cap (as Hugging Face's eager attention does)."""
    if not cap:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    scores = torch.tanh(q @ keys.transpose(-1, -2) * scale / cap) * cap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ values


def rows_attention(h, block: Block, kv, cos, sin, where, kernel, dims: Dims) -> torch.Tensor:
    """`masked_attention` for N rows of one token each (h [N, hidden]), each row on its own.

    kv: this layer's K, V [places, kv_heads, rows, head_dim]; where: (places [N] and the
    rows [N] of the cache holding the positions, on the device, the rows' Placed, this layer's
    sliding window). Writes each row's K/V at its place and position (row position mod rows),
    then attends each row over exactly its own positions
    (`exact_attention`) and returns [N, hidden].
    """
    places, positions, placed, window = where
    n = h.shape[0]
    k_layer, v_layer = kv
    q_size, kv_size = dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim
    qkv = linear(h, block.qkv, block.qkv_bias)  # [N, (H + 2 Hkv) D]
    qk = qkv[:, : q_size + kv_size].reshape(n, dims.heads + dims.kv_heads, dims.head_dim)
    if block.q_norm is not None:
        qk = torch.cat(head_norms(qk[:, : dims.heads], qk[:, dims.heads :], block, dims), dim=1)
    qk = qk * cos + _rotate_half(qk) * sin  # q's heads, then k's
    k_new, v_new = qk[:, dims.heads :], qkv[:, q_size + kv_size :].reshape(n, dims.kv_heads, -1)
    if n == 1:  # a lone stream: a plain slice write (an indexed one costs more)
        place, position = placed.rows[0]
        row = position % k_layer.shape[2]
        k_layer[place, :, row], v_layer[place, :, row] = k_new[0], v_new[0]
    else:
        k_layer[places, :, positions], v_layer[places, :, positions] = k_new, v_new  # [N, Hkv, D]
    # the query heads sharing a key/value head stacked along the query axis (masked_attention)
    q = qk[:, : dims.heads].reshape(n, dims.kv_heads, dims.heads // dims.kv_heads, -1)
    out = exact_attention(q, kv, placed, window, kernel, dims.scale, dims.cap)
    return linear(out, block.o, block.o_bias)


def native_layer(x, block: Block, kv, where, dims: Dims, kernel, rope) -> torch.Tensor:
    """One decoder layer on n tokens (x [n, hidden] float32, contiguous) in five C calls: the q/k/v
    projection of the normalised x; RoPE, the K/V writes and each token's exact attention; x
    plus the output projection; the gate/up projection of the normalised x; x plus the down
    projection of silu(gate) * up. Each token's numbers depend on it and its positions alone
    (kernels/csrc/). where: (the tokens' Placed, this layer's sliding window); rope: cos, sin.
    Returns the layer's output, written into x."""
    placed, window = where
    qkv = native_linear(x, block.qkv, bias=block.qkv_bias, **_prologue(block.norm1, dims))
    if block.q_norm is not None:  # in place, on the float32 rows
        n, q_size = qkv.shape[0], dims.heads * dims.head_dim
        qk = qkv[:, : q_size + dims.kv_heads * dims.head_dim].view(n, -1, dims.head_dim)
        qk.copy_(torch.cat(head_norms(qk[:, : dims.heads], qk[:, dims.heads :], block, dims), 1))
    groups = dims.heads // dims.kv_heads
    out = kernel.with_rope(qkv, rope, kv[0], kv[1], placed, window, groups, dims.scale, dims.cap)
    x = _native_branch(x, out, block.o, block.o_bias, block.attn_out_norm, dims)
    if block.experts is not None:  # torch routes; the experts' matmuls are the C ones
        out = mixture(pre_norm(x, block.norm2, dims.eps), block.experts, dims)
        return x.add_(
            out if block.mlp_out_norm is None else rms_norm(out, block.mlp_out_norm, dims.eps)
        )
    h = native_linear(x, block.gate_up, bias=block.gate_up_bias, **_prologue(block.norm2, dims))
    down = (block.down, block.down_bias, block.mlp_out_norm)
    return _native_branch(x, h, *down, dims, prologue=f"{dims.activation}_mul")


def _prologue(norm: torch.Tensor | None, dims: Dims) -> dict[str, Any]:
    """native_linear's arguments for an RMS norm of its input (none without a pre-norm)."""
    return {} if norm is None else {"prologue": "rms_norm", "norm": norm, "eps": dims.eps}


def _native_branch(x, h, weight, bias, out_norm, dims: Dims, **prologue) -> torch.Tensor:
    """x plus h's projection by `weight` (after native_linear's `prologue`, if any),
    normalised first where the family says (Family.post_norms); written into x."""
    if out_norm is None:
        return native_linear(h, weight, bias=bias, add_to=x, **prologue)
    return x.add_(rms_norm(native_linear(h, weight, bias=bias, **prologue), out_norm, dims.eps))


def head_norms(q, k, block: Block, dims: Dims) -> tuple[torch.Tensor, torch.Tensor]:
    """q [..., H, D] and k [..., Hkv, D] RMS-normalised per head or over all heads, by their
    weights' size (Family.head_norms), or as they are."""
    if block.q_norm is None:
        return q, k
    return _norm_heads(q, block.q_norm, dims.eps), _norm_heads(k, block.k_norm, dims.eps)


def _norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if weight.shape[0] == x.shape[-1]:  # each head on its own
        return rms_norm(x, weight, eps)
    return rms_norm(x.flatten(-2), weight, eps).view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's RMS norm: normalise in fp32, then Llama's casts back and scales; a
    float32 weight on a narrower x (Family.float_norms) scales in fp32 and casts after."""
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype == torch.float32 and x.dtype != torch.float32:
        return (weight * y).to(x.dtype)
    return weight * y.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
