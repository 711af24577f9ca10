"""Start a real tritonserver on a model repository, and stop it without leaving anything behind.

Standard library only (no torch, no clients). Its parts, one concern each:

- `binary.py`: find tritonserver (PATH, the NGC image, the nvidia-pytriton wheel), its environment
- `repository.py`: the runtime copy of repository/ with each config.pbtxt's `parameters` rewritten
- `processes.py`: /proc walking, killing a process tree, /dev/shm cleanup, free ports
- `server.py`: `ServerConfig` and `TritonServer` (start, wait_ready, a bounded stop)

`tokenstream serve` (the CLI that runs this beside the websocket bridge) is clients/cli/serve.py.
"""

from streaming_backend.launcher.processes import free_port
from streaming_backend.launcher.server import ServerConfig, ServerDied, TritonServer

__all__ = ["ServerConfig", "ServerDied", "TritonServer", "free_port"]
