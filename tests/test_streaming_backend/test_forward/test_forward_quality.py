"""The quality gate of quantized weights: its figures, its verdict and its command; and every
family's greedy tokens with quantized weights against Hugging Face's."""

from __future__ import annotations

import dataclasses
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from families import COMPACT_FAMILIES, RECITED, one_thread, recited_rows, trained_config_model

from streaming_backend.forward.family import FAMILIES
from streaming_backend.forward.quality import (
    MIN_AGREEMENT,
    Quality,
    compare,
    compare_scorers,
    reference_texts,
    teacher_forced,
)
from streaming_backend.forward.runner import ForwardConfig, PromptChunk, SlotForward
from streaming_backend.forward.slots import CacheBudget
from streaming_backend.model.loading import LoadedModel, load_model

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


# Every family with quantized weights against Hugging Face's forward in float32, on its tiny model
# trained to recite the first rows of the shipped chats (tests/families.py): each row's first
# PROMPT tokens, then Hugging Face's ANSWER greedy tokens after them
PROMPT, ANSWER = 8, 64
# What makes a flip mean something: Hugging Face's greedy token leads its runner-up by at least
# this many logits at every answer position (measured 5.1-8.8 natively and under the AVX2 caps,
# where the quantized forwards' own leads of that token were at least 4.4; 2026-12-03)
MIN_LEAD = 2.0


@dataclasses.dataclass(frozen=True)
class Recital:
    """A family's trained tiny model and Hugging Face's greedy answers to its rows' prompts."""

    loaded: LoadedModel
    texts: list[list[int]]  # RECITED texts of PROMPT + ANSWER tokens
    margin: float  # the smallest lead of Hugging Face's greedy token over its runner-up

    @classmethod
    def of(cls, kind: str) -> Recital:
        """Train `kind`'s tiny model and let Hugging Face's forward answer each prompt."""
        loaded = trained_config_model(kind)
        with one_thread(), torch.inference_mode():
            texts = recited_rows()[:, :PROMPT]  # [RECITED, PROMPT]: same lengths, no padding
            for _ in range(ANSWER):
                chosen = loaded.model(input_ids=texts).logits[:, -1].argmax(-1)  # [RECITED]
                texts = torch.cat([texts, chosen[:, None]], dim=1)
            logits = loaded.model(input_ids=texts[:, :-1]).logits[:, PROMPT - 1 :]  # [R, A, V]
        top = logits.topk(2, dim=-1).values
        return cls(loaded, texts.tolist(), float((top[..., 0] - top[..., 1]).min()))

    @torch.inference_mode()
    def hf_scores(self, text: list[int]) -> torch.Tensor:
        """Hugging Face's logits [len - 1, V] (fp32) predicting tokens 1.. of `text`."""
        return self.loaded.model(input_ids=torch.tensor([text[:-1]])).logits[0].float()


@pytest.fixture(scope="session")
def recitals():
    """Each family's Recital, made on first use and kept for the session (seconds a family)."""
    return functools.cache(Recital.of)


def hf_agreement(recital: Recital, quantize: str) -> tuple[Quality, SlotForward]:
    """Teacher-forced greedy agreement of the compact forward with `quantize` weights with
    Hugging Face's over the answers, and that forward."""
    config = dataclasses.replace(CONFIG, quantize=quantize)
    forward = SlotForward.create(recital.loaded, config)
    scores = functools.partial(teacher_forced, forward)
    quality = compare_scorers(recital.hf_scores, scores, recital.texts, quantize, start=PROMPT)
    return quality, forward


@pytest.mark.cpu_kinds  # the trained weights and the quantized kernels differ between kinds
@pytest.mark.parametrize("quantize", ["int8", "int4"])
@pytest.mark.parametrize("kind", COMPACT_FAMILIES)
def test_every_family_quantized_picks_hf_greedy_tokens(kind, quantize, recitals):
    """On a trained model whose greedy tokens are clear, the compact forward with int8 or int4
    weights picks Hugging Face's float32 greedy token at no fewer than the quality gate's share
    of the answers' positions (teacher-forced; measured all of them on both CPU kinds), and
    streams the same answers free-running."""
    recital = recitals(kind)
    assert recital.margin >= MIN_LEAD, f"{kind}'s trained model is unsure: {recital.margin:.2f}"
    with one_thread():  # as the recital was made: a tiny model's ops, no threads to wait for
        quality, forward = hf_agreement(recital, quantize)
        prompts = [text[:PROMPT] for text in recital.texts]
        streamed = reference_texts(forward, prompts, ANSWER, frozenset())
    assert quality.positions == RECITED * ANSWER
    assert quality.agreement >= MIN_AGREEMENT, (quality, f"margin {recital.margin:.2f}")
    assert streamed == recital.texts


@pytest.mark.cpu_kinds
def test_the_agreement_falls_without_a_family_difference(recitals, monkeypatch):
    """The check can fail: Qwen3's forward without its q/k norms misses the gate by far
    (measured 72 %, 75 % under the AVX2 caps)."""
    recital = recitals("qwen3")
    monkeypatch.setitem(FAMILIES, "qwen3", FAMILIES["qwen3"]._replace(head_norms=False))
    with one_thread():
        assert hf_agreement(recital, "int8")[0].agreement < MIN_AGREEMENT
