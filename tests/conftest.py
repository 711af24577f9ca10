"""Shared fixtures: a tiny random model of the default model's family, and a real tritonserver."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from families import DIFFERENCES, family_classes

REPO_ROOT = Path(__file__).resolve().parent.parent
TINY_CONTEXT = 256


def _sigint_state() -> tuple[bool, bool]:
    """(ignored, blocked) of SIGINT for this process's main thread, as the kernel sees them.

    Read from /proc, not signal.getsignal(): a C extension can change the disposition without
    Python knowing, and every child started afterwards inherits it.
    """
    fields = dict(
        line.split(":\t", 1) for line in Path("/proc/self/status").read_text().splitlines()
    )
    bit = 1 << (signal.SIGINT - 1)
    return bool(int(fields["SigIgn"], 16) & bit), bool(int(fields["SigBlk"], 16) & bit)


def pytest_configure(config):
    """Make SIGINT deliverable when the suite was started as a background job: a non-interactive
    shell starts `cmd &` with SIGINT and SIGQUIT ignored, every child inherits that, and the
    Ctrl-C tests (the chat CLI, the prompt in a terminal) then fail as if Ctrl-C were lost."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _sigint_left_deliverable():
    """A test must leave SIGINT as it found it (not ignored, not blocked): the Ctrl-C tests and
    every child process started later inherit it. The offender fails; SIGINT is put back."""
    before = _sigint_state()
    yield
    after = _sigint_state()
    if after != before:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        pytest.fail(f"this test left SIGINT (ignored, blocked) = {after}, was {before}")


def wait_for(condition, timeout: float = 20.0) -> None:
    """Poll a condition another thread or process makes true, up to a deadline."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def chat_prompts() -> list[list[dict[str, str]]]:
    """The chat prompts shipped in the package (English, Chinese, emoji, multi-turn)."""
    from streaming_backend.prompts import load_chat_prompts

    return load_chat_prompts()


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default chat model converted to a safetensors folder (cached across runs)."""
    from streaming_backend.model.loading import convert_gguf, default_model_path

    return convert_gguf(default_model_path())


def save_tiny_model(
    out: Path, tokenizer_dir: Path, context: int = TINY_CONTEXT, family: str = "llama"
) -> Path:
    """A randomly initialised 2-layer model of `context` positions with the default model's
    tokenizer, saved to `out`: a Llama, or a model of another family (Hugging Face model_type)."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config_class, model_class = family_classes(family)
    config = config_class(
        **DIFFERENCES.get(family, {}),
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = model_class(config)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def save_other_vocabulary(model_dir: Path, out: Path) -> Path:
    """The model in `model_dir` with one token added to its tokenizer (and a row to its
    embedding), saved to `out`: a draft model whose vocabulary is not the model's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_tokens(["<not-in-the-model's-vocabulary>"])
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_dir) -> Path:
    """A randomly initialised 2-layer Llama with the default model's tokenizer, saved to disk."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"), default_model_dir)


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_dir):
    """The tiny model loaded in float32 on the CPU."""
    from streaming_backend.model.loading import load_model

    return load_model(str(tiny_model_dir), dtype="float32", device="cpu")


@pytest.fixture
def checkpoint(tmp_path, tiny_model_dir) -> Path:
    """A copy of the tiny model's folder, free to change."""
    copy = tmp_path / "tiny"
    copy.mkdir()
    for path in tiny_model_dir.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    return copy


def skeleton(folder: Path, dtype: str = "float32"):
    """A model folder loaded as the served models load it: its config, no weights."""
    from streaming_backend.model.loading import load_model

    return load_model(str(folder), dtype=dtype, device="cpu", weights=False)


def server_config(model_dir, **overrides):
    """A ServerConfig on free loopback ports serving `model_dir` (None: the repository's own), in
    float32 and unquantized unless the repository is another (what `auto` picks differs between
    CPU kinds; tests marked cpu_kinds serve with it). Overrides named as model parameters
    (max_streams=8, test_token_delay_ms=20) become config.pbtxt parameters; the others are
    ServerConfig fields."""
    from streaming_backend.configuration.models import TABLES, parameter_strings
    from streaming_backend.launcher import ServerConfig, free_port

    known = {p.key for table in TABLES.values() for p in table}
    values = {"model": model_dir and str(model_dir)}
    values |= {} if "repository" in overrides else {"dtype": "float32", "quantize": "none"}
    values |= {k: overrides.pop(k) for k in list(overrides) if k in known}
    parameters = parameter_strings(**values) | dict(overrides.pop("model_parameters", {}))
    ports = {f"{name}_port": free_port() for name in ("http", "grpc", "metrics")}
    return ServerConfig(**(ports | {"model_parameters": parameters} | overrides))


def start_server(model_dir, **overrides):
    """Start a real tritonserver on free loopback ports serving `model_dir` as the chat model
    (only the chat model is loaded unless `models=` names others)."""
    from streaming_backend.launcher import TritonServer
    from streaming_backend.wire import CHAT_MODEL

    config = server_config(model_dir, **({"models": (CHAT_MODEL,)} | overrides))
    server = TritonServer(config, on_log=None)
    server.start()
    try:
        server.wait_ready()
    except BaseException:
        server.stop(graceful=False)
        raise
    return server


def served(model_dir, **overrides):
    """A fixture's body: start_server(...), yield it, stop it however the tests ended.

    Killed, not drained: Triton's own shutdown polls once a second (2-3 s per server, with
    nothing left to check), and the tests of a graceful stop make their own servers."""
    server = start_server(model_dir, **overrides)
    try:
        yield server
    finally:
        server.stop(graceful=False)


@pytest.fixture(scope="session")
def triton_server(tiny_model_dir):
    """A real tritonserver serving the tiny model, shared by the server tests of a session."""
    yield from served(tiny_model_dir, max_streams=8, queue_limit=16)


# The shared servers below are started once per session (a start costs 7-30 s on 2 cores) and
# handed to each test only once no stream is left on them from an earlier test.
PACED_TOKEN_MS = 20  # the paced servers' least time per decode step: 200 tokens take >= 4 s


def wait_idle(server, timeout: float = 30.0) -> None:
    """Wait until the chat model holds no stream, active or waiting (a test ends its streams,
    but a cancel reaches the engine a step or two later)."""
    from bridge_support import metric

    deadline = time.monotonic() + timeout
    while True:
        busy = metric(server, "tokenstream_active_streams")
        busy += metric(server, "tokenstream_waiting_requests")
        if busy == 0:
            return
        assert time.monotonic() < deadline, f"{busy} streams still on the shared server"
        time.sleep(0.05)


@pytest.fixture(scope="session")
def _paced_server(tiny_model_dir):
    yield from served(
        tiny_model_dir, max_streams=8, queue_limit=16, test_token_delay_ms=PACED_TOKEN_MS
    )


@pytest.fixture
def paced_server(_paced_server):
    """The tiny model with tokens at least PACED_TOKEN_MS apart (8 slots, a queue of 16): an
    answer lasts long enough for a cancel, a Stop or a disconnect to land mid-stream."""
    wait_idle(_paced_server)
    return _paced_server


@pytest.fixture(scope="session")
def _single_slot_server(tiny_model_dir):
    yield from served(
        tiny_model_dir, max_streams=1, queue_limit=1, test_token_delay_ms=PACED_TOKEN_MS
    )


@pytest.fixture
def single_slot_server(_single_slot_server):
    """One slot and a queue of one, tokens PACED_TOKEN_MS apart: a long stream lasts seconds
    and a third request is refused for certain."""
    wait_idle(_single_slot_server)
    return _single_slot_server


@pytest.fixture(scope="session")
def _default_server(default_model_dir):
    yield from served(default_model_dir, max_streams=8, queue_limit=64)


@pytest.fixture
def default_server(_default_server):
    """The default model (float32, unquantized: logprobs compare with the model's own) behind a
    real tritonserver."""
    wait_idle(_default_server)
    return _default_server


# --------------------------------------------------------------------------- the echo model
# A tiny decoupled python-backend model for the launcher and `tokenstream serve` tests.

ECHO_CONFIG = """\
name: "{name}"
backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [ {{ name: "text_input" data_type: TYPE_STRING dims: [ 1 ] }} ]
output [ {{ name: "text_output" data_type: TYPE_STRING dims: [ -1 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
# parameters {{ key: "suffix" value: {{ string_value: "from a comment" }} }}
parameters {{ key: "suffix" value: {{ string_value: "!" }} }}
"""

# Echoes text_input + the "suffix" parameter in 3 responses, FINAL on the last.
ECHO_MODEL = """\
import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        {init_line}
        params = json.loads(args["model_config"])["parameters"]
        self.suffix = params["suffix"]["string_value"]

    def execute(self, requests):
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()[0]
            sender = request.get_response_sender()
            for i in range(3):
                out = np.array([text.decode() + self.suffix], dtype=np.object_)
                response = pb_utils.InferenceResponse([pb_utils.Tensor("text_output", out)])
                sender.send(response, flags=final if i == 2 else 0)
        return None

    def finalize(self):
        {finalize_line}
"""


def write_echo_model(
    repository: Path, name: str = "echo", init_line: str = "pass", finalize_line: str = "pass"
) -> Path:
    """Write the echo model into `repository`; the two lines let a test break it on purpose."""
    model_dir = repository / name
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(ECHO_CONFIG.format(name=name))
    code = ECHO_MODEL.format(init_line=init_line, finalize_line=finalize_line)
    (model_dir / "1" / "model.py").write_text(code)
    return model_dir


@pytest.fixture
def echo_repository(tmp_path: Path) -> Path:
    """A model repository holding only the echo model."""
    repository = tmp_path / "repository"
    write_echo_model(repository)
    return repository


def shm_files(prefix: str) -> list[Path]:
    """The /dev/shm files whose name starts with `prefix`."""
    from streaming_backend.launcher.processes import SHM_DIR, glob_escape

    return sorted(SHM_DIR.glob(f"{glob_escape(prefix)}*"))


def alive(processes: dict[int, int]) -> list[int]:
    """The pids of `processes` (pid -> start time) that still run."""
    from streaming_backend.launcher.processes import is_alive

    return [pid for pid, start in processes.items() if is_alive(pid, start)]


def kill_all(process, family: dict[int, int]) -> None:
    """Kill `process` (a Popen) where it still runs, and what still runs of `family` (its
    descendants, pid -> start time, read while it ran)."""
    if process.poll() is None:
        process.kill()
        process.wait()
    for pid in alive(family):
        os.kill(pid, signal.SIGKILL)


# --------------------------------------------------------------------------- supervised servers


@contextlib.contextmanager
def supervised_server(model_dir, canary_interval_s: float = 0.5, budget=None, **server_overrides):
    """A Supervisor watching a server (of `model_dir` as the chat model, None: the repository's
    own models) from a thread, and its HTTP port's URL.

    Yields (supervisor, health_url, events): events collects the supervisor's log lines.
    """
    from streaming_backend.launcher import free_port
    from streaming_backend.launcher.health import HealthServer
    from streaming_backend.launcher.supervisor import Supervisor, SupervisorConfig
    from streaming_backend.launcher.watch import CanaryConfig

    server = server_config(model_dir, **server_overrides)
    canary = CanaryConfig(interval_s=canary_interval_s, timeout_s=5.0)
    events: list[str] = []
    config = SupervisorConfig(server, canary=canary)
    if budget is not None:
        config = SupervisorConfig(server, budget=budget, canary=canary)
    supervisor = Supervisor(config, events.append, None)
    stop = threading.Event()
    health = HealthServer(supervisor, "127.0.0.1", free_port()).start()
    watcher = threading.Thread(target=supervisor.watch, args=(stop,), daemon=True)
    try:
        assert supervisor.start(stop)
        watcher.start()
        yield supervisor, f"http://127.0.0.1:{health.port}", events
    finally:
        stop.set()
        if watcher.is_alive():
            watcher.join(timeout=30)
        health.close()
        supervisor.shutdown(graceful=False)  # nothing left to drain; the drain has its own tests


class GrpcStream:
    """One streamed generation with plain tritonclient on its own gRPC stream, in the background.

    Records the tokens received, whether a FINAL came, the error if one came, and when it ended.
    """

    def __init__(self, grpc_url: str, prompt: str = "Hello", max_tokens: int = 32, **extra):
        import numpy as np
        import tritonclient.grpc as grpcclient

        from streaming_backend import wire

        self.client = grpcclient.InferenceServerClient(grpc_url)
        self.texts: list[str] = []
        self.tokens = 0
        self.final = False
        self.error: Exception | None = None
        self.ended = threading.Event()
        self.ended_at = 0.0
        sampling = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0} | extra
        values = {
            wire.TEXT_INPUT: np.array([prompt.encode()], dtype=np.object_),
            wire.SAMPLING_PARAMETERS: np.array([json.dumps(sampling).encode()], dtype=np.object_),
            wire.STREAM: np.array([True]),
            wire.RETURN_NUM_OUTPUT_TOKENS: np.array([True]),
        }
        self.inputs = []
        for name, array in values.items():
            dtype = "BOOL" if array.dtype == bool else "BYTES"
            self.inputs.append(grpcclient.InferInput(name, [1], dtype))
            self.inputs[-1].set_data_from_numpy(array)

    def start(self) -> GrpcStream:
        """Send the request; responses arrive on tritonclient's thread."""
        from streaming_backend import wire

        self.client.start_stream(callback=self._on_response)
        self.client.async_stream_infer(
            wire.CHAT_MODEL, self.inputs, enable_empty_final_response=True
        )
        return self

    def _on_response(self, result, error) -> None:
        from streaming_backend import wire

        if self.ended.is_set():
            return
        if error is not None:
            self.error = error
            self._end()
            return
        text = result.as_numpy(wire.TEXT_OUTPUT)
        count = result.as_numpy(wire.NUM_OUTPUT_TOKENS)
        self.texts.append(text[0].decode() if text is not None and len(text) else "")
        self.tokens += int(count[0]) if count is not None and len(count) else 0
        if result.get_response().parameters[wire.FINAL_RESPONSE].bool_param:
            self.final = True
            self._end()

    def _end(self) -> None:
        self.ended_at = time.monotonic()
        self.ended.set()

    def cancel(self) -> None:
        """Cancel on the server (tritonclient's stop_stream with cancel_requests)."""
        self.client.stop_stream(cancel_requests=True)

    def close(self) -> None:
        """Stop the stream and close the channel (idempotent)."""
        try:
            self.client.stop_stream()
        finally:
            self.client.close()


def stub_pids(server, model: str | None = None) -> list[int]:
    """The triton_python_backend_stub processes of a TritonServer (of `model` only, if given:
    a stub's command line holds its model's path)."""
    from streaming_backend.launcher.processes import descendants

    found = []
    for pid in descendants(server.pid):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"triton_python_backend_stub" in command and (
            model is None or f"/{model}/".encode() in command
        ):
            found.append(pid)
    return found


def ws_generation(port: int, max_tokens: int, result: dict, prompt: str = "Hello") -> None:
    """One websocket generation through a bridge on `port`: fills `result` with the tokens
    received, `started`, the last frame (`done` or `error`) and when it came (`at`)."""
    from websockets.sync.client import connect

    with connect(f"ws://127.0.0.1:{port}/ws") as ws:
        params = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
        ws.send(json.dumps({"type": "generate", "id": "g", "prompt": prompt, "params": params}))
        result["tokens"] = 0
        while True:
            got = json.loads(ws.recv(timeout=60))
            if got["type"] == "token":
                result["tokens"] += 1
                result["started"] = True
            else:
                result.update(last=got, at=time.monotonic())
                return


@contextlib.contextmanager
def bridge_thread(triton_grpc_url: str, **overrides):
    """A websocket bridge in front of `triton_grpc_url`, on its own event loop thread; yields
    its port."""
    import asyncio

    from clients.bridge import BridgeConfig, serve_bridge
    from streaming_backend.launcher import free_port

    port = free_port()
    cfg = BridgeConfig(triton_url=triton_grpc_url, port=port, health_interval_s=0.2, **overrides)
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    thread = threading.Thread(
        target=loop.run_until_complete, args=(serve_bridge(cfg, stop),), daemon=True
    )
    thread.start()
    try:
        wait_for(lambda: _listening(port), timeout=30)
        yield port
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=30)
        loop.close()


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


DIALOGUE_MAX_BEAM = 4
DIALOGUE_QUEUE_DELAY_US = 100_000


@pytest.fixture(scope="session")
def dialogue_server(tiny_model_dir):
    """tritonserver with only the dialogue_model on the tiny model: two instances, dynamic
    batching with a queue delay of 100 ms (5 ms as shipped), so that requests sent together
    reliably share a batch, and max_beam_width 4."""
    from streaming_backend.launcher.batching import DialogueBatching
    from streaming_backend.wire import DIALOGUE_MODEL

    yield from served(
        tiny_model_dir,
        models=(DIALOGUE_MODEL,),
        max_beam_width=DIALOGUE_MAX_BEAM,
        dialogue=DialogueBatching(queue_delay_us=DIALOGUE_QUEUE_DELAY_US),
    )


def sequence_log_prob(loaded, prompt_ids, tokens) -> float:
    """The model's summed log-probability of `tokens` after `prompt_ids` (one forward pass):
    the reference the beam and batch tests compare cumulative log-probs with."""
    import torch

    ids = torch.tensor([list(prompt_ids) + list(tokens)], device=loaded.device)
    with torch.inference_mode():
        logits = loaded.model(input_ids=ids).logits[0].float()  # [L, V]
    log_probs = torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)  # [T, V]
    chosen = torch.tensor(list(tokens), device=loaded.device)[:, None]
    return float(log_probs.gather(-1, chosen).sum()) if len(tokens) else 0.0


_GENERATORS: dict = {}


@pytest.fixture(params=["compact", "hf"])
def batch_forward(request) -> str:
    """The dialogue model's forwards, by name: a test taking this runs on each."""
    return request.param


def cancel_after(handle, count: int) -> list:
    """An engine stream's events when it is cancelled once `count` have come: those and the
    rest, to its final one."""
    events = []
    for event in handle:
        events.append(event)
        if len(events) == count:
            handle.cancel()
    return events


def generate(loaded, forward, requests, max_beam_width: int):
    """The dialogue model's generation of `requests` on `loaded`: `forward` names the forward
    (unquantized) or is the whole EngineConfig; room for 8 requests of the widest beams. The
    generator is built once per model and settings (the compact one fuses the weights), so
    its prefix cache carries over between calls, as it does between a server's batches."""
    from streaming_backend.configuration.models import EngineConfig
    from streaming_backend.dialogue.generation import Generator

    if not isinstance(forward, EngineConfig):
        forward = EngineConfig(forward=forward, quantize="none")
    config = replace(forward, max_streams=8 * max_beam_width)
    key = (id(loaded), config, max_beam_width)
    if key not in _GENERATORS:  # the model kept alive with its generator
        _GENERATORS[key] = (loaded, Generator(loaded, config, max_beam_width))
    return _GENERATORS[key][1].generate(requests)


@pytest.fixture
def load_script(monkeypatch):
    """name -> scripts/<name>.py (scripts/ is no package) as a module, registered in sys.modules
    under its name (its dataclasses look their module up there), scripts/ importable as when it
    runs (served.py)."""
    import importlib.util
    import sys

    scripts = Path(__file__).resolve().parent.parent / "scripts"
    monkeypatch.syspath_prepend(str(scripts))

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, scripts / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, module)
        spec.loader.exec_module(module)
        return module

    return load
