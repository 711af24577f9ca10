"""The compact forward's weights (CompactWeights: a Block per layer, the head, the RoPE tables),
derived once from a Hugging Face model's modules: compact_weights.

The weights are the Hugging Face model's own tensors (q/k/v and gate/up fused into one matmul
each; the model's parameters are re-pointed at views of the fused tensors, so the weights are held
once; Granite's output projections are scaled copies), quantized as asked (forward/quant.py). A
Stream says how each module is read and each derived part handed on: in memory, or a layer at a
time into a weight file (model/weight_cache.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from streaming_backend.forward.family import (
    FAMILIES,
    Family,
    LlamaShape,
    UnsupportedModel,
    model_shape,
)
from streaming_backend.forward.quant import (
    HEAD_KIND,
    NATIVE_WEIGHTS,
    Weight,
    check_kind,
    quantize_weight,
)


class Experts(NamedTuple):
    """A mixture-of-experts MLP: each token's top `top_k` experts by the router, their outputs
    weighted by the router's probabilities (renormalised over the top k where `renormalise`)."""

    router: torch.Tensor  # [experts, hidden], as loaded
    gate_up: tuple[Weight, ...]  # per expert: [2 * intermediate, hidden]
    down: tuple[Weight, ...]  # per expert: [hidden, intermediate]
    top_k: int
    renormalise: bool

    def quantized(self, kind: str, matmul: str = "auto") -> Experts:
        """These experts with their weights quantized as `kind` (the router stays as loaded)."""
        return self._replace(
            gate_up=tuple(quantize_weight(w, kind, matmul) for w in self.gate_up),
            down=tuple(quantize_weight(w, kind, matmul) for w in self.down),
        )


class Block(NamedTuple):
    """One decoder layer's weights (q/k/v and gate/up fused); biases are None when absent."""

    norm1: torch.Tensor | None  # [hidden]: before attention (None: Family.pre_norms is False)
    qkv: Weight  # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None
    o: Weight  # [hidden, heads * head_dim]
    o_bias: torch.Tensor | None
    norm2: torch.Tensor | None  # [hidden]: before the MLP
    gate_up: Weight | None  # [2 * intermediate, hidden]; None: the MLP is `experts`
    gate_up_bias: torch.Tensor | None
    down: Weight | None  # [hidden, intermediate]
    down_bias: torch.Tensor | None
    q_norm: torch.Tensor | None = None  # [head_dim] or [heads * head_dim]: Family.head_norms
    k_norm: torch.Tensor | None = None  # [head_dim] or [kv_heads * head_dim]
    attn_out_norm: torch.Tensor | None = None  # [hidden]: Family.post_norms
    mlp_out_norm: torch.Tensor | None = None
    experts: Experts | None = None  # a mixture-of-experts MLP instead of gate_up and down

    def quantized(self, kind: str, matmul: str = "auto") -> Block:
        """This block with its linear weights quantized as `kind` (forward/quant.py)."""
        weights = {
            name: quantize_weight(w, kind, matmul)
            for name in LINEAR_WEIGHTS
            if (w := getattr(self, name)) is not None
        }
        experts = self.experts and self.experts.quantized(kind, matmul)
        return self._replace(**weights, experts=experts)

    def weights(self) -> list[Weight]:
        """Every linear weight of this block (the experts' included)."""
        ours = [w for name in LINEAR_WEIGHTS if (w := getattr(self, name)) is not None]
        if self.experts is not None:
            ours += [*self.experts.gate_up, *self.experts.down]
        return ours


LINEAR_WEIGHTS = ("qkv", "o", "gate_up", "down")  # the Block fields a quantization replaces


def _fuse(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight [sum(out), in] (and bias) for several linears; theirs become views of it."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    has_bias = [lin.bias is not None for lin in linears]
    if any(has_bias) and not all(has_bias):
        raise UnsupportedModel("a fused projection mixes biased and unbiased linears")
    bias = torch.cat([lin.bias.detach() for lin in linears]) if all(has_bias) else None
    start = 0
    for lin in linears:  # hold the weights once: the Hugging Face modules read the same memory
        end = start + lin.weight.shape[0]
        lin.weight.data = weight[start:end]
        if bias is not None:
            lin.bias.data = bias[start:end]
        start = end
    return weight, bias


def _param(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()


class NativeParams(NamedTuple):
    """What the C layers read beside the linear weights, in float32 (their activations' dtype):
    each block's norms, biases and router (the linear weights are the blocks'), the final norm
    and RoPE's tables."""

    blocks: list[Block]
    final_norm: torch.Tensor  # [hidden]
    ropes: list[tuple[torch.Tensor, torch.Tensor]]  # as CompactWeights.ropes


class CompactWeights(NamedTuple):
    """Everything the compact forward reads of a model, derived once from its Hugging Face
    modules (`compact_weights`): what a weight file holds (model/weight_cache.py)."""

    shape: LlamaShape
    quantize: str  # the linear weights' format (forward/quant.py)
    embed: torch.Tensor  # [V, hidden]
    head: Weight  # [V, hidden]; tied models share embed's tensor (unless quantized)
    final_norm: torch.Tensor  # [hidden]
    blocks: list[Block]
    embed_scale: float  # the looked-up rows' scale (Gemma's, Granite's multiplier)
    logit_cap: float | None  # the final logits' soft cap (Family.logit_cap)
    layer_ropes: tuple[int, ...]  # per layer: its table in `ropes`
    # RoPE's (cos, sin) tables [max_positions, head_dim] that some layer applies, in the model's
    # dtype (only those: the torch paths index each one every call)
    ropes: list[tuple[torch.Tensor, torch.Tensor]]
    native: NativeParams | None  # where every linear weight runs on our C kernels


class Stream(Protocol):
    """How compact_weights reads a model and hands on what it derives: InMemory's (the weights
    where they are, the derived ones as they are), or a conversion's (model/weight_cache.py)."""

    def loaded(self, *modules: Any) -> AbstractContextManager[None]:
        """The modules' weights in memory inside the block (perhaps read in), perhaps released
        after: compact_weights derives all it needs of them inside."""

    def keep(self, tree: Any) -> Any:
        """A derived part, whole (a tree of tensors, forward/weight_file.py's kind): what
        compact_weights puts in its CompactWeights for it, the part itself or what stands for
        it where it was written out."""


class InMemory:
    """The Stream of a model held in memory: the derived weights kept as they are."""

    def loaded(self, *modules: Any) -> AbstractContextManager[None]:
        return nullcontext()

    def keep(self, tree: Any) -> Any:
        return tree


def compact_weights(
    model: Any, quantize: str = "none", matmul: str = "auto", stream: Stream | None = None
) -> CompactWeights:
    """The compact forward's weights of a loaded Hugging Face model (UnsupportedModel if its
    family is not one of FAMILIES): q/k/v and gate/up fused (the model's parameters re-pointed
    at the fused tensors), the linear weights quantized as `quantize`, the RoPE tables.
    `stream` (InMemory's when None): how each module's weights are read and each derived part
    handed on. A conversion's reads a decoder layer's weights in just before its block is
    derived and writes the block out as soon as it is whole, then drops both, so that one
    layer's float and derived tensors live at a time."""
    shape = model_shape(model)
    check_kind(quantize)
    stream = stream or InMemory()
    inner = model.model
    family, config = FAMILIES[model.config.model_type], model.config
    with stream.loaded(inner.embed_tokens, model.lm_head, inner.norm):
        embed = inner.embed_tokens.weight.detach()  # [V, hidden]
        dtype = embed.dtype
        head = quantize_weight(model.lm_head.weight.detach(), HEAD_KIND[quantize], matmul)
        final_norm = _norm_weight(inner.norm, family)
        # the looked-up rows' scale: Gemma's embedding module holds one (rounded to the dtype)
        scale = getattr(inner.embed_tokens, "embed_scale", None)
        embed_scale = 1.0 if scale is None else float(scale.to(dtype))
        if family.multipliers:
            # folded into the weights: the residual branches' output projections (copies) and
            # the final norm, so that every path, the C layers' included, runs them unchanged
            embed_scale = float(config.embedding_multiplier)
            final_norm = final_norm / config.logits_scaling
        # the C layers run it where every linear weight is theirs (told layer by layer; a
        # layer that is not leaves the float32 parameters of those before unused)
        native = isinstance(head, NATIVE_WEIGHTS) and shape.head_dim % 2 == 0
        # the C layers' float32 parameters (their activations are float32 whatever the dtype)
        float_norm = final_norm.float() if native else None
        embed, head, final_norm, float_norm = stream.keep((embed, head, final_norm, float_norm))
    blocks, float_blocks = [], []
    for layer in inner.layers:
        with stream.loaded(layer):
            block = _block(layer, family)
            if family.multipliers:
                block = _scaled_outputs(block, config.residual_multiplier)
            if shape.rotary_dim not in (None, shape.head_dim):
                block = _turned_first(block, shape)
            block = block.quantized(quantize, matmul)
            native = native and all(isinstance(w, NATIVE_WEIGHTS) for w in block.weights())
            block, floats = stream.keep((block, _float_params(block) if native else None))
        blocks.append(block)
        float_blocks.append(floats)
    # RoPE's tables, and which one each layer applies (Family.rope_layers)
    layer_ropes = _layer_ropes(config, family, inner.rotary_emb)
    used = sorted(set(layer_ropes))
    ropes = _used_ropes(inner.rotary_emb, shape, used, dtype)
    float_ropes = _used_ropes(inner.rotary_emb, shape, used, torch.float32) if native else None
    ropes, float_ropes = stream.keep((ropes, float_ropes))
    return CompactWeights(
        shape=shape,
        quantize=quantize,
        embed=embed,
        head=head,
        final_norm=final_norm,
        blocks=blocks,
        embed_scale=embed_scale,
        logit_cap=config.final_logit_softcapping if family.logit_cap else None,
        layer_ropes=tuple(used.index(i) for i in layer_ropes),
        ropes=ropes,
        native=NativeParams(float_blocks, float_norm, float_ropes) if native else None,
    )


def _block(layer: Any, family: Family) -> Block:
    """A Hugging Face decoder layer's weights, q/k/v and gate/up fused."""
    attn, mlp = layer.self_attn, layer.mlp
    modules = _norm_modules(layer, family)
    if family.head_norms:
        modules |= {"q_norm": attn.q_norm, "k_norm": attn.k_norm}
    norms = {name: _norm_weight(module, family) for name, module in modules.items()}
    if family.fused:
        qkv, qkv_bias = attn.qkv_proj.weight.detach(), _param(attn.qkv_proj.bias)
    else:
        qkv, qkv_bias = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
    return Block(
        qkv=qkv,
        qkv_bias=qkv_bias,
        o=attn.o_proj.weight.detach(),
        o_bias=_param(attn.o_proj.bias),
        **{"norm1": None, "norm2": None} | norms | _mlp_weights(mlp, family),
    )


def _mlp_weights(mlp: Any, family: Family) -> dict[str, Any]:
    """A layer's MLP as Block fields: gate/up fused and down, or its experts (a sparse layer
    of a mixture-of-experts family: the experts' weights stacked [experts, out, in])."""
    if hasattr(mlp, "experts"):
        if not family.experts:
            raise UnsupportedModel("a mixture-of-experts layer in a family not declared so")
        stacked = mlp.experts
        experts = Experts(
            router=mlp.gate.weight.detach(),
            gate_up=tuple(stacked.gate_up_proj.detach().unbind(0)),
            down=tuple(stacked.down_proj.detach().unbind(0)),
            top_k=mlp.gate.top_k,
            renormalise=bool(mlp.gate.norm_topk_prob),
        )
        return {
            "gate_up": None,
            "gate_up_bias": None,
            "down": None,
            "down_bias": None,
            "experts": experts,
        }
    if family.fused:
        gate_up, gate_up_bias = mlp.gate_up_proj.weight.detach(), _param(mlp.gate_up_proj.bias)
    else:
        gate_up, gate_up_bias = _fuse([mlp.gate_proj, mlp.up_proj])
    return {
        "gate_up": gate_up,
        "gate_up_bias": gate_up_bias,
        "down": mlp.down_proj.weight.detach(),
        "down_bias": _param(mlp.down_proj.bias),
    }


def _norm_modules(layer: Any, family: Family) -> dict[str, Any]:
    """A layer's norms by Block field (Hugging Face names them by place, per family)."""
    if not family.post_norms:  # Llama: before the attention and before the MLP
        return {"norm1": layer.input_layernorm, "norm2": layer.post_attention_layernorm}
    # on the attention's and the MLP's outputs (OLMo 2), and before them too (Gemma)
    norms = {
        "attn_out_norm": layer.post_attention_layernorm,
        "mlp_out_norm": layer.post_feedforward_layernorm,
    }
    if family.pre_norms:
        norms |= {"norm1": layer.input_layernorm, "norm2": layer.pre_feedforward_layernorm}
    return norms


def _norm_weight(module: Any, family: Family) -> torch.Tensor:
    """A norm's weight as rms_norm applies it (Family.float_norms: held in float32, the
    family's offset added there)."""
    weight = module.weight.detach()
    return weight.float() + family.norm_offset if family.float_norms else weight


def _scaled_outputs(block: Block, by: float) -> Block:
    """A block whose attention and MLP outputs are `by` times its own (Family.multipliers)."""
    if by == 1.0:
        return block
    scaled = {
        name: None if (t := getattr(block, name)) is None else t * by
        for name in ("o", "o_bias", "down", "down_bias")
    }
    return block._replace(**scaled)


def all_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a value of nested tuples and lists (NamedTuples: blocks, weights)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from all_tensors(item)


def _float_params(block: Block) -> Block:
    """A block with its norms, biases and router as float32 (the native layers' activations)."""
    floats = {
        name: None if value is None else value.float()
        for name, value in block._asdict().items()
        if name not in (*LINEAR_WEIGHTS, "experts")
    }
    if block.experts is not None:
        floats["experts"] = block.experts._replace(router=block.experts.router.float())
    return block._replace(**floats)


def _used_ropes(
    rotary: Any, shape: LlamaShape, used: list[int], dtype: torch.dtype
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The RoPE tables of `used` (indices into _rope_tables), in `dtype`."""
    tables = _rope_tables(rotary, shape, dtype)
    return [tables[i] for i in used]


def _layer_ropes(config: Any, family: Family, rotary: Any) -> tuple[int, ...]:
    """Which of `_rope_tables` each layer applies: Gemma 3's by its layer type, SmolLM3's
    layers without RoPE (its config's no_rope_layers: 0) the last, which turns nothing."""
    kinds = getattr(rotary, "layer_types", None)
    if family.rope_layers:
        return tuple(0 if uses else 1 for uses in config.no_rope_layers)
    if kinds is None:
        return (0,) * config.num_hidden_layers
    return tuple(kinds.index(kind) for kind in config.layer_types)


def _rope_tables(rotary: Any, shape: LlamaShape, dtype: torch.dtype):
    """RoPE's (cos, sin) tables [max_positions, head_dim], computed as Hugging Face does (fp32,
    then cast): the model's one, or one per layer type (the rotary module's layer_types), then
    one that turns nothing (cos 1, sin 0: q * 1 + r * 0 is q)."""
    kinds = getattr(rotary, "layer_types", None)
    if kinds is None:
        ropes = [(rotary.inv_freq, rotary.attention_scaling)]
    else:
        ropes = [
            (getattr(rotary, f"{k}_inv_freq"), getattr(rotary, f"{k}_attention_scaling"))
            for k in kinds
        ]
    positions = torch.arange(shape.max_positions, device=ropes[0][0].device).float()
    tables = []
    for inv_freq, scale in ropes:
        freqs = positions[:, None] * inv_freq.float()[None, :]  # [positions, rotary_dim / 2]
        # values RoPE does not turn (`_turned_first` put them after the turned ones): cos 1, sin 0
        rest = torch.zeros(len(positions), shape.head_dim // 2 - freqs.shape[1])
        cos = torch.cat((freqs.cos() * scale, rest + 1), dim=-1)
        sin = torch.cat((freqs.sin() * scale, rest), dim=-1)
        tables.append((torch.cat((cos, cos), -1).to(dtype), torch.cat((sin, sin), -1).to(dtype)))
    still = (torch.ones_like(tables[0][0]), torch.zeros_like(tables[0][1]))
    return [*tables, still]


def _turned_first(block: Block, shape: LlamaShape) -> Block:
    """A block whose queries and keys hold each head's values reordered so that RoPE on part of
    the head (rotary_dim of head_dim, as Hugging Face turns value i with i + rotary_dim / 2)
    becomes RoPE on the whole head (value j with j + head_dim / 2), the values it does not turn
    paired among themselves and left alone (cos 1, sin 0 in `_rope_tables`). Queries and keys
    reordered alike give the same scores (their dot products sum the same products, in another
    order); the values are untouched. The q/k/v weight (and bias, q/k norms) are copies."""
    d, r = shape.head_dim, shape.rotary_dim
    half, rest = r // 2, (d - r) // 2
    order = torch.cat(
        [
            torch.arange(half),
            torch.arange(r, r + rest),
            torch.arange(half, r),
            torch.arange(r + rest, d),
        ]
    )
    q_and_k = shape.heads + shape.kv_heads
    rows = torch.cat([head * d + order for head in range(q_and_k)])
    rows = torch.cat([rows, torch.arange(q_and_k * d, block.qkv.shape[0])])  # v as it is
    turned = {"qkv": block.qkv[rows]}
    if block.qkv_bias is not None:
        turned["qkv_bias"] = block.qkv_bias[rows]
    for name in ("q_norm", "k_norm"):
        if (norm := getattr(block, name)) is not None:
            turned[name] = (
                norm[order] if norm.shape[0] == d else norm.view(-1, d)[:, order].flatten()
            )
    return block._replace(**turned)
