"""Find tritonserver: on PATH, in the NGC image, or prepared from the nvidia-pytriton wheel."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from streaming_backend.paths import cache_dir

NGC_TRITONSERVER = Path("/opt/tritonserver/bin/tritonserver")


@dataclass(frozen=True)
class TritonBinary:
    """A tritonserver executable, its backend folder and the environment it needs."""

    binary: Path
    backend_dir: Path
    env: Mapping[str, str]  # set on top of os.environ for the server process


def find_tritonserver(explicit: Path | None = None) -> TritonBinary:
    """Locate tritonserver: explicit path, PATH, the NGC image, else the nvidia-pytriton wheel."""
    on_path = shutil.which("tritonserver")
    for candidate in (explicit, Path(on_path) if on_path else None, NGC_TRITONSERVER):
        if candidate is not None and candidate.is_file():
            # installed layout: <root>/bin/tritonserver beside <root>/backends
            return TritonBinary(candidate, candidate.parent.parent / "backends", _python_env())
    if explicit is not None:
        raise FileNotFoundError(f"no tritonserver at {explicit}")
    return _wheel_tritonserver()


def _python_env() -> dict[str, str]:
    """PATH and PYTHONPATH so the backend stub imports this virtual environment's packages."""
    if sys.prefix == sys.base_prefix:
        return {}  # a system interpreter: the stub already sees its site-packages
    paths = sysconfig.get_paths()
    site = list(dict.fromkeys([paths["purelib"], paths["platlib"]]))
    return {
        "PATH": _join_paths([str(Path(sys.prefix) / "bin")], "PATH"),
        "PYTHONPATH": _join_paths(site, "PYTHONPATH"),
    }


def _join_paths(first: list[str], variable: str) -> str:
    """`first` followed by the current value of an os.pathsep-separated variable."""
    current = os.environ.get(variable)
    return os.pathsep.join(first + ([current] if current else []))


def _wheel_tritonserver() -> TritonBinary:
    """The tritonserver of the nvidia-pytriton wheel, prepared once in our cache folder."""
    spec = importlib.util.find_spec("pytriton")  # finds the folder without importing pytriton
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "tritonserver not found: put it on PATH, use the NGC image, or install the wheel "
            "(pip install 'tokenstream[server]', i.e. nvidia-pytriton)"
        )
    source = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    version = importlib.metadata.version("nvidia-pytriton")
    target = cache_dir() / f"tritonserver-{version}-py{python}"
    if not (target / "backends" / "python" / "triton_python_backend_stub").is_file():
        _copy_wheel_server(source, target, python)
    libs = [sysconfig.get_config_var("LIBDIR"), str(source.parent.parent / "nvidia_pytriton.libs")]
    env = _python_env() | {"LD_LIBRARY_PATH": _join_paths(libs, "LD_LIBRARY_PATH")}
    return TritonBinary(target / "bin" / "tritonserver", target / "backends", env)


def _copy_wheel_server(source: Path, target: Path, python: str) -> None:
    """Copy the wheel's server tree with our Python's stub; atomic, so racing copies are safe."""
    stub = source / "python_backend_stubs" / python / "triton_python_backend_stub"
    if not stub.is_file():
        raise FileNotFoundError(f"nvidia-pytriton has no python backend stub for Python {python}")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{target.name}.tmp-", dir=target.parent))
    try:
        tree = staging / "tree"
        skip_stubs = shutil.ignore_patterns("python_backend_stubs")
        shutil.copytree(source, tree, symlinks=True, ignore=skip_stubs)
        shutil.copy2(stub, tree / "backends" / "python" / stub.name)
        if target.exists():  # a half-made copy from an older layout: replace it
            shutil.rmtree(target)
        try:
            os.rename(tree, target)
        except OSError:
            if not (target / "bin" / "tritonserver").is_file():
                raise  # not a concurrent copy that won the race: a real failure
    finally:
        shutil.rmtree(staging, ignore_errors=True)
