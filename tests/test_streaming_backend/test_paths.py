"""Tests for streaming_backend/paths.py: one cache folder, one repository folder."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import REPO_ROOT

from streaming_backend.paths import cache_dir, default_repository

PRODUCT_FOLDERS = ("streaming_backend", "clients", "repository")


def test_the_cache_variable_wins(monkeypatch, tmp_path: Path) -> None:
    """$TOKENSTREAM_CACHE is the cache folder itself, whatever XDG_CACHE_HOME says."""
    monkeypatch.setenv("TOKENSTREAM_CACHE", str(tmp_path / "ours"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "ours"


def test_the_cache_follows_xdg_then_home(monkeypatch, tmp_path: Path) -> None:
    """Without it: $XDG_CACHE_HOME/tokenstream, else ~/.cache/tokenstream."""
    monkeypatch.delenv("TOKENSTREAM_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "tokenstream"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "tokenstream"


def test_the_repository_is_the_checkouts_unless_the_variable_names_one(monkeypatch, tmp_path):
    """The checkout's repository/ by default; $TOKENSTREAM_REPOSITORY (installed copies) wins."""
    monkeypatch.delenv("TOKENSTREAM_REPOSITORY", raising=False)
    assert default_repository() == REPO_ROOT / "repository"
    monkeypatch.setenv("TOKENSTREAM_REPOSITORY", str(tmp_path))
    assert default_repository() == tmp_path


def test_no_other_module_decides_where_the_cache_is() -> None:
    """Only paths.py names a cache variable or ~/.cache: loading and the launcher ask it."""
    spelled = re.compile(r"TOKENSTREAM_CACHE|XDG_CACHE_HOME|\"\.cache\"")
    offenders = [
        str(path.relative_to(REPO_ROOT))
        for folder in PRODUCT_FOLDERS
        for path in (REPO_ROOT / folder).rglob("*.py")
        if path.name != "paths.py" and spelled.search(path.read_text())
    ]
    assert offenders == []


def test_the_docker_image_keeps_the_cache_in_its_volume() -> None:
    """The image points TOKENSTREAM_CACHE into /cache, the folder k8s.yaml mounts a volume on."""
    dockerfile = (REPO_ROOT / "docker" / "Dockerfile").read_text()
    match = re.search(r"\bTOKENSTREAM_CACHE=(\S+)", dockerfile)
    assert match is not None and Path(match[1]).is_relative_to("/cache")
    assert "mountPath: /cache" in (REPO_ROOT / "docker" / "k8s.yaml").read_text()
