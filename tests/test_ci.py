""".ci/run runs every test: each combination of pyproject.toml's markers (none included) is
selected by one of its pytest steps, and its first step is the README's test command.

Read statically: .ci/run's `step LABEL LIMIT_S PYTEST_ARGS...` lines and pyproject's addopts (as
pytest reads them), each step's marker expression evaluated with pytest's own parser. A step that
narrows its run otherwise (a path, -k, --deselect, ...) covers nothing here: it may leave tests
out that no marker names.
"""

from __future__ import annotations

import itertools
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
from _pytest.mark.expression import Expression

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own dependency
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
CI_RUN = ROOT / ".ci" / "run"
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# pytest options that take a value (short ones may also glue it on: -mchaos, -rfE)
VALUED = {"-m", "-k", "-p", "-c", "-o", "-W", "-r", "--deselect", "--ignore", "--ignore-glob"}
VALUED |= {"--timeout", "--tb", "--color", "--durations", "--maxfail", "--rootdir", "--basetemp"}
VALUED |= {"--junitxml", "--junit-xml", "--override-ini", "--log-level"}
# options that run fewer tests than the marker expression selects
NARROWING = {"-k", "--deselect", "--ignore", "--ignore-glob", "--lf", "--last-failed"}
NARROWING |= {"--sw", "--stepwise", "--co", "--collect-only"}


@dataclass(frozen=True)
class Step:
    """One `step` line of .ci/run."""

    label: str
    args: tuple[str, ...]  # pytest's arguments


def logical_lines(script: str) -> list[str]:
    """A shell script's lines, backslash continuations joined."""
    return script.replace("\\\n", " ").splitlines()


def words(line: str) -> list[str]:
    """A shell line's words as the shell splits them (quotes removed, comments dropped), without
    the VAR=value assignments in front of the command."""
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError:  # a line of a multi-line string: no command of ours
        return []
    while tokens and ASSIGNMENT.match(tokens[0]):
        tokens.pop(0)
    return tokens


def ci_steps(script: str) -> list[Step]:
    """The `step LABEL LIMIT_S PYTEST_ARGS...` calls of a .ci/run, in order."""
    steps = []
    for line in logical_lines(script):
        tokens = words(line)
        if tokens[:1] == ["step"]:
            assert len(tokens) >= 3, f"a step needs a label and a time limit: {line!r}"
            steps.append(Step(tokens[1], tuple(tokens[3:])))
    return steps


def scan(args: list[str]) -> tuple[str, list[str]]:
    """The marker expression `args` select (the last -m wins, as in pytest; "" selects all) and
    the arguments that narrow the run further."""
    expression, narrowing = "", []
    tokens = iter(args)
    for token in tokens:
        if not token.startswith("-") or token == "-":
            narrowing.append(token)  # a path or a node id
            continue
        if token.startswith("--"):
            name, glued, value = token.partition("=")
        else:
            name, value = token[:2], token[2:]
            glued = value
        if name in VALUED and not glued:
            value = next(tokens, "")
        if name in NARROWING:
            narrowing.append(token)
        if name == "-m":
            expression = value
    return expression, narrowing


def selects(expression: str, markers: frozenset[str]) -> bool:
    """Whether `-m expression` selects a test that carries exactly `markers`."""
    if not expression:
        return True
    return Expression.compile(expression).evaluate(lambda name, **_: name in markers)


def not_run(markers: list[str], addopts: list[str], steps: list[Step]) -> list[frozenset[str]]:
    """The combinations of `markers` (the empty one included) that no step runs in full."""
    expressions = []
    for step in steps:
        expression, narrowing = scan(addopts + list(step.args))
        if not narrowing:
            expressions.append(expression)
    combinations = (
        frozenset(c) for n in range(len(markers) + 1) for c in itertools.combinations(markers, n)
    )
    return [c for c in combinations if not any(selects(e, c) for e in expressions)]


def declared_markers() -> list[str]:
    """The markers pyproject.toml declares (`name: help` or `name(args): help`); not the ones
    plugins add (skip, parametrize, asyncio, timeout, ...): no step deselects those."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    lines = pyproject["tool"]["pytest"]["ini_options"]["markers"]
    return [re.split(r"[:(]", line, maxsplit=1)[0].strip() for line in lines]


def smallest(missing: list[frozenset[str]]) -> list[set[str]]:
    """The combinations of `missing` with no smaller one in it, as sets (what a failure names)."""
    return [set(c) for c in missing if not any(other < c for other in missing)]


def test_every_marker_is_run_by_a_ci_step(pytestconfig):
    """Each marker, alone and with any others, and tests with no marker, are selected by a step
    of .ci/run under pyproject's addopts."""
    markers = declared_markers()
    addopts = list(pytestconfig.getini("addopts"))
    steps = ci_steps(CI_RUN.read_text())
    assert {"slow", "server", "browser", "chaos"} <= set(markers), markers
    assert steps, "no `step` line in .ci/run"
    missing = smallest(not_run(markers, addopts, steps))
    shown = {s.label: shlex.join(addopts + list(s.args)) for s in steps}
    assert missing == [], f"tests marked with these run in no step of .ci/run {shown}"


def test_pytest_runs_only_through_step():
    """The one pytest command of .ci/run is the step function's (which tests/test_ci.py reads)."""
    commands = [line for line in logical_lines(CI_RUN.read_text()) if "pytest" in words(line)]
    assert len(commands) == 1 and "$@" in words(commands[0]), commands


def test_the_first_step_is_the_readme_test_command():
    """CI's first step is exactly what the README tells a person to run."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    command = re.search(r"\.venv/bin/python -m pytest([^`\n]*)", readme)
    assert command, "the README names no test command"
    assert ci_steps(CI_RUN.read_text())[0].args == tuple(shlex.split(command.group(1)))


MARKERS = ["slow", "server", "browser", "chaos"]
ADDOPTS = ["-m", "not chaos"]
TWO_STEPS = """
step main 2700 -q
step chaos 900 -q \\
    -m chaos  # a continued line
"""


@pytest.mark.parametrize(
    ("script", "left_out"),
    [
        (TWO_STEPS, []),
        ("step main 2700 -q\n", [{"chaos"}]),  # no chaos step
        ("step main 2700 -q\nstep chaos 900 -q -m 'chaos and not slow'\n", [{"chaos", "slow"}]),
        ('step main 1 -q -m "not slow"\nstep chaos 900 -m chaos -q\n', [{"slow"}]),
        ("step main 2700 -q\nstep chaos 900 -q -m chaos tests/test_chaos\n", [{"chaos"}]),
        ("step main 2700 -q -k 'not reload'\nstep chaos 900 -mchaos\n", [set()]),  # unmarked
        ("step main 2700 -q --deselect tests/test_ci.py\nstep all 900 -m ''\n", []),
        (TWO_STEPS + "X=avx2 Y=AVX2 step cpu_kinds 600 -q -m cpu_kinds\n", []),
    ],
)
def test_the_check_finds_what_no_step_runs(script, left_out):
    """The check above on made-up scripts finds each marker left out (set(): no marker)."""
    assert smallest(not_run(MARKERS, ADDOPTS, ci_steps(script))) == left_out


def test_a_new_marker_with_a_step_of_its_own_is_covered():
    """A marker added later (cpu_kinds), run by the main step or by a step of its own."""
    markers = [*MARKERS, "cpu_kinds"]
    with_step = ci_steps(TWO_STEPS + "A=1 B=2 step cpu_kinds 600 -q -m cpu_kinds\n")
    left_out_of_main = ["-m", "not chaos and not cpu_kinds"]
    assert not_run(markers, ADDOPTS, ci_steps(TWO_STEPS)) == []
    assert not_run(markers, left_out_of_main, with_step) == []
    assert smallest(not_run(markers, left_out_of_main, ci_steps(TWO_STEPS))) == [{"cpu_kinds"}]
