"""What decides a served model's numbers, and one short value naming it (`system_fingerprint`).

    numerics = describe(loaded, steps)          # on the engine thread, once the forward is built
    numerics.fingerprint                        # "fp_3f9a0c1d2e4b": OpenAI's system_fingerprint
    numerics.as_dict()                          # the facts themselves, for /status

The fingerprint is "fp_" and 12 hex digits of a sha256 over the facts' canonical JSON, so it
changes exactly when one of them does: the model (its name, and a digest of its config, tokenizer
and weights), the dtype, the linear weights' format, the forward, how it decodes and attends, the
device and the kernels torch runs there, torch's CPU threads and the libraries' versions. Same
request, same seed, same fingerprint: the same tokens (docs/openai.md says on which forward).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from streaming_backend.forward.quant import HEAD_KIND, INT4_GROUP
from streaming_backend.kernels.matmul import MatmulKernel
from streaming_backend.model.loading import LoadedModel
from streaming_backend.steps import Steps

FINGERPRINT_PREFIX = "fp_"  # as OpenAI's own system fingerprints start
FINGERPRINT_DIGITS = 12
# Values of each weight tensor in the weights digest, spread evenly over it: a fine-tune moves
# every value of a tensor it trains, so a sample tells two checkpoints apart without reading
# gigabytes. The input embedding is read whole (a few new token rows change only those rows).
SAMPLE_VALUES = 4096
EMBEDDING_ROWS_PER_COPY = 4096  # rows of the embedding hashed per host copy (a GPU's memory)


@dataclass(frozen=True)
class Numerics:
    """The facts that decide a served model's numbers; JSON as they are (as_dict)."""

    model: str  # the served model's name
    weights: str  # weights_digest: its config, tokenizer and weights
    dtype: str  # what it computes in: float32, bfloat16, float16
    kv_cache: str  # what its KV cache keeps keys and values in (forward/runner.py cache_dtype)
    quantize: str  # the linear weights' format on the forward: none, int8, int4 (forward/quant.py)
    quantize_group: int  # inputs per int4 scale and zero (quant.INT4_GROUP); 0 without int4
    head: str  # the output head's format (quant.HEAD_KIND)
    forward: str  # compact or hf (steps/build.py)
    decode: str  # how a decode step runs: eager, compiled (torch.compile) or cuda_graphs
    attention: str  # the compact forward's exact attention: c-avx512, c-avx2, c-generic (C kernel
    # as built, kernels/build.py) or torch (one call per token); hf on the Hugging Face forward
    matmul: str  # what runs the linear weights: c-avx512, c-avx2, c-generic (our C kernels, which
    # quantize the activations too), aten (torch's weight-only kernels), dense ("+" joins); or hf
    device: str  # cpu or cuda
    kernels: str  # CPU: the kernel family torch dispatches (AVX512, AVX2, ...); GPU: its model
    threads: int  # torch's CPU threads at load (torch's attention: differed on 1 and 2); GPU: 0
    torch: str  # torch's version (its kernels)
    transformers: str  # its version where its modelling code computes (forward hf), else ""
    # how our C matmuls sum a value (MatmulKernel.SUMS) where they run ("c-" in matmul)
    matmul_sums: str = ""

    def as_dict(self) -> dict[str, Any]:
        """The facts by name."""
        return dataclasses.asdict(self)

    @property
    def fingerprint(self) -> str:
        """fp_ and 12 hex digits of a sha256 over the facts' canonical JSON."""
        canonical = json.dumps(self.as_dict(), sort_keys=True, separators=(",", ":"))
        digest = hashlib.sha256(canonical.encode()).hexdigest()
        return FINGERPRINT_PREFIX + digest[:FINGERPRINT_DIGITS]


def describe(loaded: LoadedModel, steps: Steps) -> Numerics:
    """The numerics of a loaded model on the forward its steps run (reads every weight's sample
    and the whole embedding once, unless the steps hold the digest: call it at load, on the
    engine thread)."""
    import transformers

    on_gpu = loaded.device.type == "cuda"
    return Numerics(
        model=loaded.name,
        weights=steps.weights_digest or weights_digest(loaded),
        dtype=str(loaded.dtype).removeprefix("torch."),
        kv_cache=steps.kv_cache_dtype,
        quantize=steps.quantize,
        quantize_group=INT4_GROUP if steps.quantize == "int4" else 0,
        head=HEAD_KIND[steps.quantize],
        forward=steps.name,
        decode=steps.decode_path,
        attention=steps.attention,
        matmul=steps.matmul,
        device=loaded.device.type,
        kernels=device_kernels(loaded.device),
        threads=0 if on_gpu else torch.get_num_threads(),
        torch=torch.__version__,
        transformers=transformers.__version__ if steps.name == "hf" else "",
        matmul_sums=MatmulKernel.SUMS if "c-" in steps.matmul else "",
    )


def device_kernels(device: torch.device) -> str:
    """The kernels torch runs on `device`: a GPU's name and compute capability, or the CPU kernel
    family it dispatches (AVX512, AVX2, ...; lowered by ATEN_CPU_CAPABILITY)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} sm_{major}{minor}"
    return torch.backends.cpu.get_cpu_capability()


def weights_digest(loaded: LoadedModel) -> str:
    """16 hex digits of a sha256 over the model's config, its tokenizer (vocabulary, merges,
    chat template), its whole input embedding and an even sample of every weight tensor."""
    model = loaded.model
    embedding = model.get_input_embeddings().weight.detach()  # [V, hidden]
    tensors = ((name, t.detach()) for name, t in model.state_dict().items())
    return digest_weights(model.config, loaded.tokenizer, embedding, tensors)


def digest_weights(
    config: Any, tokenizer: Any, embedding: torch.Tensor, tensors: Iterable[tuple[str, Any]]
) -> str:
    """weights_digest of a model given as its parts: `tensors` its state dict's (name, tensor)
    in order, which may be read one at a time (model/checkpoint.py's)."""
    digest = hashlib.sha256()
    digest.update(_config_json(config).encode())
    digest.update(_tokenizer_text(tokenizer).encode())
    for rows in embedding.split(EMBEDDING_ROWS_PER_COPY):
        digest.update(_bytes(rows))
    for name, tensor in tensors:
        flat = tensor.reshape(-1)
        step = max(1, flat.numel() // SAMPLE_VALUES)
        digest.update(f"{name} {tuple(tensor.shape)} {tensor.dtype}".encode())
        digest.update(_bytes(flat[::step][:SAMPLE_VALUES]))
    return digest.hexdigest()[:16]


def _config_json(config: Any) -> str:
    """The model config as canonical JSON, less what names where and by what it was loaded."""
    values = {
        key: value
        for key, value in config.to_dict().items()
        if not key.startswith("_") and key != "transformers_version"
    }
    return json.dumps(values, sort_keys=True, default=str)


def _tokenizer_text(tokenizer: Any) -> str:
    """What decides how a tokenizer splits text and renders a chat, as text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast tokenizer: all of it
    vocabulary = backend.to_str() if backend is not None else sorted(tokenizer.get_vocab().items())
    return json.dumps([vocabulary, getattr(tokenizer, "chat_template", None)], default=str)


def _bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's raw bytes on the host (any dtype, bfloat16 included)."""
    return tensor.contiguous().cpu().view(torch.uint8).numpy().tobytes()
