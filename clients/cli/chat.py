"""`tokenstream chat`: a multi-turn conversation with the `chat` model in the terminal over gRPC.

Tokens print as they arrive. Ctrl-C during an answer cancels that answer (the server stops
generating it); Ctrl-C or Ctrl-D at the prompt ends the program. After each answer a line shows
the time to first token and the decode rate (tokens after the first one per second after it).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from clients.cli.prompt import InterruptiblePrompt
from clients.library import metrics
from clients.library.chunk import Chunk
from clients.library.grpc_client import (
    BALANCED_CHANNEL_ARGS,
    MODEL_NAME,
    GenerateRequest,
    GenerationError,
    stream_generate,
)
from clients.library.targets import TARGET_HELP, target_option
from streaming_backend.configuration import endpoints
from streaming_backend.sampling.request_keys import SAMPLING_KEYS

PROMPT = "you> "


@dataclass(frozen=True)
class ChatConfig:
    """Settings of one terminal chat session."""

    url: str = endpoints.GRPC_TARGET
    model: str = MODEL_NAME
    system: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class AnswerStats:
    """What one answer cost, measured in this process."""

    ttft_s: float | None  # request sent -> first response received (clients/library/metrics.py)
    first_text_s: float | None  # request sent -> first printable text received
    tokens: int
    decode_tokens_per_s: float | None  # tokens after the first / time after the first
    finish_reason: str


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of `tokenstream chat`."""
    parser.add_argument(
        "--url", default=endpoints.GRPC_TARGET, type=target_option, help=TARGET_HELP
    )
    parser.add_argument("--model", default=MODEL_NAME, help="model name in the repository")
    parser.add_argument("--system", default=None, help="system message opening the conversation")
    parser.add_argument("--temperature", type=float, help="0 = greedy")
    parser.add_argument("--top-p", type=float, help="nucleus sampling cut, (0, 1]")
    parser.add_argument("--top-k", type=int, help="0 = off")
    parser.add_argument("--max-tokens", type=int, help="answer length limit")
    parser.add_argument("--seed", type=int, help="seed for reproducible sampling")
    parser.add_argument("--repetition-penalty", type=float, help="1 = off")
    parser.add_argument("--stop", action="append", help="stop string (repeatable)")


def config_from_args(args: argparse.Namespace) -> ChatConfig:
    """A ChatConfig from parsed arguments; sampling holds only the options given."""
    # The options' dests are the wire's sampling keys (those the CLI does not offer are absent).
    sampling = {k: getattr(args, k) for k in SAMPLING_KEYS if getattr(args, k, None) is not None}
    return ChatConfig(url=args.url, model=args.model, system=args.system, sampling=sampling)


def main(args: argparse.Namespace) -> int:
    """Run the terminal chat; 0 on a normal exit, 1 when the server is not reachable."""
    cfg = config_from_args(args)
    problem = check_ready(cfg)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    print(f"connected to {cfg.url} (model {cfg.model!r}); Ctrl-C stops an answer, Ctrl-D quits")
    with InterruptiblePrompt() as prompt:  # Ctrl-C at the prompt quits at once, always
        run_chat(cfg, prompt.read_line, sys.stdout)
    return 0


def check_ready(cfg: ChatConfig) -> str | None:
    """None when the server and model are ready, else what is wrong."""
    try:
        client = grpcclient.InferenceServerClient(cfg.url, channel_args=BALANCED_CHANNEL_ARGS)
        with client:
            if not client.is_model_ready(cfg.model, client_timeout=5.0):
                return f"model {cfg.model!r} is not ready on {cfg.url}"
    except InferenceServerException as exc:
        return f"cannot reach Triton at {cfg.url}: {exc.message()}"
    return None


def run_chat(cfg: ChatConfig, read_line: Callable[[str], str], out: TextIO) -> None:
    """The conversation loop: read a line, stream the answer, keep the history."""
    history = [{"role": "system", "content": cfg.system}] if cfg.system else []
    while True:
        try:
            line = read_line(PROMPT)
        except (EOFError, KeyboardInterrupt):
            out.write("\n")
            return
        if not line.strip():
            continue
        try:
            history += turn(cfg, history, line, out)
        except KeyboardInterrupt:  # a Ctrl-C that landed just outside the stream
            out.write("\n[interrupted]\n")


def turn(cfg: ChatConfig, history: list[dict], line: str, out: TextIO) -> list[dict]:
    """One question and its streamed answer; the messages to add to the history."""
    question = {"role": "user", "content": line}
    try:
        text, stats = answer(cfg, [*history, question], out)
    except GenerationError as exc:
        out.write(f"\nerror ({exc.code}): {exc.message}\n")
        return []  # the failed question is not part of the conversation
    out.write(f"\n{format_stats(stats)}\n")
    out.flush()
    return [question, {"role": "assistant", "content": text}] if text else [question]


def answer(cfg: ChatConfig, history: list[dict], out: TextIO) -> tuple[str, AnswerStats]:
    """Stream one answer to `out`; Ctrl-C cancels it and keeps what arrived."""
    request = GenerateRequest(messages=history, sampling=cfg.sampling)
    start_ns = time.monotonic_ns()
    chunks: list[Chunk] = []
    finish_reason = "cancelled"
    try:
        for chunk in stream_generate(cfg.url, request, model=cfg.model):
            chunks.append(chunk)
            out.write(chunk.text)
            out.flush()
            finish_reason = chunk.finish_reason or finish_reason
    except KeyboardInterrupt:
        # The generator's finally has already cancelled the stream on the server.
        finish_reason = "cancelled"
    return "".join(c.text for c in chunks), measure(start_ns, chunks, finish_reason)


def measure(start_ns: int, chunks: Sequence[Chunk], finish_reason: str) -> AnswerStats:
    """TTFT, time to first text, token count and decode rate of one answer (definitions:
    clients/library/metrics.py)."""
    ttft = metrics.ttft_ns(start_ns, chunks)
    first_text = metrics.time_to_first_text_ns(start_ns, chunks)
    return AnswerStats(
        None if ttft is None else ttft / metrics.NS_PER_S,
        None if first_text is None else first_text / metrics.NS_PER_S,
        metrics.output_tokens(chunks),
        metrics.decode_rate(chunks),
        finish_reason,
    )


def format_stats(stats: AnswerStats) -> str:
    """One bracketed line, e.g. `[TTFT 42 ms · first text 48 ms · 118.3 tok/s · 64 tokens ·
    length]`; the first text only when it came in a later millisecond than the first response."""
    parts = []
    ttft_ms = None if stats.ttft_s is None else round(stats.ttft_s * 1000)
    if ttft_ms is not None:
        parts.append(f"TTFT {ttft_ms} ms")
    text_ms = None if stats.first_text_s is None else round(stats.first_text_s * 1000)
    if text_ms is not None and text_ms != ttft_ms:
        parts.append(f"first text {text_ms} ms")
    if stats.decode_tokens_per_s is not None:
        parts.append(f"{stats.decode_tokens_per_s:.1f} tok/s")
    parts.append(f"{stats.tokens} token{'s' if stats.tokens != 1 else ''}")
    parts.append(stats.finish_reason)
    return "[" + " · ".join(parts) + "]"
