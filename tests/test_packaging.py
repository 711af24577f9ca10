"""pyproject.toml's packaging: a wheel built from the checkout holds every file the packages need,
and installed elsewhere, it builds and loads the C kernels from its own copy of their sources.

The wheel is built from a copy of the checkout (pip wheel, no build isolation: nothing
downloaded), so the build leaves nothing in the checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("streaming_backend", "clients")  # what pyproject's packages.find includes
SOURCES = ("pyproject.toml", "README.md", *PACKAGES)  # what building the wheel reads
BUILD_LEFTOVERS = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The project's wheel, built from a copy of the checkout."""
    source = tmp_path_factory.mktemp("source")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=BUILD_LEFTOVERS)
        else:
            shutil.copy2(ROOT / name, source / name)
    out = tmp_path_factory.mktemp("wheel")
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    subprocess.run(
        [*command, "--quiet", "--wheel-dir", str(out), str(source)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (built,) = out.glob("tokenstream-*.whl")
    return built


def package_data() -> set[str]:
    """The packages' files that are not Python sources (kernels' C, page, prompts), as paths."""
    return {
        str(path.relative_to(ROOT))
        for package in PACKAGES
        for path in (ROOT / package).rglob("*")
        if path.is_file() and path.suffix not in (".py", ".pyc") and "__pycache__" not in path.parts
    }


def test_the_wheel_holds_every_file_of_the_packages(wheel):
    """Each non-Python file under the packages (C sources and headers, the page, the shipped
    prompts) is in the wheel: one left out of package-data fails here, not on a user's install."""
    with zipfile.ZipFile(wheel) as archive:
        shipped = set(archive.namelist())
    # the check sees headers, the ISA files among them
    assert "streaming_backend/kernels/csrc/isa/avx512.h" in package_data()
    assert sorted(package_data() - shipped) == []


KERNELS = """
import sys
from pathlib import Path
from streaming_backend.kernels import attention, build, greedy, matmul, team
assert not Path(build.__file__).is_relative_to(sys.argv[1]), build.__file__
loaded = build.library()
assert loaded is not None, "the kernels did not build (see the warning above)"
assert attention.attention_kernel() is not None and matmul.matmul_kernel() is not None
assert greedy.greedy_kernel() is not None and team.stats() is not None
print(build.__file__, loaded[1], loaded[0]._name)
"""


@pytest.mark.slow  # a fresh build of the kernels: 15-30 s on a busy 2-core CPU
def test_an_installed_wheel_builds_and_loads_the_kernels(wheel, tmp_path):
    """In a fresh venv that borrows this one's torch, the installed package (not the checkout)
    compiles its C kernels from the sources it ships, loads them and binds every kernel."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # torch and the other dependencies from this environment, after the venv's own packages (a
    # path line: this environment's .pth files, its editable install among them, are not read)
    borrowed = {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}
    Path(site, "borrowed.pth").write_text("\n".join(sorted(borrowed)) + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps"]
        + [str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    environment = os.environ | {"TOKENSTREAM_CACHE": str(tmp_path / "cache")}  # a fresh build
    # -I: neither the working directory nor PYTHONPATH can put the checkout on the path
    done = subprocess.run(
        [str(python), "-I", "-c", KERNELS, str(ROOT)],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    module, _, library = done.stdout.split()
    assert Path(module).is_relative_to(site)
    assert Path(library).is_relative_to(tmp_path / "cache")
