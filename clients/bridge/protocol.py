"""The bridge's websocket protocol: every word of its JSON frames, defined once.

Client -> bridge, one JSON object per text frame, told apart by `type`:
    {"type": "generate", "id", "prompt" | "messages": [{"role", "content"}], "params"}
    {"type": "cancel", "id"}
    {"type": "auth", "token"}
Bridge -> client:
    {"type": "token", "id", "text", "n"}            n: output tokens of the generation so far
    {"type": "done", "id", "finish_reason", "usage": {"prompt_tokens", "completion_tokens"},
     "timing": {"server": {SERVER_SPANS, the stamps}, "bridge": {BRIDGE_SPANS}}}
    {"type": "error", "id", "code", "message"}      id null: the connection's, not a generation's
A generation ends with exactly one `done` or one `error` frame.

The bridge parses with these (messages.py) and builds with them (frames.py); its websocket client
(ws_client.py) speaks them too; the page (static/*.js) spells the same strings, and
tests/test_clients/test_bridge/test_bridge_protocol.py checks it against this module. Roles,
sampling keys and the model's error codes come from the wire contract (streaming_backend/wire.py).
"""

from __future__ import annotations

from streaming_backend.wire import ERROR_CODES, FINISH_REASON, MESSAGES, TIMING

TYPE = "type"  # every frame's kind
ID = "id"  # the generation a frame belongs to, chosen by the client

# ---- client -> bridge -------------------------------------------------------------------------
GENERATE = "generate"
CANCEL = "cancel"
AUTH = "auth"
CLIENT_TYPES = (GENERATE, CANCEL, AUTH)
PROMPT = "prompt"  # generate: plain text
# MESSAGES (generate: a chat, [{ROLE, CONTENT}]) is the wire contract's word
ROLE = "role"
CONTENT = "content"
PARAMS = "params"  # generate: sampling parameters, request_keys.SAMPLING_KEYS
AUTH_TOKEN = "token"  # auth: the bearer token
CLIENT_FIELDS = (TYPE, ID, PROMPT, MESSAGES, PARAMS, AUTH_TOKEN)

# ---- bridge -> client -------------------------------------------------------------------------
TOKEN = "token"
DONE = "done"
ERROR = "error"
SERVER_TYPES = (TOKEN, DONE, ERROR)
ENDING_TYPES = (DONE, ERROR)  # the last frame of a generation
TEXT = "text"  # token: the new text
COUNT = "n"  # token: output tokens so far
# FINISH_REASON (done) and TIMING (done) are the wire contract's words
USAGE = "usage"  # done: token counts
PROMPT_TOKENS = "prompt_tokens"
COMPLETION_TOKENS = "completion_tokens"
SERVER = "server"  # done.timing: the server's stamps of the first token, and spans between
BRIDGE = "bridge"  # done.timing: what the bridge measured
CODE = "code"  # error: a category (ERROR_CODES)
MESSAGE = "message"  # error: for people
SERVER_FIELDS = (TYPE, ID, TEXT, COUNT, FINISH_REASON, USAGE, TIMING, CODE, MESSAGE)

# timing.server: spans (ms) on the server's clock, beside the raw stamps (wire.TIMING_KEYS)
QUEUE_MS = "queue_ms"  # queued -> prefill started
PREFILL_MS = "prefill_ms"  # prefill started -> first token emitted
FIRST_TOKEN_MS = "first_token_ms"  # the server's own: request received -> first token emitted
SERVER_SPANS = (QUEUE_MS, PREFILL_MS, FIRST_TOKEN_MS)
# timing.bridge: spans (ms) the bridge measured (TTFT and first text as clients/library/metrics.py)
FIRST_FRAME_MS = "first_frame_ms"  # generate frame accepted -> first token frame queued
UPSTREAM_TTFT_MS = "upstream_ttft_ms"  # TTFT of the bridge's request to Triton
UPSTREAM_FIRST_TEXT_MS = "upstream_time_to_first_text_ms"  # its time to first text
SERVER_TO_BRIDGE_MS = "server_to_bridge_ms"  # first token emitted -> received (wall clocks)
RELAY_MEAN_MS = "relay_mean_ms"  # mean chunk received -> token frame queued
TOTAL_MS = "total_ms"  # generate frame accepted -> done frame built
BRIDGE_SPANS = (
    FIRST_FRAME_MS,
    UPSTREAM_TTFT_MS,
    UPSTREAM_FIRST_TEXT_MS,
    SERVER_TO_BRIDGE_MS,
    RELAY_MEAN_MS,
    TOTAL_MS,
)

# error codes of the protocol itself (the model's own are wire.ERROR_CODES)
BAD_FRAME = "bad_frame"  # not JSON, not an object, a field missing or of the wrong type
UNKNOWN_TYPE = "unknown_type"
BAD_PARAMS = "bad_params"  # an unknown sampling key or a value of an unsupported type
UNAUTHORIZED = "unauthorized"  # a generate before the right auth
DUPLICATE_ID = "duplicate_id"  # a generation with this id is still running
TOO_MANY = "too_many"  # the connection's generations at once (BridgeConfig.max_concurrent)
CLOSED = "closed"  # the websocket client's own: the socket closed under a generation
PROTOCOL_ERROR_CODES = (
    BAD_FRAME,
    UNKNOWN_TYPE,
    BAD_PARAMS,
    UNAUTHORIZED,
    DUPLICATE_ID,
    TOO_MANY,
    CLOSED,
)
ALL_ERROR_CODES = PROTOCOL_ERROR_CODES + ERROR_CODES
