"""What decides a served model's numbers, and its fingerprint (model/numerics.py)."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from types import SimpleNamespace

import pytest
import torch
import transformers

from streaming_backend.forward.quant import INT4_GROUP
from streaming_backend.model.numerics import Numerics, describe, weights_digest

FACTS = Numerics(
    model="SmolLM2-135M-Instruct",
    weights="0123456789abcdef",
    dtype="bfloat16",
    kv_cache="bfloat16",
    quantize="int4",
    quantize_group=32,
    head="int8",
    forward="compact",
    decode="eager",
    attention="c-avx2",
    matmul="c-avx2",
    device="cpu",
    kernels="AVX512",
    threads=2,
    torch="2.13.0+cpu",
    transformers="",
)


def other_value(value):
    """A value of the same type that differs from `value`."""
    return value + 1 if isinstance(value, int) else f"{value}-other"


def test_the_fingerprint_is_short_stable_and_its_facts_are_json():
    """fp_ and 12 hex digits; equal facts built apart give the same value; the facts go to JSON
    and back as they are."""
    again = Numerics(**json.loads(json.dumps(FACTS.as_dict())))
    assert re.fullmatch(r"fp_[0-9a-f]{12}", FACTS.fingerprint)
    assert again == FACTS and again.fingerprint == FACTS.fingerprint


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(Numerics)])
def test_every_fact_changes_the_fingerprint(name):
    """Whichever fact changes (model, weights, dtype, quantization, forward, device, kernels,
    threads, versions), the fingerprint does."""
    changed = dataclasses.replace(FACTS, **{name: other_value(getattr(FACTS, name))})
    assert changed.fingerprint != FACTS.fingerprint


def steps(
    name: str,
    quantize: str = "none",
    decode_path: str = "eager",
    attention: str = "torch",
    kv_cache_dtype: str = "float32",
):
    """What describe reads of a forward's steps (no digest of their own: the loaded model's)."""
    matmul = "hf" if name == "hf" else ("dense" if quantize == "none" else "c-avx2")
    return SimpleNamespace(
        name=name,
        kv_cache_dtype=kv_cache_dtype,
        quantize=quantize,
        decode_path=decode_path,
        attention=attention,
        matmul=matmul,
        weights_digest="",
    )


def test_describe_names_the_compact_forward_with_its_weights_and_kernels(tiny_loaded):
    """The compact forward with int4 weights: the group size and the int8 head are facts, the
    kernels are torch's CPU dispatch level, transformers' version is not (it computes nothing)."""
    numerics = describe(tiny_loaded, steps("compact", "int4", kv_cache_dtype="bfloat16"))
    assert numerics.model == tiny_loaded.name and numerics.dtype == "float32"
    assert numerics.kv_cache == "bfloat16"
    assert (numerics.quantize, numerics.quantize_group, numerics.head) == (
        "int4",
        INT4_GROUP,
        "int8",
    )
    assert (numerics.forward, numerics.decode, numerics.device) == ("compact", "eager", "cpu")
    assert numerics.kernels == torch.backends.cpu.get_cpu_capability()
    assert numerics.threads == torch.get_num_threads()
    assert numerics.torch == torch.__version__ and numerics.transformers == ""
    assert numerics.weights == weights_digest(tiny_loaded)


def test_the_digest_steps_hold_is_the_one_described(tiny_loaded):
    """Steps that hold the weights' digest (a weight file's, whose loaded model is a skeleton)
    give it; the loaded model is not read."""
    holding = steps("compact", "int4")
    holding.weights_digest = FACTS.weights
    assert describe(tiny_loaded, holding).weights == FACTS.weights


def test_describe_names_transformers_on_the_hugging_face_forward(tiny_loaded):
    """On the Hugging Face forward transformers' modelling code computes: its version counts."""
    numerics = describe(tiny_loaded, steps("hf"))
    assert (numerics.quantize, numerics.quantize_group, numerics.head) == ("none", 0, "none")
    assert numerics.transformers == transformers.__version__
    assert numerics.fingerprint != describe(tiny_loaded, steps("compact")).fingerprint


def changed_model(loaded, change):
    """`loaded` with a copy of its model (and tokenizer) that `change` altered."""
    model, tokenizer = copy.deepcopy(loaded.model), copy.deepcopy(loaded.tokenizer)
    with torch.no_grad():
        change(model, tokenizer)
    return dataclasses.replace(loaded, model=model, tokenizer=tokenizer)


def _layer_moved(model, tokenizer):
    model.model.layers[1].mlp.down_proj.weight.add_(1e-3)  # a fine-tune of one layer


def _row_moved(model, tokenizer):
    model.model.embed_tokens.weight[1234].add_(1e-3)  # one token's embedding


def _config_changed(model, tokenizer):
    model.config.rms_norm_eps *= 2


def _template_changed(model, tokenizer):
    tokenizer.chat_template = "{{ messages[0]['content'] }}"


@pytest.mark.parametrize(
    "change",
    [_layer_moved, _row_moved, _config_changed, _template_changed],
    ids=lambda f: f.__name__,
)
def test_the_weights_digest_tells_models_of_one_name_apart(tiny_loaded, change):
    """Same name, same shapes: other weights, another config or another chat template give
    another digest; an unchanged copy gives the same one."""
    digest = weights_digest(tiny_loaded)
    assert weights_digest(changed_model(tiny_loaded, lambda model, tokenizer: None)) == digest
    assert weights_digest(changed_model(tiny_loaded, change)) != digest


@pytest.mark.parametrize("forward", ["compact", "hf"])
def test_a_skeleton_gives_the_fingerprint_of_the_model_with_its_weights(
    tiny_model_dir, tiny_loaded, tmp_path, monkeypatch, forward
):
    """A served model loads as a skeleton (its compact weights mapped from the weight cache, or
    its Hugging Face weights loaded by the steps): the same facts and fingerprint as the model
    loaded with its weights, on either forward."""
    from streaming_backend.configuration.models import EngineConfig
    from streaming_backend.model.loading import load_model
    from streaming_backend.steps.build import build_steps

    monkeypatch.setenv("TOKENSTREAM_CACHE", str(tmp_path))
    skeleton = load_model(str(tiny_model_dir), dtype="float32", device="cpu", weights=False)
    config = EngineConfig(forward=forward, quantize="int4")
    facts = [describe(m, build_steps(m, config, print)) for m in (skeleton, tiny_loaded)]
    assert not skeleton.has_weights and facts[0] == facts[1]
    assert facts[0].weights == weights_digest(tiny_loaded)
