"""The chat model's settings, defined once: the engine's limits and the config.pbtxt `parameters`.

The dataclass defaults here are the source of every default: the model reads its `parameters`
through `ModelSettings.from_parameters`, `repository/chat/config.pbtxt` spells the same values
(a test checks), and `tokenstream serve` takes its option defaults and help from here.
Standard library only, so the launcher reads it without importing torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineConfig:
    """Engine limits and defaults."""

    max_streams: int = 32  # live streams stepped together
    queue_limit: int = 256  # submitted requests waiting for a slot; beyond it: Overloaded
    max_prefill_tokens: int = 4096  # prompt tokens admitted for prefill in one engine step
    # Admitted prompts are prefilled in groups of similar length: a group is cut where left
    # padding would exceed this fraction of its real tokens (padding is wasted compute).
    max_padding: float = 0.25
    default_max_tokens: int = 512  # when a request names no max_tokens (bounded by the context)
    # auto: the compact forward for the Llama family (llama, mistral, qwen2), else Hugging Face's;
    # compact: that forward or an error; hf: always Hugging Face's (the baseline, any model).
    forward: str = "auto"
    # Reuse KV across requests (compact forward). on: of earlier prompts and answers; prompts: of
    # prompts only, whose KV prefill computed, so greedy outputs equal a run without the cache
    # (an answer's KV comes from decode steps, whose bf16 rounding differs a little); off.
    prefix_cache: str = "on"
    # Prompt tokens prefilled per engine step while other streams decode (compact forward): a new
    # prompt delays running streams by about one chunk per step. Measured in docs/performance.md.
    prefill_chunk_tokens: int = 64
    # The compact forward's KV cache: a fraction of the device's free memory at start (the CPU's
    # MemAvailable) such as "0.5", or a size such as "4GiB" or "512MiB". Its slots hold the live
    # streams and the prefix cache; admission waits for a slot, so a step never runs out of it.
    kv_cache_memory: str = "0.5"
    compile: bool = False  # torch.compile the compact decode step (see docs/performance.md)
    # Test-only, for benchmark calibration: the first token exists exactly this long after its
    # prefill starts, each next token this long after the previous step (when compute is faster).
    test_first_token_delay_s: float = 0.0
    test_token_delay_s: float = 0.0

    def __post_init__(self):
        if self.max_streams < 1 or self.queue_limit < 0 or self.max_prefill_tokens < 1:
            raise ValueError(f"invalid engine limits: {self}")
        if self.forward not in FORWARDS:
            raise ValueError(f"forward must be one of {', '.join(FORWARDS)}, not {self.forward!r}")
        if self.prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be >= 1, not {self.prefill_chunk_tokens}")
        parse_memory(self.kv_cache_memory)
        if self.prefix_cache not in PREFIX_CACHE_MODES:
            modes = ", ".join(PREFIX_CACHE_MODES)
            raise ValueError(f"prefix_cache must be one of {modes}, not {self.prefix_cache!r}")


FORWARDS = ("auto", "compact", "hf")
PREFIX_CACHE_MODES = ("on", "prompts", "off")
MEMORY_UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def parse_memory(text: str) -> tuple[int | None, float | None]:
    """(bytes, None) for "4GiB" / "512MiB" / "1000000", (None, fraction) for "0.5"."""
    value = text.strip()
    try:
        for unit, scale in MEMORY_UNITS.items():
            if value.endswith(unit):
                size = int(float(value[: -len(unit)]) * scale)
                break
        else:
            number = float(value)
            if 0 < number <= 1:
                return None, number
            size = int(number) if number == int(number) else -1
    except ValueError:
        size = -1
    if size <= 0:
        raise ValueError(
            f"KV cache memory must be a fraction in (0, 1] such as 0.5 or a size such as 4GiB, "
            f"not {text!r}"
        )
    return size, None


# What each config.pbtxt parameter means (the CLI's help and the README's table say the same).
PARAMETER_HELP = {
    "model": "Hugging Face model directory, GGUF file or hub id; default: the bundled SmolLM2",
    "dtype": "auto (bfloat16), float32, bfloat16, float16",
    "max_streams": "streams decoded together",
    "queue_limit": "waiting requests before new ones are refused",
    "default_max_tokens": "output length cap of a request that sets no max_tokens",
    "cancel_check_ms": "how often the model asks Triton whether clients cancelled",
    "forward": "auto (compact for Llama-family models, else hf), compact, or hf (Hugging Face)",
    "prefix_cache": "reuse KV across requests: on (prompts and answers), prompts, off",
    "prefill_chunk_tokens": "prompt tokens prefilled per step while other streams decode",
    "kv_cache_memory": "KV cache size: a fraction of free memory (0.5) or a size (4GiB)",
    "compile": "on: torch.compile the compact decode step (warmed up at load); off",
    "test_first_token_delay_ms": "test only: delay of the first token after prefill starts",
    "test_token_delay_ms": "test only: least spacing of the following tokens",
}


@dataclass(frozen=True)
class ModelSettings:
    """The chat model's config.pbtxt `parameters`, typed; the defaults are the model's defaults."""

    model: str | None = None  # None: the bundled default chat model
    dtype: str = "auto"
    engine: EngineConfig = field(default_factory=EngineConfig)
    cancel_check_s: float = 0.04

    @classmethod
    def from_config(cls, config: Mapping) -> ModelSettings:
        """Read the string parameters of a model config (the JSON Triton gives initialize)."""
        parameters = config.get("parameters", {})
        return cls.from_parameters({k: v["string_value"] for k, v in parameters.items()})

    @classmethod
    def from_parameters(cls, params: Mapping[str, str]) -> ModelSettings:
        """Settings from string parameters: a missing key keeps its default, others are ignored."""
        text = default_parameters() | dict(params)
        return cls(
            model=text["model"] or None,
            dtype=text["dtype"],
            engine=EngineConfig(
                max_streams=int(text["max_streams"]),
                queue_limit=int(text["queue_limit"]),
                default_max_tokens=int(text["default_max_tokens"]),
                forward=text["forward"],
                prefix_cache=text["prefix_cache"],
                prefill_chunk_tokens=int(text["prefill_chunk_tokens"]),
                kv_cache_memory=text["kv_cache_memory"],
                compile=_switch("compile", text["compile"]),
                test_first_token_delay_s=float(text["test_first_token_delay_ms"]) / 1e3,
                test_token_delay_s=float(text["test_token_delay_ms"]) / 1e3,
            ),
            cancel_check_s=float(text["cancel_check_ms"]) / 1e3,
        )

    def parameters(self) -> dict[str, str]:
        """These settings as config.pbtxt string parameters (the inverse of from_parameters)."""
        engine = self.engine
        return {
            "model": self.model or "",
            "dtype": self.dtype,
            "max_streams": str(engine.max_streams),
            "queue_limit": str(engine.queue_limit),
            "default_max_tokens": str(engine.default_max_tokens),
            "forward": engine.forward,
            "prefix_cache": engine.prefix_cache,
            "prefill_chunk_tokens": str(engine.prefill_chunk_tokens),
            "kv_cache_memory": engine.kv_cache_memory,
            "compile": "on" if engine.compile else "off",
            "cancel_check_ms": _milliseconds(self.cancel_check_s),
            "test_first_token_delay_ms": _milliseconds(engine.test_first_token_delay_s),
            "test_token_delay_ms": _milliseconds(engine.test_token_delay_s),
        }


def default_parameters() -> dict[str, str]:
    """The default value of every config.pbtxt parameter, as config.pbtxt spells it."""
    return ModelSettings().parameters()


def _milliseconds(seconds: float) -> str:
    """Seconds as a millisecond string: 0.04 -> "40"."""
    return f"{seconds * 1e3:g}"


def _switch(key: str, text: str) -> bool:
    """An on/off parameter."""
    value = text.strip().lower()
    if value in ("on", "true", "1", "yes"):
        return True
    if value in ("off", "false", "0", "no"):
        return False
    raise ValueError(f"{key} must be on or off, not {text!r}")
