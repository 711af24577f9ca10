"""A model whose start hangs in Triton 2.51 the way a real one did (launcher/startup.py).

Its `initialize` stops its own process (SIGSTOP, every thread) for a few seconds, with a helper
process that sends SIGCONT: the stub's health thread misses the python backend's 1 s checks, the
backend gives up launching it and waits for it to exit, while the model resumes, prints its
`initialize returned` line and waits for commands. Nothing is simulated past the stop: tritonserver
really sits in waitpid() for a live stub and never opens its ports. A file says how many starts
are left to hang ("always": every one); the model takes one per start. Otherwise it echoes
`text_input` + "!" in one final response.
"""

from __future__ import annotations

from pathlib import Path

from conftest import ECHO_CONFIG

STOP_S = 4  # the python backend gives up after one check of 1 s with no sign of the stub

HANGING_MODEL = """\
import os
import signal
import subprocess

import numpy as np
import triton_python_backend_utils as pb_utils

from streaming_backend.launcher.startup import announce_initialized

HANGS = {hangs!r}


def take_a_hang():
    with open(HANGS) as file:
        left = file.read().strip()
    if left == "always":
        return True
    if int(left or 0) <= 0:
        return False
    with open(HANGS, "w") as file:
        file.write(str(int(left) - 1))
    return True


class TritonPythonModel:
    def initialize(self, args):
        if take_a_hang():
            # the helper is in tritonserver's process group: stop() kills it with the rest
            subprocess.Popen(["sh", "-c", "sleep {stop_s}; kill -CONT %d" % os.getpid()])
            os.kill(os.getpid(), signal.SIGSTOP)
        announce_initialized(args)

    def execute(self, requests):
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()[0]
            out = np.array([text.decode() + "!"], dtype=np.object_)
            response = pb_utils.InferenceResponse([pb_utils.Tensor("text_output", out)])
            request.get_response_sender().send(response, flags=final)
        return None
"""


def hanging_repository(root: Path, hangs: str) -> tuple[Path, Path]:
    """A model repository under `root` holding the hanging echo model, and its file of starts
    left to hang (`hangs`: a count or "always"), which a test may rewrite at any time."""
    repository = root / "repository"
    model_dir = repository / "echo"
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(ECHO_CONFIG.format(name="echo"))
    left = root / "hangs-left"
    left.write_text(hangs)
    code = HANGING_MODEL.format(hangs=str(left), stop_s=STOP_S)
    (model_dir / "1" / "model.py").write_text(code)
    return repository, left
