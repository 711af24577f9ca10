"""The quality gate of quantized weights: its figures, its verdict and its command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from streaming_backend.forward.quality import Quality, compare, compare_scorers, reference_texts
from streaming_backend.forward.runner import ForwardConfig, PromptChunk, SlotForward
from streaming_backend.forward.slots import CacheBudget
from streaming_backend.model.loading import load_model

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ForwardConfig(CacheBudget(bytes=64 << 20), max_len=128, max_slots=2)


@pytest.fixture
def tiny(tiny_model_dir):
    """The tiny Llama in float32 on the CPU."""
    return load_model(str(tiny_model_dir), dtype="float32", device="cpu")


@pytest.mark.parametrize(
    "agreement, perplexity, passes",
    [(1.0, 2.0, True), (0.95, 2.039, True), (0.949, 2.0, False), (1.0, 2.041, False)],
)
def test_the_gate(agreement, perplexity, passes):
    """At least 95 % agreement and perplexity at most 2 % higher (2.0 -> 2.039 yes, 2.041 no)."""
    quality = Quality("int8", 100, agreement, perplexity, reference_perplexity=2.0)
    assert quality.passes() is passes


def test_a_forward_agrees_with_itself(tiny):
    """The same weights on both sides: full agreement, the same perplexity."""
    forward = SlotForward.create(tiny, CONFIG)
    texts = reference_texts(forward, [[5, 6, 7], list(range(20, 40))], 6, frozenset())
    assert [len(t) for t in texts] == [9, 26]
    quality = compare(forward, forward, texts, "none")
    assert quality.positions == 8 + 25 and quality.agreement == 1.0
    assert quality.perplexity == pytest.approx(quality.reference_perplexity)
    assert quality.passes() and forward.cache.lengths == [0] * len(forward.cache.lengths)


def test_reference_texts_are_greedy_and_stop_at_eos(tiny):
    """A continuation is the forward's own greedy tokens and ends at (and with) an EOS id."""
    forward = SlotForward.create(tiny, CONFIG)
    text = reference_texts(forward, [[5, 6, 7]], 4, frozenset())[0]
    assert len(text) == 7
    slot = forward.cache.allocate()
    logits = forward.score(PromptChunk(slot, text))  # [7, V]: the token after each position
    assert text[3:] == logits[2:6].argmax(-1).tolist()
    stopped = reference_texts(forward, [[5, 6, 7]], 4, frozenset({text[3]}))[0]
    assert stopped == text[:4]


def test_compare_scorers_reads_each_text_from_start():
    """Scorers that differ only on a text's first predictions agree fully from `start` on, and
    the positions and perplexities are those of the tokens from there."""
    text = [3, 1, 4, 1, 5, 9]
    truth = torch.nn.functional.one_hot(torch.tensor(text[1:]), 10).float() * 5  # [5, 10]

    def off_at_first_two(ids: list[int]) -> torch.Tensor:
        return torch.cat([truth[:2].roll(1, dims=-1), truth[2:]])

    everywhere = compare_scorers(lambda ids: truth, off_at_first_two, [text], "int8")
    assert everywhere.positions == 5 and everywhere.agreement == 3 / 5
    answer = compare_scorers(lambda ids: truth, off_at_first_two, [text], "int8", start=3)
    assert answer.positions == 3 and answer.agreement == 1.0
    assert answer.perplexity == pytest.approx(answer.reference_perplexity)


def run_gate(*args: str) -> subprocess.CompletedProcess:
    """scripts/quant_quality.py with these arguments."""
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "quant_quality.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )


def test_the_command_reports_each_quantization(tiny_model_dir, tmp_path):
    """On the tiny model: a line per quantization, the figures as JSON, and the exit status
    says whether every one passed (a random model's int4 need not)."""
    out = tmp_path / "gate.json"
    done = run_gate(
        "--model", str(tiny_model_dir), "--dtype", "fp32", "--quantize", "int8,int4",
        "--new-tokens", "4", "--out", str(out),
    )  # fmt: skip
    figures = json.loads(out.read_text())["results"]
    assert [r["kind"] for r in figures] == ["int8", "int4"], done.stderr
    assert "int8: greedy agreement" in done.stdout and "int4: greedy agreement" in done.stdout
    assert done.returncode == (0 if all(r["passes"] for r in figures) else 1)
    assert all(0 <= r["agreement"] <= 1 and r["positions"] > 0 for r in figures)


def test_the_command_refuses_an_unknown_quantization():
    """A kind we do not have is a usage error naming the choices."""
    done = run_gate("--quantize", "int3")
    assert done.returncode == 2
    assert "unknown quantization 'int3'; choose none, int8, int4" in done.stderr
