"""forward/layers.py: one torch decoder layer whatever its attention. A prefill call's
(tokens_attention), a decode step's (rows_attention) and the masked one torch.compile compiles
(masked_layer) write the same keys and values and give the same outputs; the norms are Hugging
Face's."""

from __future__ import annotations

import pytest
import torch
from families import tiny_config_model

from streaming_backend.forward.family import NO_WINDOW
from streaming_backend.forward.layers import (
    decoder_layer,
    masked_layer,
    rms_norm,
    rows_attention,
    tokens_attention,
)
from streaming_backend.forward.llama import CompactLlama
from streaming_backend.kernels.attention import Placed

PLACES, ROWS, T = (2, 1), 16, 5  # two rows at places 2 and 1 of a cache of 3 places


def cache(model: CompactLlama) -> tuple[torch.Tensor, torch.Tensor]:
    shape = model.shape
    return tuple(torch.zeros(3, shape.kv_heads, ROWS, shape.head_dim) for _ in range(2))


def grouped_mask(positions: torch.Tensor, window: int, groups: int) -> torch.Tensor:
    """[N, 1, groups * T, window]: a token attends to the positions up to its own."""
    mask = torch.arange(window)[None, None, :] <= positions[:, :, None]  # [N, T, W]
    n, t, w = mask.shape
    return mask[:, None, None].expand(n, 1, groups, t, w).reshape(n, 1, -1, w)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma2"])  # head norms; post norms, caps
def test_the_three_attentions_give_one_layer(kind):
    """T tokens of two rows through the layer with tokens_attention and with the masked one,
    then one more token each with rows_attention and the masked one: the same outputs and the
    same cache (float32, within rounding of their different sums)."""
    model = CompactLlama(tiny_config_model(kind).model, huge_pages=False)
    block, dims, (cos, sin) = model.blocks[0], model.shape.dims, model.ropes[0]
    torch.manual_seed(0)
    x = torch.randn(2, T, model.shape.hidden)
    places = torch.tensor(PLACES)
    positions = torch.arange(T).expand(2, T)
    write = places[:, None].expand(2, T)
    rope = (cos[positions][:, None], sin[positions][:, None])  # [N, 1, T, D]
    by_tokens, by_mask = cache(model), cache(model)
    placed = (Placed.of([(p, i) for p in PLACES for i in range(T)]), None)
    where = (write, positions, placed, NO_WINDOW)
    ours = decoder_layer(x, block, dims, tokens_attention, by_tokens, *rope, where, None)
    mask = grouped_mask(positions, T, model.shape.groups)
    masked = masked_layer(x, block, by_mask, *rope, mask, write, positions, places, T, dims)
    torch.testing.assert_close(ours, masked, atol=1e-5, rtol=0)
    torch.testing.assert_close(by_tokens, by_mask, atol=0, rtol=0)  # the same projections

    step = torch.randn(2, model.shape.hidden)
    at = torch.full((2,), T)
    where = (places, at, Placed.of([(p, T) for p in PLACES]), NO_WINDOW)
    rope = (cos[at][:, None], sin[at][:, None])  # [N, 1, D]
    ours = decoder_layer(step, block, dims, rows_attention, by_tokens, *rope, where, None)
    mask = grouped_mask(at[:, None], T + 1, model.shape.groups)
    rope = (cos[at][:, None, None], sin[at][:, None, None])  # [N, 1, 1, D]
    masked = masked_layer(
        step[:, None],
        block,
        by_mask,
        *rope,
        mask,
        places[:, None],
        at[:, None],
        places,
        T + 1,
        dims,
    )
    torch.testing.assert_close(ours, masked[:, 0], atol=1e-5, rtol=0)
    torch.testing.assert_close(by_tokens, by_mask, atol=1e-6, rtol=0)


def test_decoder_layer_adds_the_attention_it_is_given_then_the_mlp():
    """An attention that gives zeros leaves x plus the MLP of x: the layer adds what its
    attention returns, and its MLP reads the sum."""
    model = CompactLlama(tiny_config_model("llama").model, huge_pages=False)
    block, dims = model.blocks[1], model.shape.dims
    x = torch.randn(3, model.shape.hidden)

    def nothing(h, block, dims):
        return torch.zeros_like(h)

    def itself(h, block, dims):
        return h

    h = rms_norm(x, block.norm1, dims.eps)
    expected = decoder_layer(x + h, block, dims, nothing)
    torch.testing.assert_close(decoder_layer(x, block, dims, itself), expected, atol=0, rtol=0)
    assert not torch.equal(expected, x + h)  # the MLP added something


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_hugging_faces(dtype):
    """rms_norm gives Llama's RMS norm to the bit, in float32 and in bfloat16."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(64, eps=1e-5).to(dtype)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(4, 64).to(dtype)
    with torch.no_grad():
        assert torch.equal(rms_norm(x, norm.weight, 1e-5), norm(x))
