"""Shared fixtures: a tiny random model of the default model's family, and a real tritonserver."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
TINY_CONTEXT = 256


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
    from streaming_backend.loading import convert_gguf, default_model_path

    return convert_gguf(default_model_path())


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_dir) -> Path:
    """A randomly initialised 2-layer Llama with the default model's tokenizer, saved to disk."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=TINY_CONTEXT,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    out = tmp_path_factory.mktemp("tiny-model")
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_dir):
    """The tiny model loaded in float32 on the CPU."""
    from streaming_backend.loading import load_model

    return load_model(str(tiny_model_dir), dtype="float32", device="cpu")


def start_server(model_dir, **overrides):
    """Start a real tritonserver on free loopback ports serving `model_dir` as the chat model
    (only the chat model is loaded unless `models=` names others)."""
    from streaming_backend.launcher import ServerConfig, TritonServer, free_port
    from streaming_backend.wire import CHAT_MODEL

    config = ServerConfig(
        model=str(model_dir) if model_dir is not None else None,
        dtype=overrides.pop("dtype", "float32"),
        models=overrides.pop("models", (CHAT_MODEL,)),
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=free_port(),
        **overrides,
    )
    server = TritonServer(config, on_log=None)
    server.start()
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="session")
def triton_server(tiny_model_dir):
    """A real tritonserver serving the tiny model, shared by the server tests of a session."""
    server = start_server(tiny_model_dir, max_streams=8, queue_limit=16)
    try:
        yield server
    finally:
        server.stop()


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


DIALOGUE_MAX_BEAM = 4
DIALOGUE_QUEUE_DELAY_US = 100_000


@pytest.fixture(scope="session")
def dialogue_server(tiny_model_dir):
    """tritonserver with only the dialogue_model on the tiny model: two instances, dynamic
    batching with a queue delay of 100 ms (5 ms as shipped), so that requests sent together
    reliably share a batch, and max_beam_width 4."""
    from streaming_backend.launcher.batching import DialogueBatching
    from streaming_backend.wire import DIALOGUE_MODEL

    server = start_server(
        tiny_model_dir,
        models=(DIALOGUE_MODEL,),
        model_parameters={"max_beam_width": str(DIALOGUE_MAX_BEAM)},
        dialogue=DialogueBatching(queue_delay_us=DIALOGUE_QUEUE_DELAY_US),
    )
    try:
        yield server
    finally:
        server.stop()
