"""The models' settings, defined once: a parameter table per model and the typed settings it fills.

`CHAT_PARAMETERS` and `DIALOGUE_PARAMETERS` describe each config.pbtxt `parameters` entry once
(key, default, help, parser). Everything else comes from them or is checked against them: the
dataclass defaults below, `ModelSettings` / `DialogueSettings` read by the models' `initialize`,
the `parameters` blocks of repository/*/config.pbtxt (a test), `tokenstream serve`'s options and
help, and the tables of docs/configuration.md (a test). Standard library only, so the launcher
reads it without importing torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace

from streaming_backend.configuration.parameters import (
    MILLISECONDS,
    OPTIONAL_TEXT,
    SWITCH,
    Kind,
    Parameter,
    ParameterTable,
    choice,
    integer,
    integer_or_auto,
)
from streaming_backend.model.hardware import AUTO, DTYPE_NAMES, dtype_name
from streaming_backend.wire import CHAT_MODEL, DIALOGUE_MODEL

FORWARDS = ("auto", "compact", "hf")
PREFIX_CACHE_MODES = ("on", "prompts", "off")
QUANTIZE_KINDS = ("none", "int8", "int4")  # the compact forward's weight formats (forward/quant.py)
# speculative decoding (steps/drafts.py MODES, which a test keeps equal)
SPECULATIVE_MODES = ("auto", "off", "ngram", "draft")
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


def _memory(text: str) -> str:
    parse_memory(text)
    return text.strip()


MEMORY = Kind(_memory, str, "SIZE")

# Shared by both models: `tokenstream serve --model/--dtype/--quantize/--forward` set them on each.
MODEL = Parameter(
    "model",
    "",
    "Hugging Face model directory, GGUF file or hub id; default: the bundled SmolLM2",
    OPTIONAL_TEXT,
    option=True,
)


def _dtype(text: str) -> str:
    dtype_name(text.strip())  # ValueError naming the choices
    return text.strip()


DTYPE = Parameter(
    "dtype",
    "auto",
    "auto (bfloat16 where the GPU or CPU computes it natively, else float32), float32, "
    "bfloat16, float16",
    Kind(_dtype, str, "{" + ",".join((AUTO, *DTYPE_NAMES)) + "}"),
    option=True,
)
QUANTIZE = Parameter(
    "quantize",
    "auto",
    "the compact forward's linear weights: auto (int4 on a CPU with native bfloat16 when the "
    "model is in bfloat16, and on an x86 CPU with AVX2 without it when the model is in float32 "
    "or bfloat16; else none), none, int8 or int4 "
    "(weight-only, CPU kernels; every call runs them, so a row's numbers do not depend on "
    "its batch)",
    choice(AUTO, *QUANTIZE_KINDS),
    option=True,
)
FORWARD = Parameter(
    "forward",
    "auto",
    "auto (compact for the families it runs, else hf), compact, or hf (Hugging Face)",
    choice(*FORWARDS),
    option=True,
)

# The steps' settings: the chat model's engine, and the dialogue model's rows on the same steps
PREFIX_CACHE = Parameter(
    "prefix_cache",
    "on",
    "reuse KV across requests: on (prompts and answers), prompts, off",
    choice(*PREFIX_CACHE_MODES),
    option=True,
)
PREFILL_CHUNK_TOKENS = Parameter(
    "prefill_chunk_tokens",
    "auto",
    "prompt tokens prefilled per step while other streams decode; auto: as many as "
    "one decode step's time, measured",
    integer_or_auto(1),
    option=True,
)
KV_CACHE_MEMORY = Parameter(
    "kv_cache_memory",
    "0.5",
    "KV cache size: a fraction of free memory (0.5) or a size (4GiB), a draft model's included",
    MEMORY,
    option=True,
)
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")
KV_CACHE_DTYPE = Parameter(
    "kv_cache_dtype",
    "auto",
    "the compact forward's KV cache: auto (bfloat16 where a float32 model runs on our CPU "
    "kernels, with int8 or int4 weights: half the bytes a step reads; else the model's "
    "dtype), float32 or bfloat16 (another than the model's only on those kernels)",
    choice(*KV_CACHE_DTYPES),
    option=True,
)
# The dialogue model's own default, a quarter, so that both models' caches together stay within
# three quarters of the memory free at start; `tokenstream serve --kv-cache-memory` sets both.
DIALOGUE_KV_CACHE_MEMORY = Parameter(
    "kv_cache_memory",
    "0.25",
    "KV cache size: a fraction of free memory (0.25), shared by the instances, or a size "
    "(4GiB), each instance's",
    MEMORY,
    option=True,
)

# Speculative decoding, on the chat model's streams and the dialogue model's rows alike
# (`tokenstream serve --speculative/--draft-model` set them on each)
SPECULATIVE = Parameter(
    "speculative",
    "auto",
    "speculative decoding: ngram (drafts from the prompt and the answer so far, "
    "verified as rows of the running batch: the same tokens, greedy or seeded), draft "
    "(drafts from draft_model, verified the same way), off, or auto (what measured "
    "faster here: docs/configuration.md)",
    choice(*SPECULATIVE_MODES),
    option=True,
)
DRAFT_MODEL = Parameter(
    "draft_model",
    "",
    "speculative=draft's draft model: a smaller model with the same tokenizer (Hugging "
    "Face model directory or GGUF file), run on the compact forward",
    OPTIONAL_TEXT,
    option=True,
)

CHAT_PARAMETERS = ParameterTable(
    CHAT_MODEL,
    (
        MODEL,
        DTYPE,
        QUANTIZE,
        Parameter("max_streams", "32", "streams decoded together", integer(1), option=True),
        Parameter(
            "queue_limit",
            "256",
            "waiting requests before new ones are refused",
            integer(0),
            option=True,
        ),
        Parameter(
            "default_max_tokens",
            "512",
            "output length cap of a request that sets no max_tokens",
            integer(1),
        ),
        Parameter(
            "cancel_check_ms",
            "40",
            "how often the model asks Triton whether clients cancelled",
            MILLISECONDS,
            field="cancel_check_s",
        ),
        FORWARD,
        PREFIX_CACHE,
        PREFILL_CHUNK_TOKENS,
        KV_CACHE_MEMORY,
        KV_CACHE_DTYPE,
        SPECULATIVE,
        DRAFT_MODEL,
        Parameter(
            "compile",
            "off",
            "on: torch.compile the compact decode step (warmed up at load); off",
            SWITCH,
            option=True,
        ),
        Parameter(
            "adaptive_threads",
            "on",
            "on a CPU, run decode steps on fewer torch threads while fewer measure faster "
            "(another process holds a core); off: always torch's thread count",
            SWITCH,
            option=True,
        ),
        Parameter(
            "test_first_token_delay_ms",
            "0",
            "test only: delay of the first token after prefill starts",
            MILLISECONDS,
            field="test_first_token_delay_s",
        ),
        Parameter(
            "test_token_delay_ms",
            "0",
            "test only: least spacing of the following tokens",
            MILLISECONDS,
            field="test_token_delay_s",
        ),
    ),
)

DIALOGUE_PARAMETERS = ParameterTable(
    DIALOGUE_MODEL,
    (
        MODEL,
        DTYPE,
        QUANTIZE,
        FORWARD,
        PREFIX_CACHE,
        PREFILL_CHUNK_TOKENS,
        DIALOGUE_KV_CACHE_MEMORY,
        KV_CACHE_DTYPE,
        SPECULATIVE,
        DRAFT_MODEL,
        Parameter("max_beam_width", "8", "widest beam search a request may ask for", integer(1)),
        Parameter(
            "default_output_len",
            "16",
            "new tokens of a request that sends no request_output_len",
            integer(1),
        ),
        Parameter(
            "cpu_threads",
            "0",
            "torch threads per instance on a CPU; 0: the cores divided among the instances",
            integer(0),
        ),
    ),
)

TABLES = {table.model: table for table in (CHAT_PARAMETERS, DIALOGUE_PARAMETERS)}

_CHAT = CHAT_PARAMETERS.default_values()
_DIALOGUE = DIALOGUE_PARAMETERS.default_values()


@dataclass(frozen=True)
class EngineConfig:
    """Engine limits and defaults (the chat model's parameters that reach the engine)."""

    max_streams: int = _CHAT["max_streams"]  # live streams stepped together
    queue_limit: int = _CHAT["queue_limit"]  # submitted requests waiting; beyond it: Overloaded
    max_prefill_tokens: int = 4096  # prompt tokens admitted for prefill in one engine step
    # Admitted prompts are prefilled in groups of similar length: a group is cut where left
    # padding would exceed this fraction of its real tokens (padding is wasted compute).
    max_padding: float = 0.25
    default_max_tokens: int = _CHAT["default_max_tokens"]  # bounded by the context
    # auto: the compact forward for the families it runs (forward/llama.py FAMILIES), else HF's;
    # compact: that forward or an error; hf: always Hugging Face's (the baseline, any model).
    forward: str = _CHAT["forward"]
    # Reuse KV across requests (compact forward). on: of earlier prompts and answers (an answer's
    # KV from decode steps is what a prefill of it gives); prompts: of prompts only; off.
    prefix_cache: str = _CHAT["prefix_cache"]
    # Prompt tokens prefilled per engine step while other streams decode (compact forward): a new
    # prompt delays running streams by about one chunk per step. None (auto): as many as cost
    # about one decode step, measured as the engine runs (steps/pacing.py).
    prefill_chunk_tokens: int | None = _CHAT["prefill_chunk_tokens"]
    # The compact forward's KV cache: a fraction of the device's free memory at start (the CPU's
    # MemAvailable) such as "0.5", or a size such as "4GiB" or "512MiB". Its slots hold the live
    # streams and the prefix cache; admission waits for a slot, so a step never runs out of it.
    kv_cache_memory: str = _CHAT["kv_cache_memory"]
    # The KV cache's dtype (forward/runner.py cache_dtype): auto, float32, bfloat16. auto: bfloat16
    # for a float32 model on the C attention kernels (they read either under float32 queries),
    # else the model's dtype.
    kv_cache_dtype: str = _CHAT["kv_cache_dtype"]
    # Positions per KV cache slot (compact forward); None: the model's context. The dialogue
    # model sets it to fit its batches (dialogue/generation.py).
    max_len: int | None = None
    compile: bool = _CHAT["compile"]  # torch.compile the compact decode step
    # speculative decoding on the compact forward: auto, off, ngram, draft (steps/drafts.py)
    speculative: str = _CHAT["speculative"]
    # speculative=draft's draft model: a folder or GGUF file with the model's tokenizer
    # (steps/draft_model.py); None with any other mode
    draft_model: str | None = _CHAT["draft_model"]
    quantize: str = _CHAT["quantize"]  # the compact forward's weights: auto, none, int8, int4
    # On a CPU: decode steps on fewer torch threads while fewer measure faster, as when another
    # process holds a core (streaming_backend/engine/step_threads.py); off: torch's count always.
    adaptive_threads: bool = _CHAT["adaptive_threads"]
    # Test-only, for benchmark calibration: the first token exists exactly this long after its
    # prefill starts, each next token this long after the previous step (when compute is faster).
    test_first_token_delay_s: float = _CHAT["test_first_token_delay_s"]
    test_token_delay_s: float = _CHAT["test_token_delay_s"]

    def __post_init__(self):
        if self.max_streams < 1 or self.queue_limit < 0 or self.max_prefill_tokens < 1:
            raise ValueError(f"invalid engine limits: {self}")
        if self.forward not in FORWARDS:
            raise ValueError(f"forward must be one of {', '.join(FORWARDS)}, not {self.forward!r}")
        if self.prefill_chunk_tokens is not None and self.prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be >= 1, not {self.prefill_chunk_tokens}")
        parse_memory(self.kv_cache_memory)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            dtypes = ", ".join(KV_CACHE_DTYPES)
            raise ValueError(f"kv_cache_dtype must be one of {dtypes}, not {self.kv_cache_dtype!r}")
        if self.prefix_cache not in PREFIX_CACHE_MODES:
            modes = ", ".join(PREFIX_CACHE_MODES)
            raise ValueError(f"prefix_cache must be one of {modes}, not {self.prefix_cache!r}")
        check_speculation(self.speculative, self.draft_model)


def check_speculation(speculative: str, draft_model: str | None) -> None:
    """ValueError unless a draft model is given exactly when speculative is draft."""
    if speculative == "draft" and not draft_model:
        raise ValueError("speculative=draft needs a draft_model (--draft-model DIR|FILE.gguf)")
    if draft_model and speculative != "draft":
        raise ValueError(
            f"a draft_model drafts only with speculative=draft (--speculative draft), "
            f"not {speculative}"
        )


_ENGINE_FIELDS = {f.name for f in fields(EngineConfig)}


def _config_parameters(config: Mapping) -> dict[str, str]:
    """The string `parameters` of a model config (the JSON Triton gives initialize)."""
    return {k: v["string_value"] for k, v in config.get("parameters", {}).items()}


@dataclass(frozen=True)
class ModelSettings:
    """The chat model's config.pbtxt `parameters`, typed; the defaults are the table's."""

    model: str | None = _CHAT["model"]  # None: the bundled default chat model
    dtype: str = _CHAT["dtype"]
    engine: EngineConfig = field(default_factory=EngineConfig)
    cancel_check_s: float = _CHAT["cancel_check_s"]

    @classmethod
    def from_config(cls, config: Mapping) -> ModelSettings:
        """Read the string parameters of a model config (the JSON Triton gives initialize)."""
        return cls.from_parameters(_config_parameters(config))

    @classmethod
    def from_parameters(cls, params: Mapping[str, str]) -> ModelSettings:
        """Settings from string parameters: a missing key keeps its default, others are ignored."""
        values = CHAT_PARAMETERS.parse(params)
        engine = {k: v for k, v in values.items() if k in _ENGINE_FIELDS}
        model = {k: v for k, v in values.items() if k not in _ENGINE_FIELDS}
        return cls(engine=EngineConfig(**engine), **model)

    def parameters(self) -> dict[str, str]:
        """These settings as config.pbtxt string parameters (the inverse of from_parameters)."""
        values = {f.name: getattr(self.engine, f.name) for f in fields(self.engine)}
        values |= {f.name: getattr(self, f.name) for f in fields(self) if f.name != "engine"}
        return CHAT_PARAMETERS.format(values)


_DIALOGUE_ENGINE = {k: v for k, v in _DIALOGUE.items() if k in _ENGINE_FIELDS}
DIALOGUE_MAX_BATCH = 32  # requests per execute() when the config sets no max_batch_size


def dialogue_engine(values: Mapping, rows: int) -> EngineConfig:
    """The steps the dialogue model's requests run on: its table's engine settings, room for
    `rows` rows (each request's beams) and whole prompts prefilled when nothing decodes."""
    return EngineConfig(max_streams=rows, **{k: values[k] for k in _DIALOGUE_ENGINE})


@dataclass(frozen=True)
class DialogueSettings:
    """The dialogue model's config.pbtxt `parameters`, typed; the steps' ones in `engine`."""

    model: str | None = _DIALOGUE["model"]
    dtype: str = _DIALOGUE["dtype"]
    max_beam_width: int = _DIALOGUE["max_beam_width"]
    default_output_len: int = _DIALOGUE["default_output_len"]
    cpu_threads: int = _DIALOGUE["cpu_threads"]  # on a CPU; 0: the cores / instances
    # forward, quantize, prefix cache, prefill chunks, KV cache memory; max_streams: rows
    engine: EngineConfig = field(
        default_factory=lambda: dialogue_engine(
            _DIALOGUE, DIALOGUE_MAX_BATCH * _DIALOGUE["max_beam_width"]
        )
    )

    @classmethod
    def from_config(cls, config: Mapping) -> DialogueSettings:
        """Read the string parameters, the batch size and the instance count of the model
        config. Each instance holds at most a full batch of its widest beams; a KV cache
        fraction and (with cpu_threads 0) the cores are shared among the instances."""
        values = DIALOGUE_PARAMETERS.parse(_config_parameters(config))
        instances = sum(int(g.get("count", 1)) for g in config.get("instance_group", [])) or 1
        _, fraction = parse_memory(values["kv_cache_memory"])
        if fraction is not None:
            values["kv_cache_memory"] = f"{fraction / instances:g}"
        rows = (config.get("max_batch_size") or DIALOGUE_MAX_BATCH) * values["max_beam_width"]
        engine = dialogue_engine(values, rows)
        settings = cls(
            engine=engine, **{k: v for k, v in values.items() if k not in _DIALOGUE_ENGINE}
        )
        if settings.cpu_threads:
            return settings
        # 0: share the cores among the instances. More threads than cores make each operation
        # wait for a descheduled thread: on a busy 2-core CPU a 16-token request of the tiny
        # model took 1.96 s with 2 threads and 0.29 s with 1.
        threads = max(1, (os.cpu_count() or 1) // instances)
        return replace(settings, cpu_threads=threads)


def serve_options() -> list[tuple[Parameter, list[str]]]:
    """The parameters `tokenstream serve` has an option for, each with the models that take it."""
    options: dict[str, tuple[Parameter, list[str]]] = {}
    for table in TABLES.values():
        for parameter in table:
            if parameter.option:
                options.setdefault(parameter.key, (parameter, []))[1].append(table.model)
    return list(options.values())


def check_parameters(params: Mapping[str, str]) -> None:
    """ValueError naming the key when a value is not valid for a model that takes it (a key no
    table knows is left to the repository: see launcher/repository.py)."""
    for table in TABLES.values():
        for key, text in params.items():
            if key in table:
                table[key].parse(text)
    if {"speculative", "draft_model"} & params.keys():  # the other as given, else its default
        values = CHAT_PARAMETERS.parse(params)
        check_speculation(values["speculative"], values["draft_model"])


def parameter_strings(**values) -> dict[str, str]:
    """Values of named parameters, in the parameter's own unit, as config.pbtxt strings:
    max_streams=8 -> {"max_streams": "8"}, compile=True -> {"compile": "on"}; None is left out."""
    strings = {}
    for key, value in values.items():
        table = next((t for t in TABLES.values() if key in t), None)
        if table is None:
            raise ValueError(f"no model has a parameter {key!r}")
        if value is not None:
            text = table[key].kind.format(value) if isinstance(value, bool) else str(value)
            table[key].parse(text)  # ValueError naming the key when it is not valid
            strings[key] = text
    return strings
