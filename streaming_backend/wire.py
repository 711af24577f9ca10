"""The wire contract: every name and code a request or response carries between a client and the
`chat` model (and, in its own section at the end, the `dialogue_model`), defined once. Standard
library only, so the clients, the bridge, the benchmark and the models all import it without
paying for torch (docs/interface.md and docs/dialogue_model.md document the same facts).

The keys of `sampling_parameters` have a table of their own, sampling/request_keys.py.
tests/test_layout.py checks that no other product file spells a tensor name, a timing key or an
error code, and that no other file of the core spells a sampling key. Finish reasons are
FinishReason's values; their words ("stop", "error") are too common to check as literals.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from enum import Enum

CHAT_MODEL = "chat"  # the decoupled streaming model's name in repository/

# ---- input tensors (the vLLM backend's dialect, then ours) --------------------------------------
TEXT_INPUT = "text_input"  # STRING [1]: a raw prompt
STREAM = "stream"  # BOOL [1]: false (default) = one response holding the whole answer
# STRING [1]: a JSON object of request keys (sampling/request_keys.py, SAMPLING_KEYS)
SAMPLING_PARAMETERS = "sampling_parameters"
EXCLUDE_INPUT_IN_OUTPUT = "exclude_input_in_output"  # BOOL [1]
MESSAGES = "messages"  # STRING [1]: chat messages as JSON (ours)
INPUT_IDS = "input_ids"  # INT64 [-1]: prompt token ids (ours)
TOOLS = "tools"  # STRING [1]: functions the model may call, OpenAI's tools as JSON (ours; messages)
RETURN_FINISH_REASON = "return_finish_reason"
RETURN_NUM_INPUT_TOKENS = "return_num_input_tokens"
RETURN_NUM_OUTPUT_TOKENS = "return_num_output_tokens"
RETURN_LOGPROBS = "return_logprobs"
RETURN_CUMULATIVE_LOGPROB = "return_cumulative_logprob"
RETURN_OUTPUT_IDS = "return_output_ids"  # ours
RETURN_TIMING = "return_timing"  # ours: server timestamps per response (TIMING)
RETURN_SYSTEM_FINGERPRINT = "return_system_fingerprint"  # ours: SYSTEM_FINGERPRINT per response
RETURN_FLAGS = (
    RETURN_FINISH_REASON,
    RETURN_NUM_INPUT_TOKENS,
    RETURN_NUM_OUTPUT_TOKENS,
    RETURN_LOGPROBS,
    RETURN_CUMULATIVE_LOGPROB,
    RETURN_OUTPUT_IDS,
    RETURN_TIMING,
    RETURN_SYSTEM_FINGERPRINT,
)
BOOL_INPUTS = (STREAM, EXCLUDE_INPUT_IN_OUTPUT, *RETURN_FLAGS)
STRING_INPUTS = (TEXT_INPUT, SAMPLING_PARAMETERS, MESSAGES, TOOLS)
PROMPT_INPUTS = (TEXT_INPUT, MESSAGES, INPUT_IDS)  # exactly one of these per request
INPUT_NAMES = (*STRING_INPUTS, INPUT_IDS, *BOOL_INPUTS)

# ---- output tensors -----------------------------------------------------------------------------
TEXT_OUTPUT = "text_output"  # STRING: the new text (a delta when streaming)
FINISH_REASON = "finish_reason"  # STRING: a FinishReason value, on the last response
NUM_INPUT_TOKENS = "num_input_tokens"  # UINT32
NUM_OUTPUT_TOKENS = "num_output_tokens"  # UINT32: tokens in this response (not a running total)
LOGPROBS = "logprobs"  # STRING: JSON [{"token_id", "logprob", "token", "top_logprobs"?}]
CUMULATIVE_LOGPROB = "cumulative_logprob"  # FP32
OUTPUT_IDS = "output_ids"  # INT64: token ids of this response
TIMING = "timing"  # STRING: ServerTiming as JSON
# STRING: what decides the numbers, in one value ("fp_" + 12 hex; model/numerics.py)
SYSTEM_FINGERPRINT = "system_fingerprint"
OUTPUT_NAMES = (
    TEXT_OUTPUT,
    FINISH_REASON,
    NUM_INPUT_TOKENS,
    NUM_OUTPUT_TOKENS,
    LOGPROBS,
    CUMULATIVE_LOGPROB,
    OUTPUT_IDS,
    TIMING,
    SYSTEM_FINGERPRINT,
)

# ---- control requests (ours): the supervisor's canary and drain ---------------------------------
# CONTROL (STRING [1]) holds a JSON object {"key": <admin key>, "action": <CONTROL_ACTIONS>}; a
# request carrying it is a control request, answered with one response whose TEXT_OUTPUT is the
# model's health as JSON (HEALTH_KEYS). The model takes it only with the admin key the launcher
# gave its process; without the key it is refused as an invalid request.
CONTROL = "tokenstream_control"
CONTROL_HEALTH = "health"  # answer with the model's health (the canary)
CONTROL_DRAIN = "drain"  # refuse new requests (UNAVAILABLE, "draining"); open streams go on
CONTROL_END = "end"  # end every open stream now with a final error response (drain deadline)
CONTROL_ACTIONS = (CONTROL_HEALTH, CONTROL_DRAIN, CONTROL_END)
# numerics: the facts that decide the model's numbers (numerics.Numerics), SYSTEM_FINGERPRINT theirs
NUMERICS = "numerics"
# steps: the decode steps' torch threads and pace on a CPU (step_threads.StepReport), else null
STEPS = "steps"
# forward: which forward runs the model and why (forward_choice.ForwardChoice)
FORWARD = "forward"
# memory: what the compact forward's weights and KV cache cost the host now, in bytes
# (model/memory.py MemoryReport.as_dict: weights shared and private, KV cache reserved and
# touched), else null
MEMORY = "memory"
# speculation: speculative decoding's mode (off, ngram, draft) and its tokens drafted and accepted
# since load, with their ratio (steps/drafts.py DraftCounts)
SPECULATION = "speculation"
# the dialogue model's speculation (its drafted and accepted tokens, their ratio) in /status: it
# takes no control requests, so the supervisor reads its counters on Triton's metrics port
DIALOGUE_SPECULATION = "dialogue_speculation"
# speculative decoding's counters on Triton's metrics port, one series a model (label "model")
SPEC_DRAFTED_METRIC = "tokenstream_spec_decode_draft_tokens_total"
SPEC_ACCEPTED_METRIC = "tokenstream_spec_decode_accepted_tokens_total"
HEALTH_KEYS = (
    "healthy", "reason", "draining", "active", "waiting", SYSTEM_FINGERPRINT, NUMERICS, STEPS,
    FORWARD, MEMORY, SPECULATION,
)  # fmt: skip


def speculation_counts(drafted: int, accepted: int) -> dict:
    """Drafted and accepted tokens as /status shows them, with their rate (None before any
    draft), for the chat model's speculation and the dialogue model's alike."""
    rate = round(accepted / drafted, 4) if drafted else None
    return {"drafted": drafted, "accepted": accepted, "rate": rate}


ADMIN_KEY_VARIABLE = "TOKENSTREAM_ADMIN_KEY"  # the admin key, as the model process sees it
ADMIN_HEADER = "tokenstream-admin-key"  # the header Triton's restricted repository API checks

# ---- Triton's decoupled streaming parameters ----------------------------------------------------
ENABLE_EMPTY_FINAL = "triton_enable_empty_final_response"  # request parameter
FINAL_RESPONSE = "triton_final_response"  # response parameter: this response carries FINAL

# ---- chat messages ------------------------------------------------------------------------------
ROLES = ("system", "user", "assistant", "tool")
# A tool call in the generic format (streaming_backend/prompts/tool_prompt.py), one per line:
# <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


class FinishReason(str, Enum):
    """Why a stream ended (the strings of Triton's vLLM backend dialect)."""

    STOP = "stop"  # EOS token or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    CANCELLED = "cancelled"  # the client cancelled, or the engine shut down
    ERROR = "error"  # this request failed; the error says why


# ---- errors -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ErrorKind:
    """One error category: the model's message prefix, the code clients see, the Triton code."""

    prefix: str  # the model's messages start with "<prefix>: "
    code: str  # what clients, the bridge and the benchmark call it
    triton_code: str  # the name of the pb_utils.TritonError code it is sent with


INVALID_REQUEST = ErrorKind("invalid request", "invalid_request", "INVALID_ARG")
OVERLOADED = ErrorKind("overloaded", "overloaded", "UNAVAILABLE")
UNAVAILABLE = ErrorKind("unavailable", "unavailable", "UNAVAILABLE")
CANCELLED = ErrorKind("cancelled", "cancelled", "CANCELLED")
INTERNAL = ErrorKind("internal error", "internal", "INTERNAL")
ERROR_KINDS = (INVALID_REQUEST, OVERLOADED, UNAVAILABLE, CANCELLED, INTERNAL)
ERROR_CODES = tuple(kind.code for kind in ERROR_KINDS)
# Triton's own messages for a model that is known but has no loaded version on this server right
# now (being unloaded at shutdown, or reloaded): another replica, or a moment later, may serve it.
TRITON_MODEL_UNAVAILABLE = ("has no available versions",)


# What a stream whose model process died, or whose server went away, ends with (the bridge and the
# clients say this instead of gRPC's bare "Socket closed").
SERVER_LOST = "the model server went away (its model process died or it restarted); retry"
DRAINING = "the server is draining (shutting down); retry on another replica"


def error_code(message: str, status: str | None = None) -> str:
    """A client's reading of an error: the category from the message prefix or the RPC status."""
    lowered = message.lower()
    for kind in ERROR_KINDS:
        if lowered.startswith(kind.prefix):
            return kind.code
    status = status or ""
    if any(text in lowered for text in TRITON_MODEL_UNAVAILABLE):
        return UNAVAILABLE.code
    if "UNAVAILABLE" in status or "DEADLINE_EXCEEDED" in status:
        return UNAVAILABLE.code
    if "locally cancelled" in lowered or "CANCELLED" in status:
        return CANCELLED.code
    return INTERNAL.code


# ---- server timing ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServerTiming:
    """Server timestamps of one response, CLOCK_MONOTONIC ns of the server's machine."""

    received_ns: int  # execute() saw the request
    queued_ns: int  # the engine queued it
    prefill_start_ns: int  # its prefill started (0 before it did)
    emitted_ns: int  # this response's token existed
    wall_minus_monotonic_ns: int = 0  # maps the stamps onto wall time (clients on other hosts)
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache (not prefilled again)

    def to_json(self) -> str:
        """The TIMING tensor's text."""
        return json.dumps({"clock": "monotonic", **asdict(self)})

    @classmethod
    def from_json(cls, value: str | bytes | Mapping | None) -> ServerTiming | None:
        """Parse the TIMING tensor's text (or its decoded object); None when absent."""
        if value is None or value == "" or value == b"":
            return None
        d = json.loads(value) if isinstance(value, (str, bytes)) else value
        return cls(
            received_ns=int(d["received_ns"]),
            queued_ns=int(d["queued_ns"]),
            prefill_start_ns=int(d["prefill_start_ns"]),
            emitted_ns=int(d["emitted_ns"]),
            wall_minus_monotonic_ns=int(d.get("wall_minus_monotonic_ns", 0)),
            cached_tokens=int(d.get("cached_tokens", 0)),
        )

    @staticmethod
    def wall_offset_ns() -> int:
        """This machine's wall clock minus its monotonic clock, now."""
        return time.time_ns() - time.monotonic_ns()


TIMING_KEYS = tuple(ServerTiming.__dataclass_fields__)


# =================================================================================================
# ---- the dialogue_model: token ids in, token ids out (non-decoupled, dynamically batched) ------
# Tensor names as NVIDIA's TensorRT-LLM backend spells them (docs/dialogue_model.md). Some strings
# equal the chat model's (input_ids, output_ids, temperature, repetition_penalty), but their types
# differ (INT32 ids, FP32 scalars), so they are named here on their own.
DIALOGUE_MODEL = "dialogue_model"

# inputs, each [batch, ...] on the wire (max_batch_size > 0): client shapes are [1, L] and [1, 1]
DIALOGUE_INPUT_IDS = "input_ids"  # INT32 [-1]: prompt token ids (required)
REQUEST_OUTPUT_LEN = "request_output_len"  # INT32 [1]: max new tokens
BEAM_WIDTH = "beam_width"  # INT32 [1]: 1 = no beam search
DIALOGUE_TEMPERATURE = "temperature"  # FP32 [1]
RUNTIME_TOP_P = "runtime_top_p"  # FP32 [1]: 0 = off
RUNTIME_TOP_K = "runtime_top_k"  # INT32 [1]: 0 = off
RANDOM_SEED = "random_seed"  # UINT64 [1]
END_ID = "end_id"  # INT32 [1]: the token that ends a sequence (default: the model's EOS)
PAD_ID = "pad_id"  # INT32 [1]: fills output_ids past a sequence's end (default: end_id)
LEN_PENALTY = "len_penalty"  # FP32 [1]: beam score = cum_log_probs / length ** len_penalty
DIALOGUE_REPETITION_PENALTY = "repetition_penalty"  # FP32 [1]: 1 = off
DIALOGUE_INT_INPUTS = (REQUEST_OUTPUT_LEN, BEAM_WIDTH, RUNTIME_TOP_K, END_ID, PAD_ID)
DIALOGUE_FLOAT_INPUTS = (
    DIALOGUE_TEMPERATURE,
    RUNTIME_TOP_P,
    LEN_PENALTY,
    DIALOGUE_REPETITION_PENALTY,
)
DIALOGUE_INPUT_NAMES = (
    DIALOGUE_INPUT_IDS,
    *DIALOGUE_INT_INPUTS,
    *DIALOGUE_FLOAT_INPUTS,
    RANDOM_SEED,
)

# outputs, per request (batch dimension 1 first)
DIALOGUE_OUTPUT_IDS = "output_ids"  # INT32 [1, beam_width, request_output_len], pad_id-padded
SEQUENCE_LENGTH = "sequence_length"  # INT32 [1, beam_width]: new tokens of each beam
CUM_LOG_PROBS = "cum_log_probs"  # FP32 [1, beam_width]: summed log-probabilities of each beam
