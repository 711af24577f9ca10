"""The C kernels' build (csrc/): one table of variants, each an ISA's flags, the CPU features it
needs and its header of primitives (csrc/isa/); built once with the machine's C compiler into one
library, kept in the cache folder, loaded with ctypes (the bindings beside this module take it).

    loaded = build.library()    # (ctypes.CDLL, variant name), None where it cannot be built

The library's name carries a digest of every source and header (the ISA files too), the flags and
the compiler, so an edited source or a new compiler builds a new one; a build goes to a temporary
name and is renamed into place, so processes building at once (a server's stubs, parallel tests)
never load half a file. `scripts/setup.sh` builds it ahead (`python -m
streaming_backend.kernels.build`), so a server does not compile on its first request.

A new ISA is one header in csrc/isa/ defining the primitives csrc/isa.h lists, and one row of
VARIANTS.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NamedTuple

from streaming_backend.paths import cache_dir

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
AMX_VARIABLE = "TOKENSTREAM_AMX"  # 0: the quantized matmuls leave AMX alone
COMPILER_VARIABLE = "CC"  # the C compiler, as make reads it; else gcc, else cc
# -ffp-contract=off: no multiply and add fused unless the source says so, so every copy of an
# inlined function rounds alike (a row's numbers must not depend on the tile it falls in)
BASE_FLAGS = ("-O3", "-fPIC", "-shared", "-pthread", "-fno-math-errno", "-ffp-contract=off")
X86 = ("x86_64", "AMD64")  # platform.machine() of an x86-64 CPU
X86_AVX2_FLAGS = ("-mavx2", "-mfma", "-mf16c")  # every CPU kind here has them
AVX2_NEEDS = frozenset({"avx2", "fma", "f16c"})
# AMX's tile multiplies where the CPU has them (asked at run time, csrc/isa/amx.h's amx_use): the
# same block dots, so the same bits, from the same build; left out where the compiler does not
# know them (gcc before 11), so an older compiler still builds the AVX-512 kernels
AMX_FLAGS = ("-mamx-tile", "-mamx-int8")
AMX_HEADER, NO_AMX_HEADER = "isa/amx.h", "isa/no_amx.h"
# ATEN_CPU_CAPABILITY values below AVX-512: they keep torch's kernels off it, and ours (variant());
# model/hardware.py reads them too (bfloat16 in software)
ATEN_BELOW_AVX512 = ("default", "avx2", "no avx")


class Variant(NamedTuple):
    """One build of the kernels: its ISA's primitives (a header of csrc/isa/), the compiler flags
    they need, and the CPU that runs them (/proc/cpuinfo flags, platform.machine() names)."""

    header: str
    flags: tuple[str, ...]
    needs: frozenset[str]
    machines: tuple[str, ...] = ()  # () for any
    amx: bool = False  # AMX's tiles added where the compiler takes AMX_FLAGS


# Best first: a CPU takes the first row it runs. A variant's name is part of the numerics
# (model/numerics.py: c-avx512, c-avx2, c-generic).
VARIANTS: dict[str, Variant] = {
    # AVX-512 with VNNI: the quantized matmuls' integer dot products, two blocks an instruction,
    # and the attention's sums 16 lanes a register (the same sums as the AVX2 build, so the same
    # bits); AMX's tiles where the CPU has them
    "avx512": Variant(
        "isa/avx512.h",
        (*X86_AVX2_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512vnni"),
        AVX2_NEEDS | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"},
        X86,
        amx=True,
    ),
    "avx2": Variant("isa/avx2.h", X86_AVX2_FLAGS, AVX2_NEEDS, X86),
    "generic": Variant("isa/generic.h", (), frozenset()),  # plain C: any CPU
}


def variant(environ: Mapping[str, str] = os.environ) -> str:
    """The build this CPU takes: the first row of VARIANTS whose needs /proc/cpuinfo shows, on
    its machine. ATEN_CPU_CAPABILITY=avx2 (or lower) keeps an AVX-512 CPU off the rows that need
    AVX-512, as it keeps torch's kernels: CI's run under the AVX2 caps tests that build here."""
    flags = cpu_flags()
    capped = environ.get("ATEN_CPU_CAPABILITY", "").lower() in ATEN_BELOW_AVX512
    for name, row in VARIANTS.items():
        if row.machines and platform.machine() not in row.machines:
            continue
        if row.needs <= flags and not (capped and "avx512f" in row.needs):
            return name
    return "generic"


def cpu_flags() -> set[str]:
    """The words of /proc/cpuinfo (its flags among them); empty where it cannot be read."""
    try:
        return set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return set()


def compiler() -> str | None:
    """$CC, else gcc, else cc, as found on PATH; None when there is none."""
    found = (
        shutil.which(name) for name in (os.environ.get(COMPILER_VARIABLE), "gcc", "cc") if name
    )
    return next((path for path in found if path), None)


def sources(csrc: Path = CSRC) -> list[Path]:
    """The C files compiled into the library (csrc/*.c)."""
    return sorted(csrc.glob("*.c"))


def library_path(cc: str, kind: str) -> Path:
    """Where the library built from these sources with `cc` for `kind` lives: its name's digest
    covers every source and header under csrc/ (by path and bytes), the flags and the compiler."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256()
    for source in sorted(p for p in CSRC.rglob("*") if p.suffix in (".c", ".h")):
        digest.update(source.relative_to(CSRC).as_posix().encode())
        digest.update(source.read_bytes())
    for part in (" ".join(flags(kind, cc)).encode(), version.encode()):
        digest.update(part)
    return cache_dir() / "native" / f"tokenstream_kernels-{kind}-{digest.hexdigest()[:12]}.so"


def flags(kind: str, cc: str | None = None) -> tuple[str, ...]:
    """The compiler flags of a build for `kind`: its row's, its ISA header and AMX's (with `cc`:
    AMX's only if it takes them)."""
    row = VARIANTS[kind]
    amx = row.amx and (cc is None or accepts(cc, AMX_FLAGS))
    return (
        *BASE_FLAGS,
        *row.flags,
        *(AMX_FLAGS if amx else ()),
        f'-DTS_ISA_HEADER="{row.header}"',
        f'-DTS_AMX_HEADER="{AMX_HEADER if amx else NO_AMX_HEADER}"',
    )


@functools.cache
def accepts(cc: str, options: tuple[str, ...]) -> bool:
    """Whether `cc` compiles an empty C file with these options."""
    command = [cc, *options, "-x", "c", "-c", "-o", os.devnull, "-"]
    return subprocess.run(command, input="", capture_output=True, text=True).returncode == 0


def build(cc: str, kind: str) -> Path:
    """Build the library unless it is there; return its path (CalledProcessError on failure)."""
    target = library_path(cc, kind)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=target.name + ".", dir=target.parent)
    os.close(fd)
    try:
        compile_library(cc, kind, Path(partial))
        os.replace(partial, target)  # atomic: a concurrent build renames the same bytes
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def compile_library(cc: str, kind: str, target: Path, csrc: Path = CSRC) -> None:
    """The C files of `csrc` (these sources, or another revision's: scripts/kernel_ab.py)
    compiled with `kind`'s flags into target (CalledProcessError on failure)."""
    command = [cc, *flags(kind, cc), "-o", str(target), *map(str, sources(csrc)), "-lm"]
    subprocess.run(command, check=True, capture_output=True, text=True)


_loaded_caches: list[Callable[[], None]] = []  # the cache_clear of `library` and of each binding


def per_library(fn):
    """fn() cached like functools.cache, until forget() (a binding made from library())."""
    cached = functools.cache(fn)
    _loaded_caches.append(cached.cache_clear)
    return cached


@per_library
def library() -> tuple[ctypes.CDLL, str] | None:
    """The kernels' library and its variant, built if needed; None (with a warning saying why)
    where it cannot be: the compact forward then attends with torch, one call per token, and
    runs its quantized weights on torch's kernels."""
    cc = compiler()
    if cc is None:
        log.warning("no C compiler (gcc, cc or $CC): the forward's kernels run on torch, slower")
        return None
    kind = variant()
    try:
        return ctypes.CDLL(str(build(cc, kind))), kind
    except subprocess.CalledProcessError as exc:
        log.warning("building the C kernels failed, the forward runs on torch: %s", exc.stderr)
    except OSError as exc:
        log.warning("loading the C kernels failed, the forward runs on torch: %s", exc)
    return None


def forget() -> None:
    """Forget the loaded library and every binding made from it, so the next call looks for a
    compiler again (tests)."""
    for clear in _loaded_caches:
        clear()


def main() -> int:
    """Build the kernels now (scripts/setup.sh); exit 1 if they cannot be built."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    loaded = library()
    if loaded is None:
        return 1
    print(f"C kernels: {loaded[1]}, {library_path(compiler(), loaded[1])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
