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
    # Test-only, for benchmark calibration: the first token exists exactly this long after its
    # prefill starts, each next token this long after the previous step (when compute is faster).
    test_first_token_delay_s: float = 0.0
    test_token_delay_s: float = 0.0

    def __post_init__(self):
        if self.max_streams < 1 or self.queue_limit < 0 or self.max_prefill_tokens < 1:
            raise ValueError(f"invalid engine limits: {self}")


# What each config.pbtxt parameter means (the CLI's help and the README's table say the same).
PARAMETER_HELP = {
    "model": "Hugging Face model directory, GGUF file or hub id; default: the bundled SmolLM2",
    "dtype": "auto (bfloat16), float32, bfloat16, float16",
    "max_streams": "streams decoded together",
    "queue_limit": "waiting requests before new ones are refused",
    "default_max_tokens": "output length cap of a request that sets no max_tokens",
    "cancel_check_ms": "how often the model asks Triton whether clients cancelled",
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
