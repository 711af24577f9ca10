"""The runtime copy of a model repository, with the `parameters` of each config.pbtxt rewritten.

Triton reads a model's settings from its config.pbtxt; the launcher never edits the originals but
serves a temporary copy whose config files carry the chosen values and whose other entries
(version folders, files) are symlinks to the source. A parameter is set on the models that take
it: those whose table in streaming_backend/configuration/models.py has it, or whose config.pbtxt
declares it (a repository of your own). One that no model takes is refused, so a misspelt key
fails at start instead of being ignored.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

from streaming_backend.configuration.models import TABLES

_STRING = r'"(?:[^"\\\n]|\\.)*"'  # a protobuf text-format string literal
_COMMENT = re.compile(_STRING + r"|#[^\n]*")
_ENTRY = re.compile(
    r"key\s*:\s*(" + _STRING + r")\s*,?\s*value\s*:\s*\{\s*string_value\s*:\s*(" + _STRING + r")"
)


def mask_comments(text: str) -> str:
    """`text` with every # comment blanked out, same length, so offsets stay valid."""
    return _COMMENT.sub(lambda m: m.group() if m.group()[0] == '"' else " " * len(m.group()), text)


def _pbtxt_string(value: str) -> str:
    """A protobuf text-format string literal."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def _unquote(literal: str) -> str:
    """The value of a string literal written by _pbtxt_string (its inverse)."""
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), literal[1:-1])


def read_parameters(config_text: str) -> dict[str, str]:
    """The string `parameters` of a config.pbtxt, key -> value; commented-out entries ignored."""
    # the mask blanks comments only, so the literals found in it are the file's own
    entries = _ENTRY.finditer(mask_comments(config_text))
    return {_unquote(m.group(1)): _unquote(m.group(2)) for m in entries}


def patch_parameters(config_text: str, mapping: Mapping[str, str]) -> str:
    """Set string `parameters` entries of a config.pbtxt: replace a key's value or append it."""
    for key, value in mapping.items():
        pattern = re.compile(
            r"(key\s*:\s*" + re.escape(_pbtxt_string(key)) + r"\s*,?\s*"
            r"value\s*:\s*\{\s*string_value\s*:\s*)" + _STRING
        )
        # match on a comment-free copy so a commented-out example is never taken for the entry
        matches = list(pattern.finditer(mask_comments(config_text)))
        for match in reversed(matches):
            start = match.start() + len(match.group(1))
            config_text = config_text[:start] + _pbtxt_string(value) + config_text[match.end() :]
        if not matches:
            entry = f"parameters {{ key: {_pbtxt_string(key)} "
            entry += f"value: {{ string_value: {_pbtxt_string(value)} }} }}\n"
            config_text = config_text.rstrip("\n") + "\n" + entry
    return config_text


def make_runtime_repository(
    source: Path,
    parameters: Mapping[str, str],
    rewrites: Mapping[str, Callable[[str], str]] | None = None,
) -> Path:
    """A temp copy of a model repository with `parameters` set in every model's config.pbtxt
    and `rewrites[model]` applied to that model's."""
    if not source.is_dir():
        raise FileNotFoundError(f"model repository {source} does not exist")
    runtime = Path(tempfile.mkdtemp(prefix="tokenstream-repo-"))
    taken: set[str] = set()
    try:
        for model_dir in sorted(source.iterdir()):
            if model_dir.is_dir() and not model_dir.name.startswith("."):
                rewrite = (rewrites or {}).get(model_dir.name, _unchanged)
                own = _taken_by(model_dir, parameters)
                _copy_model(model_dir, runtime / model_dir.name, own, rewrite)
                taken |= own.keys()
        _check_all_taken(parameters, taken)
    except BaseException:
        shutil.rmtree(runtime, ignore_errors=True)
        raise
    return runtime


def _taken_by(model_dir: Path, parameters: Mapping[str, str]) -> dict[str, str]:
    """The parameters this model takes: in its table, or declared by its config.pbtxt."""
    config = model_dir / "config.pbtxt"
    declared = read_parameters(config.read_text()) if config.is_file() else {}
    table = TABLES.get(model_dir.name)
    return {
        k: v for k, v in parameters.items() if k in declared or (table is not None and k in table)
    }


def _check_all_taken(parameters: Mapping[str, str], taken: set[str]) -> None:
    """ValueError naming the parameters no model of the repository takes."""
    unknown = sorted(set(parameters) - taken)
    if unknown:
        known = {table.model: ", ".join(p.key for p in table) for table in TABLES.values()}
        listing = "; ".join(f"{model}: {keys}" for model, keys in known.items())
        raise ValueError(
            f"no model of the repository takes parameter(s) {', '.join(unknown)} ({listing})"
        )


def _unchanged(text: str) -> str:
    return text


def _copy_model(
    source: Path, target: Path, parameters: Mapping[str, str], rewrite: Callable[[str], str]
) -> None:
    """Patch config.pbtxt into `target`; link everything else (version folders, files)."""
    target.mkdir()
    for entry in source.iterdir():
        if entry.name == "config.pbtxt":
            text = rewrite(patch_parameters(entry.read_text(), parameters))
            (target / entry.name).write_text(text)
        else:
            (target / entry.name).symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
