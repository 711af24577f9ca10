"""A compact forward pass for the Llama family over a per-slot KV cache.

Supported (FAMILIES, docs/configuration.md#model-families): Llama and the families that differ
from it in ways declared as data (`Family`), read by the one forward: q/k/v biases, sliding
windows, norms on the queries and keys, norms after the attention and the MLP, multipliers,
layers without RoPE, weights stored fused. Anything else raises UnsupportedModel and the caller
keeps the Hugging Face forward. The weights are the Hugging Face model's own tensors (q/k/v and
gate/up fused into one matmul each; the model's parameters are re-pointed at views of the fused
tensors, so the weights are held once; Granite's output projections are scaled copies).

One `forward` serves prefill and decode: N rows of T tokens each (decode is T = 1). Each row's
new keys and values are written into the cache at their positions first, then every row attends
over its slot's first `window` positions with a mask, so a slot's earlier positions (an earlier
chunk, a reused prefix) are simply part of what it attends to. A sliding-window layer's cache
may be a ring shorter than the context (forward/slots.py): position p lives in row p mod rows,
which every path here and the C kernel address alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from streaming_backend.forward import native
from streaming_backend.forward.huge_pages import place as place_in_huge_pages
from streaming_backend.forward.native import AttentionKernel, Placed
from streaming_backend.forward.quant import (
    HEAD_KIND,
    NATIVE_WEIGHTS,
    Weight,
    check_kind,
    kernel_name,
    linear,
    native_linear,
    quantize_weight,
)
from streaming_backend.model.loading import rope_context


class Family(NamedTuple):
    """What a model family's decoder layer does beyond Llama's."""

    # an RMS norm on the queries and keys before RoPE: over each head (Qwen3; weights of
    # head_dim) or over all heads at once (OLMo 2; weights of heads * head_dim)
    head_norms: bool = False
    pre_norms: bool = True  # the attention and the MLP take the normalised residual stream
    # their outputs are normalised before they join the residual stream (OLMo 2)
    post_norms: bool = False
    # norms scale in float32, then cast to the model's dtype (Llama casts, then scales): their
    # weights are held in float32, which tells rms_norm
    float_norms: bool = False
    # the config's embedding_multiplier, residual_multiplier (of the attention and MLP outputs
    # added to the residual stream), attention_multiplier (the scores' scale, for 1/sqrt(D))
    # and logits_scaling (the logits divided by it)
    multipliers: bool = False
    rope_layers: bool = False  # some layers without RoPE: the config's no_rope_layers (SmolLM3)
    fused: bool = False  # q/k/v and gate/up stored fused (qkv_proj, gate_up_proj: Phi-3)
    norm_offset: float = 0.0  # norms scale by offset + weight (Gemma: 1 + weight)
    experts: bool = False  # sparse layers: a mixture of experts with top-k routing (Experts)
    # the final logits soft-capped: cap * tanh(logits / cap), by final_logit_softcapping (Gemma)
    logit_cap: bool = False


FAMILIES = {  # Hugging Face model_type -> its differences
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(),
    "qwen3": Family(head_norms=True),
    "granite": Family(multipliers=True),
    "olmo2": Family(head_norms=True, pre_norms=False, post_norms=True, float_norms=True),
    "smollm3": Family(rope_layers=True),
    "phi3": Family(fused=True),
    "qwen3_moe": Family(head_norms=True, experts=True),
    "olmoe": Family(head_norms=True, experts=True),  # its q/k norms over all heads, as OLMo 2's
    # RoPE tables per layer type, the embedding scale, GELU and the scores' scale follow from
    # the config and the modules (model_shape, CompactLlama)
    "gemma2": Family(post_norms=True, float_norms=True, norm_offset=1.0, logit_cap=True),
    "gemma3_text": Family(
        head_norms=True, post_norms=True, float_norms=True, norm_offset=1.0, logit_cap=True
    ),
}
SUPPORTED_TYPES = tuple(FAMILIES)
# RoPE variants whose inverse frequencies are fixed at load (no position-dependent rescaling);
# LongRoPE (Phi-3/4) is too within its original context (loading.rope_context bounds the model's).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
NO_WINDOW = 1 << 62  # "sliding window" of a full-attention layer
# K or V of every layer, one tensor each [slots + 1, kv_heads, rows, head_dim] (forward/slots.py)
LayerCache = Sequence[torch.Tensor]
# Hugging Face's activation name -> ours (Dims.activation; native.MatmulKernel's `{ours}_mul`)
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


class Rows(NamedTuple):
    """One forward call's inputs: N rows of T tokens (decode: T = 1), all on the model's device."""

    tokens: torch.Tensor  # [N, T] long
    positions: torch.Tensor  # [N, T] long: each token's position in its slot (padding: 0)
    write_slots: torch.Tensor  # [N, T] long: the slot its K/V is written to (padding: scratch)
    read_slots: torch.Tensor  # [N] long: the slot each row attends over
    last: torch.Tensor  # [N] long: index in T of the token whose logits are returned


class Span(NamedTuple):
    """Where one row of a prefill call lives: its tokens go to `place` in the cache, at
    positions start, start + 1, ... start + count - 1 (host ints)."""

    place: int
    start: int
    count: int


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


class Dims(NamedTuple):
    """The sizes one layer needs (plain ints: a compiled layer specialises on them)."""

    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    scale: float  # of the attention scores: 1/sqrt(head_dim) unless the family sets it
    activation: str = "silu"  # of the MLP's gate: a key of ACTIVATIONS
    cap: float = 0.0  # the scores soft-capped at it, cap * tanh(score / cap) (Gemma 2); 0: not


class UnsupportedModel(ValueError):
    """The model is not one this forward implements; use the Hugging Face forward."""


@dataclass(frozen=True)
class LlamaShape:
    """The sizes the forward and the slot cache need."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_positions: int
    eps: float
    windows: tuple[int, ...]  # per layer: sliding window length, NO_WINDOW for full attention
    scale: float | None = None  # of the attention scores; None: 1/sqrt(head_dim)
    activation: str = "silu"
    cap: float = 0.0  # of the attention scores (Dims.cap)
    rotary_dim: int | None = None  # values of each head RoPE turns; None: all

    @property
    def groups(self) -> int:
        """Query heads per key/value head."""
        return self.heads // self.kv_heads

    @property
    def dims(self) -> Dims:
        """What `decoder_layer` needs to know."""
        scale = self.head_dim**-0.5 if self.scale is None else self.scale
        return Dims(
            self.heads, self.kv_heads, self.head_dim, self.eps, scale, self.activation, self.cap
        )


def model_shape(model: Any) -> LlamaShape:
    """Read a Hugging Face model's sizes, or raise UnsupportedModel saying why."""
    config = model.config
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED_TYPES:
        raise UnsupportedModel(
            f"the compact forward supports {', '.join(SUPPORTED_TYPES)}, not {kind!r}"
        )
    hooked = [name for name, m in model.named_modules() if m._forward_hooks or m._forward_pre_hooks]
    if hooked:
        raise UnsupportedModel(f"forward hooks on {hooked[:3]} would be skipped")
    if getattr(config, "clip_qkv", None) is not None:
        raise UnsupportedModel(f"queries, keys and values clipped at {config.clip_qkv} (clip_qkv)")
    activation = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)
    if activation not in ACTIVATIONS:
        raise UnsupportedModel(f"activation {activation!r} is not one of {', '.join(ACTIVATIONS)}")
    rope = getattr(config, "rope_parameters", None) or {}
    # one RoPE for every layer, or one per layer type (Gemma 3: {layer type: its parameters})
    for params in rope.values() if all(isinstance(v, dict) for v in rope.values()) else [rope]:
        rope_type = params.get("rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            raise UnsupportedModel(f"RoPE type {rope_type!r} is not supported")
    max_positions = rope_context(config) or config.max_position_embeddings
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    # RoPE on the first part of each head only (Phi-4-mini): `_turned_first` reorders it
    rotary_dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    if rotary_dim % 2 or (head_dim - rotary_dim) % 2:
        raise UnsupportedModel(f"RoPE on {rotary_dim} of each head's {head_dim} values")
    scale = config.attention_multiplier if FAMILIES[kind].multipliers else None
    if getattr(config, "query_pre_attn_scalar", None):  # Gemma: the scores' scale
        scale = config.query_pre_attn_scalar**-0.5
    return LlamaShape(
        layers=config.num_hidden_layers,
        hidden=config.hidden_size,
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        vocab=config.vocab_size,
        max_positions=max_positions,
        eps=config.rms_norm_eps,
        windows=_layer_windows(config),
        scale=scale,
        activation=ACTIVATIONS[activation],
        rotary_dim=rotary_dim,
        cap=float(getattr(config, "attn_logit_softcapping", None) or 0.0),
    )


def _layer_windows(config: Any) -> tuple[int, ...]:
    """Sliding window per layer as the Hugging Face masks apply it (None -> full attention)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if config.model_type == "mistral" or layer_types is None:
        return (window or NO_WINDOW,) * config.num_hidden_layers
    return tuple(
        (window or NO_WINDOW) if kind == "sliding_attention" else NO_WINDOW for kind in layer_types
    )


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


class CompactLlama(nn.Module):
    """The forward pass of a loaded Llama-family model, reading and writing a slot KV cache.

    `quantize` ("none", "int8", "int4"): the linear weights quantized for our C kernels (or,
    without a C compiler, torch's CPU weight-only kernels), the head in int8 (forward/quant.py);
    the embedding and norms stay as loaded. With `huge_pages`, what a step reads is moved into
    transparent huge pages on the CPU (forward/huge_pages.py). `from_weights` builds it on
    weights derived already (a weight file's, mapped: model/weight_cache.py).
    Every call, a lone stream's step, a batch of them or a prefill chunk, runs on these same
    weights through the same kernels, whose rows do not depend on each other: a row's logits
    are the same whatever shares its call (docs/performance.md, "One model whatever the load").
    """

    # numerics.weights_digest of the model the weights came from, where the builder knows it
    # (model/weight_cache.py); "" where it does not
    weights_digest = ""

    def __init__(
        self, model: Any, quantize: str = "none", matmul: str = "auto", huge_pages: bool = True
    ):
        super().__init__()
        weights = compact_weights(model, quantize, matmul)
        # the loaded model's parameters view the same memory (tied or unquantized weights)
        self._take(weights, huge_pages, along=model.parameters())

    @classmethod
    def from_weights(cls, weights: CompactWeights, huge_pages: bool = False) -> CompactLlama:
        """The forward on weights derived already (compact_weights), where they lie: a weight
        file's mapped pages stay shared unless `huge_pages` copies them."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._take(weights, huge_pages, along=())
        return self

    def _take(self, weights: CompactWeights, huge_pages: bool, along: Iterable[torch.Tensor]):
        """Run on `weights`: pick the kernels, place them, build the C stack."""
        self.weights = weights
        self.shape, self.quantize = weights.shape, weights.quantize
        self.embed, self.head, self.final_norm = weights.embed, weights.head, weights.final_norm
        self.blocks = weights.blocks
        self.embed_scale, self.logit_cap = weights.embed_scale, weights.logit_cap
        self.layer_ropes, self.ropes = weights.layer_ropes, weights.ropes
        # exact attention: the C kernel on the CPU for the dtypes it takes, else torch per token
        on_cpu = self.embed.device.type == "cpu" and self.embed.dtype in native.DTYPES
        self.kernel: AttentionKernel | None = native.attention_kernel() if on_cpu else None
        self.attention = f"c-{self.kernel.variant}" if self.kernel else "torch"
        # what runs the linear weights: c-avx2 / c-generic, aten, dense ("+" joins several)
        linear_weights = [self.head, *(w for b in self.blocks for w in b.weights())]
        self.matmul = "+".join(sorted({kernel_name(w) for w in linear_weights}))
        # every layer in a few C calls (native_layer), decode and prefill alike: our matmuls
        # for every weight and the attention kernel
        self.native = weights.native is not None and self.kernel is not None
        self.windowed = any(w != NO_WINDOW for w in self.shape.windows)
        if self.native:
            self.native_blocks, self.native_final_norm, self.native_ropes = weights.native
        # what a step reads, in huge pages (before the stack takes their addresses), with the
        # tensors of `along` that view the same memory
        step_weights = (self.embed, self.head, self.final_norm, self.blocks)
        native_weights = (self.native_final_norm, self.native_blocks) if self.native else ()
        self.huge_page_bytes = (
            place_in_huge_pages(_tensors(step_weights + native_weights), along=along)
            if huge_pages
            else 0
        )
        # every layer in one C call where none needs torch between its calls (native.DecoderStack)
        self.native_stack = self._decoder_stack() if self.native else None

    def tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor of its weights (CompactWeights)."""
        return _tensors(self.weights)

    def forward(
        self,
        k_cache: LayerCache,
        v_cache: LayerCache,
        rows: Rows,
        window: int,
        layer: Callable[..., torch.Tensor] | None = None,
        spans: Sequence[Span] | None = None,
    ) -> torch.Tensor:
        """Run N rows of T tokens; return the logits [N, V] (fp32) of each row's `last` token.

        k_cache, v_cache: per layer [slots, kv_heads, rows, head_dim] (a ring's rows: fewer than
        the positions), written in place at (write_slots, positions). With `spans` (prefill),
        each row's tokens attend one by one over exactly their own positions, as a decode
        step's (`tokens_attention`). Without (a compiled decode step of fixed shapes), `window`
        >= the largest position + 1: each row attends over positions [0, window) of its slot
        (a ring: over its rows), masked to those <= its own (and in its sliding window),
        through `layer`, a compiled copy of `decoder_layer`.
        """
        x = self.hidden(k_cache, v_cache, rows, window, layer, spans)  # [N, T, hidden]
        n = rows.tokens.shape[0]
        x = x[torch.arange(n, device=x.device), rows.last]  # [N, hidden]
        return self.normed_logits(x)  # [N, V]

    def score(
        self, k_cache: LayerCache, v_cache: LayerCache, rows: Rows, spans: Sequence[Span]
    ) -> torch.Tensor:
        """`forward`, but the logits [N, T, V] (fp32) of every token (`rows.last` unused):
        teacher-forced quality checks."""
        x = self.hidden(k_cache, v_cache, rows, 0, spans=spans)  # [N, T, hidden]
        return self.normed_logits(x.reshape(-1, x.shape[-1])).view(*x.shape[:2], -1)

    def hidden(
        self,
        k_cache: LayerCache,
        v_cache: LayerCache,
        rows: Rows,
        window: int,
        layer: Callable[..., torch.Tensor] | None = None,
        spans: Sequence[Span] | None = None,
    ) -> torch.Tensor:
        """The last decoder layer's output [N, T, hidden] for every token (see `forward`)."""
        if spans is not None and self.native:
            return self._native_hidden(k_cache, v_cache, rows.tokens, spans)
        x = self._embed(rows.tokens)  # [N, T, hidden]
        ropes = self._rope_at(rows.positions)  # [N, 1, T, head_dim] each
        dims, windows = self.shape.dims, self.shape.windows
        at = self._cache_rows(rows.positions, k_cache)  # per layer: where positions are written
        if spans is not None:
            placed = _placed_tokens(spans, x.shape[1])
            for index, block in enumerate(self.blocks):
                kv = (k_cache[index], v_cache[index])
                where = (rows.write_slots, at[index], placed, windows[index])
                h, (cos, sin) = pre_norm(x, block.norm1, dims.eps), ropes[self.layer_ropes[index]]
                out = tokens_attention(h, block, kv, cos, sin, where, dims, self.kernel)
                x = mlp(add_branch(x, out, block.attn_out_norm, dims.eps), block, dims)
            return x
        layer = layer or decoder_layer
        masks = self._masks(rows.positions, window, k_cache)
        for index, block in enumerate(self.blocks):
            mask = masks[windows[index], k_cache[index].shape[-2]]
            cos, sin = ropes[self.layer_ropes[index]]
            kv = (k_cache[index], v_cache[index])
            x = layer(
                x,
                block,
                kv,
                cos,
                sin,
                mask,
                rows.write_slots,
                at[index],
                rows.read_slots,
                window,
                dims,
            )
        return x

    def _cache_rows(self, positions: torch.Tensor, k_cache: LayerCache) -> list[torch.Tensor]:
        """Per layer, the rows of its cache that hold `positions`: the positions themselves
        under full attention, modulo its rows in a sliding-window layer's ring."""
        if not self.windowed:
            return [positions] * len(k_cache)
        wrapped: dict[int, torch.Tensor] = {}
        at = []
        for window, k in zip(self.shape.windows, k_cache):
            rows = k.shape[-2]
            if window != NO_WINDOW and rows not in wrapped:
                wrapped[rows] = positions % rows
            at.append(positions if window == NO_WINDOW else wrapped[rows])
        return at

    def _masks(self, positions: torch.Tensor, window: int, k_cache: LayerCache) -> dict:
        """The attention masks [N, 1, groups * T, keys] of a call over each slot's first
        `window` rows, by (layer window, layer rows): True where a row holds one of the token's
        positions in its window (a ring: the row's latest position is (p - row) mod rows back)."""
        key_pos = torch.arange(window, device=positions.device)
        distance = positions[:, :, None] - key_pos[None, None, :]  # [N, T, W]
        masks = {}
        for w, k in zip(self.shape.windows, k_cache):
            rows = k.shape[-2]
            if (w, rows) in masks:
                continue
            if w == NO_WINDOW:
                masks[w, rows] = self._grouped((distance >= 0) & (distance < w))
                continue
            back = distance[:, :, :rows] % rows  # [N, T, min(W, rows)]: positions back
            masks[w, rows] = self._grouped((back <= positions[:, :, None]) & (back < w))
        return masks

    def decode(
        self,
        k_cache: LayerCache,
        v_cache: LayerCache,
        index: torch.Tensor,
        rows: Sequence[tuple[int, int]],
    ) -> torch.Tensor:
        """One new token for each of N slots -> logits [N, V] (fp32).

        index: [2, N] long on the model's device, the tokens and their positions; rows: each
        row's (place in the cache, position) on the host. The arithmetic of `forward` for N
        rows of one token, in fewer operations: the matmuls, norms and RoPE run on the N rows
        at once (no row of theirs depends on another) and each row attends over exactly its
        own positions (`exact_attention`), never over positions padded to a batch mate's length
        with a mask. So a row's logits are the same alone or among any others, and the same as
        a prefill of the same token would give.
        """
        tokens, positions = index
        dims = self.shape.dims
        x = self._embed(tokens)  # [N, hidden]
        if self.native:
            x = self._native_layers(x.float(), k_cache, v_cache, Placed.of(list(rows)))
            return self.normed_logits(x)
        ropes = self._rope_at(positions)  # [N, 1, D] each
        # the rows' places, for one indexed write of several rows' K/V (a lone row: a slice)
        placed = Placed.of(list(rows))
        places = placed.places.to(tokens.device) if len(rows) > 1 else None
        at = self._cache_rows(positions, k_cache)
        for number, block in enumerate(self.blocks):
            kv = (k_cache[number], v_cache[number])
            where = (places, at[number], placed, self.shape.windows[number])
            h, (cos, sin) = pre_norm(x, block.norm1, dims.eps), ropes[self.layer_ropes[number]]
            out = rows_attention(h, block, kv, cos, sin, where, dims, self.kernel)
            x = mlp(add_branch(x, out, block.attn_out_norm, dims.eps), block, dims)
        x = rms_norm(x, self.final_norm, self.shape.eps)
        return self.logits(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The head: normalised hidden states [..., hidden] -> fp32 logits [..., V]."""
        return self._capped(linear(x, self.head).float())

    def normed_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm and the head: hidden states [N, hidden] -> fp32 logits [N, V] (native:
        one call, the norm as the head's prologue)."""
        if self.native:
            norm = {"prologue": "rms_norm", "norm": self.native_final_norm, "eps": self.shape.eps}
            return self._capped(native_linear(x.float().contiguous(), self.head, **norm))
        return self.logits(rms_norm(x, self.final_norm, self.shape.eps))

    def _capped(self, logits: torch.Tensor) -> torch.Tensor:
        """fp32 logits soft-capped where the family does (Family.logit_cap), else as they are."""
        if self.logit_cap is None:
            return logits
        return torch.tanh(logits / self.logit_cap) * self.logit_cap

    def _decoder_stack(self) -> native.DecoderStack | None:
        """The native layers as one C call, where every one is plain: pre-norms, no head or
        post norms, no experts; else None (native_layer's calls from Python)."""
        plain = all(
            b.norm1 is not None and b.norm2 is not None and b.gate_up is not None
            and b.q_norm is None and b.attn_out_norm is None and b.mlp_out_norm is None
            and b.experts is None
            for b in self.native_blocks
        )  # fmt: skip
        if not plain:
            return None
        layers = [
            native.StackSpec(
                block.norm1,
                block.norm2,
                *[(getattr(block, n), getattr(block, f"{n}_bias")) for n in LINEAR_WEIGHTS],
                self.native_ropes[self.layer_ropes[number]],
                self.shape.windows[number],
            )
            for number, block in enumerate(self.native_blocks)
        ]
        return native.decoder_stack(layers, self.shape.hidden, self.shape.dims)

    def _native_layers(self, x, k_cache, v_cache, placed: Placed) -> torch.Tensor:
        """Every decoder layer on n tokens (x [n, hidden] float32, contiguous; placed: where
        each attends) through native_layer, or the stack of them in one call -> the last
        layer's output [n, hidden] float32."""
        if self.native_stack is not None:
            return self.native_stack(x, k_cache, v_cache, placed)
        windows, dims = self.shape.windows, self.shape.dims
        for number, block in enumerate(self.native_blocks):
            kv = (k_cache[number], v_cache[number])
            rope = self.native_ropes[self.layer_ropes[number]]
            x = native_layer(x, block, kv, (placed, windows[number]), dims, self.kernel, rope)
        return x

    def _native_hidden(self, k_cache, v_cache, tokens, spans) -> torch.Tensor:
        """`hidden` of a prefill call on the native layers: its real tokens, row by row, as one
        list (padding is skipped, its places left zero) -> [N, T, hidden]."""
        n, t = tokens.shape
        placed, index = _placed_tokens(spans, t)
        if index is None:
            x = self._embed(tokens.reshape(-1)).float()
            return self._native_layers(x, k_cache, v_cache, placed).view(n, t, -1)
        x = self._embed(tokens[index[0], index[1]]).float()
        out = x.new_zeros(n, t, x.shape[-1])
        out[index[0], index[1]] = self._native_layers(x, k_cache, v_cache, placed)
        return out

    def _rope_at(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each RoPE table's cos and sin at `positions` [...] -> [..., 1, ..., head_dim]: a
        head axis after the first."""
        return [(cos[positions][:, None], sin[positions][:, None]) for cos, sin in self.ropes]

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings (times the family's embedding multiplier)."""
        x = F.embedding(tokens, self.embed)
        return x if self.embed_scale == 1.0 else x * self.embed_scale

    def _grouped(self, mask: torch.Tensor) -> torch.Tensor:
        """[N, T, W] -> [N, 1, groups * T, W]: one mask row per (query head of a group, token)."""
        n, t, w = mask.shape
        return mask[:, None, None].expand(n, 1, self.shape.groups, t, w).reshape(n, 1, -1, w)


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


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a value of nested tuples and lists (NamedTuples: blocks, weights)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)


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


def decoder_layer(
    x: torch.Tensor,  # [N, T, hidden]
    block: Block,
    kv: tuple[torch.Tensor, torch.Tensor],  # this layer's K, V [slots, kv_heads, rows, D]
    cos: torch.Tensor,  # [N, 1, T, head_dim]
    sin: torch.Tensor,
    mask: torch.Tensor,  # [N, 1, groups * T, W] bool, True = attend
    write_slots: torch.Tensor,  # [N, T]: see Rows
    positions: torch.Tensor,  # [N, T]: the rows of this layer's cache they are written to
    read_slots: torch.Tensor,  # [N]
    window: int,
    dims: Dims,
) -> torch.Tensor:
    """One decoder layer (the unit torch.compile compiles once and reuses for every layer)."""
    h = pre_norm(x, block.norm1, dims.eps)
    where = (write_slots, positions, read_slots, window)
    out = attention(h, block, kv, cos, sin, mask, where, dims)
    return mlp(add_branch(x, out, block.attn_out_norm, dims.eps), block, dims)


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


def attention(h, block: Block, kv, cos, sin, mask, where, dims: Dims) -> torch.Tensor:
    """Self-attention of one layer: write this step's K/V into the cache, then attend over it."""
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


def tokens_attention(h, block: Block, kv, cos, sin, where, dims: Dims, kernel) -> torch.Tensor:
    """`attention` with every token on its own (h [N, T, hidden]): each attends over exactly
    its own positions, as a decode step attends for it (`exact_attention`).

    where: (write_slots [N, T] and positions [N, T] on the device, the real tokens'
    `_placed_tokens`, this layer's sliding window). Writes every token's K/V first, so a token
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


def _placed_tokens(spans: Sequence[Span], t: int) -> tuple[Placed, torch.Tensor | None]:
    """Where the real tokens of a prefill call's rows (T tokens each) attend, row by row, and
    their (row, column) index [2, n] in the call; None when no row is padded."""
    rows = [(place, start + i) for place, start, count in spans for i in range(count)]
    if all(count == t for _, _, count in spans):
        return Placed.of(rows), None
    index = [(row, i) for row, span in enumerate(spans) for i in range(span.count)]
    return Placed.of(rows), torch.tensor(index, dtype=torch.long).T


def exact_attention(q, kv, placed: Placed, window: int, kernel, scale=None, cap: float = 0.0):
    """Attention of n tokens, each over exactly its own positions -> [n, H * D].

    q: [n, Hkv, groups, D], each token's query heads grouped by the key/value head they share;
    kv: this layer's K, V [places, Hkv, rows, D] (position p in row p mod rows: a sliding
    window's ring); placed: each token's place and position.
    A token's numbers depend on its own query and positions alone, never on what shares the
    call: the C kernel (forward/native.py) computes each token on its own in a fixed order;
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


def rows_attention(h, block: Block, kv, cos, sin, where, dims: Dims, kernel) -> torch.Tensor:
    """`attention` for N rows of one token each (h [N, hidden]), each row on its own.

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
    # the query heads sharing a key/value head stacked along the query axis, as in `attention`
    q = qk[:, : dims.heads].reshape(n, dims.kv_heads, dims.heads // dims.kv_heads, -1)
    out = exact_attention(q, kv, placed, window, kernel, dims.scale, dims.cap)
    return linear(out, block.o, block.o_bias)


def native_layer(x, block: Block, kv, where, dims: Dims, kernel, rope) -> torch.Tensor:
    """One decoder layer on n tokens (x [n, hidden] float32, contiguous) in five C calls: the q/k/v
    projection of the normalised x; RoPE, the K/V writes and each token's exact attention; x
    plus the output projection; the gate/up projection of the normalised x; x plus the down
    projection of silu(gate) * up. Each token's numbers depend on it and its positions alone
    (forward/csrc/). where: (the tokens' Placed, this layer's sliding window); rope: cos, sin.
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
