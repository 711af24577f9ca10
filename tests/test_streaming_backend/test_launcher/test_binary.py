"""Tests for streaming_backend/launcher/binary.py: where tritonserver comes from."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from streaming_backend.launcher.binary import NGC_TRITONSERVER, find_tritonserver


def test_an_explicit_binary_that_is_missing_is_an_error(tmp_path: Path) -> None:
    """An explicit path that holds no binary fails clearly instead of falling back."""
    with pytest.raises(FileNotFoundError, match="no tritonserver at"):
        find_tritonserver(tmp_path / "bin" / "tritonserver")


def test_an_explicit_binary_has_its_backends_beside_it(tmp_path: Path) -> None:
    """<root>/bin/tritonserver comes with <root>/backends, the installed layout."""
    binary = tmp_path / "bin" / "tritonserver"
    binary.parent.mkdir()
    binary.write_text("")
    found = find_tritonserver(binary)
    assert (found.binary, found.backend_dir) == (binary, tmp_path / "backends")


def test_the_wheel_server_is_prepared_in_the_cache_folder(monkeypatch, tmp_path: Path) -> None:
    """The nvidia-pytriton server is copied once under $TOKENSTREAM_CACHE, with our stub."""
    if importlib.util.find_spec("pytriton") is None:
        pytest.skip("needs the nvidia-pytriton wheel")
    if shutil.which("tritonserver") or NGC_TRITONSERVER.is_file():
        pytest.skip("a tritonserver on PATH or in /opt wins over the wheel")
    monkeypatch.setenv("TOKENSTREAM_CACHE", str(tmp_path / "cache"))
    found = find_tritonserver()
    assert found.binary.is_file() and found.binary.is_relative_to(tmp_path / "cache")
    assert (found.backend_dir / "python" / "triton_python_backend_stub").is_file()
    inode = found.binary.stat().st_ino
    assert find_tritonserver().binary.stat().st_ino == inode  # the second time reuses the copy
