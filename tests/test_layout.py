"""The layout rules of docs/layout.md: imports point one way, and each wire fact has one home.

Checked statically over the product's sources (streaming_backend/, clients/, repository/) and, for
the light modules, by importing them in a fresh interpreter and looking at what got loaded.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from streaming_backend import wire
from streaming_backend.sampling import request_keys

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("streaming_backend", "clients", "repository")
TRANSPORTS = ("tritonclient", "websockets", "grpc", "triton_python_backend_utils", "clients")
HEAVY = ("torch", "transformers", "numpy", "clients", "tritonclient", "websockets", "grpc")
# Names the chat model's tensors share with other protocols' JSON (OpenAI, the bridge's
# websocket frames): a literal of these is not necessarily a tensor name.
SHARED_WORDS = {
    wire.STREAM,
    wire.MESSAGES,
    wire.TOOLS,
    wire.FINISH_REASON,
    wire.LOGPROBS,
    wire.TIMING,
    wire.SYSTEM_FINGERPRINT,
}


def product_files() -> list[Path]:
    """Every Python source of the product (not tests, not the virtual environment)."""
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def module_name(path: Path) -> str:
    """Dotted name of a product file (repository/chat/1/model.py -> repository.chat.1.model)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` (annotations only: never imported at run time)."""
    return {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")
        for stmt in node.body
        for inner in ast.walk(stmt)
    }


def imports_of(path: Path, type_checking: bool = False) -> set[str]:
    """Absolute module names a file imports at run time, at any depth of its code (and under
    `if TYPE_CHECKING:` too with `type_checking`)."""
    names: set[str] = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = set() if type_checking else _type_checking_only(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def top(name: str) -> str:
    return name.split(".")[0]


def is_core(path: Path) -> bool:
    return path.relative_to(ROOT).parts[0] == "streaming_backend"


def test_the_core_imports_no_transport_and_no_client():
    """No module of streaming_backend imports clients/, tritonclient, websockets or Triton."""
    offenders = {
        str(p.relative_to(ROOT)): sorted(n for n in imports_of(p) if top(n) in TRANSPORTS)
        for p in product_files()
        if is_core(p)
    }
    assert {k: v for k, v in offenders.items() if v} == {}


# Modules that clients and the launcher import: standard library only (numpy at most for none).
LIGHT_MODULES = (
    "streaming_backend.wire",
    "streaming_backend.sampling.request_keys",
    "streaming_backend.sampling.settings",
    "streaming_backend.configuration.models",
    "streaming_backend.paths",
    "streaming_backend.model.hardware",
    "streaming_backend.launcher",
    "streaming_backend.launcher.binary",
    "streaming_backend.launcher.processes",
    "streaming_backend.launcher.repository",
    "streaming_backend.launcher.server",
    "streaming_backend.launcher.control",
    "streaming_backend.launcher.watch",
    "streaming_backend.launcher.supervisor",
    "streaming_backend.launcher.health",
    "streaming_backend.launcher.startup",
)


def test_the_launcher_and_the_wire_contract_stay_light():
    """Imported in a fresh interpreter, the launcher, settings and wire load nothing heavy."""
    code = (
        "import importlib, sys\n"
        f"for name in {LIGHT_MODULES!r}: importlib.import_module(name)\n"
        f"print(sorted({{m for m in sys.modules if m.split('.')[0] in {HEAVY!r}}}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


def _graph(type_checking: bool = False) -> dict[str, set[str]]:
    """Import graph between the product's own modules."""
    modules = {module_name(p): p for p in product_files()}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for imported in imports_of(path, type_checking):
            # `from a.b import c` names a.b.c (a module or an attribute): keep the longest module
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_in_a_circle():
    """The product's modules form no import cycle (a package __init__ and its modules included)."""
    graph = _graph()
    # a package's __init__ importing its own submodules is how packages expose names: not a cycle
    for name in graph:
        graph[name] = {t for t in graph[name] if not (name + ".").startswith(t + ".")}
    assert _cycles(graph) == []


# ---- the layers: which packages each package may import


def _core(*names: str) -> set[str]:
    return {f"streaming_backend.{name}" for name in names}


# What every package of the core may import: the wire contract and the few facts beside it.
SHARED = _core("wire", "errors", "events", "paths", "heap")
# One row per package (a module flat at the top of streaming_backend/ counts as one): the packages
# its modules may import besides their own, at run time or under TYPE_CHECKING. The rows are read
# bottom up and form no circle (test_the_layers_form_no_circle), so an import that no row allows
# runs back up or sideways. A new package needs its row.
MAY_IMPORT: dict[str, set[str]] = {
    # the core
    "streaming_backend.wire": set(),  # the wire contract: standard library only
    "streaming_backend.paths": set(),
    "streaming_backend.heap": set(),  # the C heap's free memory back to the system
    "streaming_backend.errors": _core("wire"),
    "streaming_backend.events": _core("wire", "errors"),
    # the C kernels: their build and bindings (the build reads the cache folder, paths)
    "streaming_backend.kernels": SHARED,
    "streaming_backend.model": SHARED | _core("kernels"),  # loading, the hardware, the KV caches
    "streaming_backend.configuration": SHARED | _core("model"),  # model.hardware's dtype names
    "streaming_backend.launcher": SHARED | _core("model", "configuration"),
    "streaming_backend.sampling": SHARED | _core("kernels"),  # the greedy pick
    "streaming_backend.forward": SHARED | _core("kernels", "model", "configuration"),
    "streaming_backend.prompts": SHARED | _core("model", "sampling"),
    "streaming_backend.steps": SHARED | _core("model", "configuration", "sampling", "forward"),
    "streaming_backend.engine": SHARED
    | _core("model", "configuration", "sampling", "prompts", "steps"),
    "streaming_backend.dialogue": SHARED
    | _core("model", "configuration", "sampling", "prompts", "steps"),
    "streaming_backend.adapter": SHARED | _core("sampling", "engine"),
    # the clients: the core's light contract, the engine only for the in-process benchmark
    "clients.library": _core("wire"),
    "clients.bridge": {"clients.library"} | _core("wire", "sampling", "configuration"),
    "clients.stress": {"clients.library"} | _core("wire", "sampling", "configuration", "prompts"),
    "clients.bench": {"clients.library", "clients.bridge"}
    | _core("wire", "events", "sampling", "configuration", "prompts", "model", "engine"),
    "clients.cli": {"clients.library", "clients.bridge"}
    | _core("wire", "paths", "sampling", "configuration", "launcher"),
}
# the Triton models: adapters over any of the core (only the dialogue model's imports dialogue/:
# test_only_the_dialogue_model_imports_its_package)
MAY_IMPORT["repository"] = {name for name in MAY_IMPORT if name.startswith("streaming_backend.")}
# Imports that run back up today, each left for issue 48 (the model and forward packages are
# being reworked there): (importing module, the package it should not import). The list only
# shrinks: an import not in it fails, and so does a line whose import has gone.
KNOWN_BACK_ARROWS = {
    # issue 48: the numerics read the forward's kernel build and quant formats, and the Steps
    ("streaming_backend.model.numerics", "streaming_backend.forward"),
    ("streaming_backend.model.numerics", "streaming_backend.steps"),
    # issue 48: the weight cache converts through the forward's weight conversion and file
    ("streaming_backend.model.weight_cache", "streaming_backend.forward"),
}


def layer(module: str) -> str | None:
    """The row of MAY_IMPORT a module belongs to (None: a top-level package's own __init__)."""
    parts = module.split(".")
    if parts[0] == "repository":
        return "repository"
    return ".".join(parts[:2]) if len(parts) > 1 else None


def _layer_arrows() -> set[tuple[str, str]]:
    """(module, the other layer it imports), TYPE_CHECKING imports included."""
    return {
        (a, layer(b))
        for a, targets in _graph(type_checking=True).items()
        for b in targets
        if layer(b) is not None and layer(b) != layer(a)
    }


def test_every_package_has_its_row():
    """Each package of the product, and each module flat at the top of the core, has a row in
    MAY_IMPORT (a new one is placed in the layers on purpose), and every row names one."""
    layers = {layer(module_name(p)) for p in product_files()} - {None}
    assert sorted(layers - set(MAY_IMPORT)) == []
    assert sorted(set(MAY_IMPORT) - layers) == []


def test_the_layers_form_no_circle():
    """The rows of MAY_IMPORT form no circle: read bottom up, each imports only what is below."""
    assert _cycles(MAY_IMPORT) == []


def test_no_import_runs_back_up():
    """Every import from one package into another is one its row allows (TYPE_CHECKING
    imports included): no import runs back up or sideways, but the known ones of issue 48."""
    against = sorted(
        (a, b)
        for a, b in _layer_arrows()
        if b not in MAY_IMPORT.get(layer(a), set()) and (a, b) not in KNOWN_BACK_ARROWS
    )
    assert against == []


def test_the_known_back_arrows_are_still_there():
    """A known back-arrow that is gone leaves KNOWN_BACK_ARROWS (so it cannot come back)."""
    assert sorted(KNOWN_BACK_ARROWS - _layer_arrows()) == []


def test_the_core_stays_small_at_its_top():
    """At most 10 modules sit flat at the top of streaming_backend/ (the rest in its packages)."""
    flat = [p.name for p in (ROOT / "streaming_backend").glob("*.py") if p.name != "__init__.py"]
    assert len(flat) <= 10, sorted(flat)


def test_no_module_of_the_core_is_over_600_lines():
    """A module of streaming_backend/ past 600 lines does several jobs: split it by job."""
    long = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / "streaming_backend").rglob("*.py")
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > 600
    }
    assert long == {}


def test_only_the_dialogue_model_imports_its_package():
    """streaming_backend/dialogue/ is the dialogue model's own code: the engine, its steps and the
    rest of the core never import it (it imports them); its one user is the model's adapter."""
    graph = _graph()
    users = sorted(
        a
        for a, targets in graph.items()
        if not a.startswith("streaming_backend.dialogue")
        for b in targets
        if b.startswith("streaming_backend.dialogue")
    )
    assert set(users) == {"repository.dialogue_model.1.model"}


def _string_literals(path: Path) -> list[tuple[int, str]]:
    """(line, value) of every string constant that is not a docstring."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
    ]


TENSOR_NAMES = (set(wire.INPUT_NAMES) | set(wire.OUTPUT_NAMES)) - SHARED_WORDS
# Literals that spell a tensor name by coincidence, each with its reason.
NOT_TENSOR_NAMES = {
    ("clients/library/request.py", "input_ids"): "GenerateRequest's own field (__post_init__)",
    ("streaming_backend/prompts/__init__.py", "input_ids"): "the Hugging Face tokenizer's output",
}


def _wire_literals(path: Path, words: set[str], allowed: dict) -> list[tuple[int, str]]:
    """The literals of `path` (not wire.py) that spell one of `words`, less the allowed ones."""
    if path == ROOT / "streaming_backend" / "wire.py":
        return []
    where = str(path.relative_to(ROOT))
    return [
        (line, v) for line, v in _string_literals(path) if v in words and (where, v) not in allowed
    ]


@pytest.mark.parametrize("path", product_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_tensor_name_literal_outside_the_wire_contract(path):
    """Tensor names are spelled only in streaming_backend/wire.py; everyone else imports them."""
    assert _wire_literals(path, TENSOR_NAMES, NOT_TENSOR_NAMES) == []


# The home of the sampling keys, and wire.py, whose dialogue_model tensors temperature and
# repetition_penalty are spelled as the keys are (their types differ).
KEY_HOMES = ("streaming_backend/sampling/request_keys.py", "streaming_backend/wire.py")


@pytest.mark.parametrize(
    "path",
    [p for p in product_files() if is_core(p) and str(p.relative_to(ROOT)) not in KEY_HOMES],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_no_sampling_key_literal_in_the_core(path):
    """The core spells no sampling_parameters key: the rest uses request_keys' constants."""
    found = [(line, v) for line, v in _string_literals(path) if v in request_keys.SAMPLING_KEYS]
    assert found == []


# Timing keys and error codes: spelled in wire.py only. Finish reasons are FinishReason's values,
# but their words ("stop", "error", "cancelled", also an error code) are too common in other JSON
# to check as literals.
WIRE_WORDS = (set(wire.TIMING_KEYS) | set(wire.ERROR_CODES)) - {r.value for r in wire.FinishReason}
# Literals that spell one of those by coincidence, each with its reason.
NOT_WIRE_WORDS = {
    ("clients/bench/report.py", "cached_tokens"): "a summary's figure, named after the timing key",
    ("clients/bench/summary.py", "cached_tokens"): "a summary's figure, named after the timing key",
}


@pytest.mark.parametrize("path", product_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_timing_key_or_error_code_literal_outside_the_wire_contract(path):
    """Timing keys and error codes are spelled only in wire.py; everyone else imports them."""
    assert _wire_literals(path, WIRE_WORDS, NOT_WIRE_WORDS) == []


# ---- the tests mirror the packages

TESTS = ROOT / "tests"
NOT_MIRRORED = {"test_chaos"}  # the chaos suite crosses packages by design (pytest -m chaos)


def mirrored(folder: Path) -> Path:
    """The product folder a test folder mirrors: tests/test_clients/test_bridge -> clients/bridge
    (tests/test_repository -> repository/)."""
    parts = folder.relative_to(TESTS).parts
    return ROOT.joinpath(*(part.removeprefix("test_") for part in parts))


def test_every_package_has_its_test_folder():
    """Each package and subpackage of the product has a test folder of the same path."""
    packages = {
        p.parent
        for top in ("streaming_backend", "clients")
        for p in (ROOT / top).rglob("__init__.py")
    }
    for package in sorted(packages):
        parts = package.relative_to(ROOT).parts
        folder = TESTS.joinpath(*(f"test_{part}" for part in parts))
        assert folder.is_dir(), f"{package.relative_to(ROOT)} has no tests folder {folder}"


def test_every_test_folder_mirrors_a_product_folder():
    """A test folder names a folder of the product (so tests are found where their code is)."""
    folders = {p.parent for p in TESTS.rglob("test_*.py")} - {TESTS}
    for folder in sorted(folders):
        if folder.relative_to(TESTS).parts[0] in NOT_MIRRORED:
            continue
        assert mirrored(folder).is_dir(), f"{folder} mirrors no product folder"


def test_test_modules_have_unique_names():
    """pytest imports test modules by their file name: two with one name would collide."""
    names = [p.name for p in TESTS.rglob("test_*.py")]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
