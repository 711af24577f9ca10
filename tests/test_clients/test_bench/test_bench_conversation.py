"""Multi-turn conversations of the bench (clients/bench/conversation.py) and how the runner drives
them, with a fake transport (no server); one short run against a real tritonserver at the end."""

from __future__ import annotations

import asyncio
import time

import pytest

from clients import cli
from clients.bench.conversation import FOLLOW_UPS, first_turn, follow_up, next_turn
from clients.bench.prompts import Sampling
from clients.bench.runner import Level, Workload, multi_turn_problem, run_level
from clients.bench.transports import Prompt
from clients.library.chunk import Chunk

CHAT = Prompt(
    messages=(
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name two sorting algorithms."},
    )
)


def roles(messages) -> list[str]:
    return [m["role"] for m in messages]


def test_first_turn_is_the_shared_chat():
    """A chat is sent whole (a copy); plain text becomes one user message."""
    messages = first_turn(CHAT)
    assert messages == CHAT.messages and messages[0] is not CHAT.messages[0]
    assert first_turn(Prompt(text="hello")) == ({"role": "user", "content": "hello"},)


def test_history_grows_with_the_answers_and_roles_alternate():
    """Each turn is the one before, its answer as an assistant message, then a question."""
    history = first_turn(CHAT)
    for turn, answer in zip(range(2, 6), ("Quicksort and merge sort.", "", "Merge sort.", "x")):
        before = history
        history = next_turn(before, answer, follow_up(0, turn))
        assert history[: len(before)] == before
        assert history[len(before) :] == (
            {"role": "assistant", "content": answer},  # an empty answer too: roles alternate
            {"role": "user", "content": follow_up(0, turn)},
        )
    assert len(history) == 2 + 2 * 4
    assert roles(history[1:]) == ["user", "assistant"] * 4 + ["user"]


def test_follow_ups_are_deterministic_and_differ_between_conversations():
    """Conversation c asks the fixed follow-ups in turn, starting from its own."""
    assert [follow_up(0, t) for t in range(2, 5)] == list(FOLLOW_UPS[:3])
    assert follow_up(1, 2) == FOLLOW_UPS[1] and follow_up(3, 7) == follow_up(3, 7)
    assert follow_up(0, 2 + len(FOLLOW_UPS)) == FOLLOW_UPS[0]
    with pytest.raises(ValueError):
        follow_up(0, 1)


class ChatTransport:
    """Answers request i with the text 'answer i' in two responses; remembers what it got."""

    name = "fake"

    def __init__(self, fail: frozenset[int] = frozenset()):
        self.fail = fail
        self.sent: dict[int, tuple[Prompt, dict]] = {}
        self.in_flight = self.max_in_flight = 0

    async def open(self, slots):
        pass

    async def generate(self, rec, prompt, params):
        self.sent[rec.index] = (prompt, params)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            rec.sent_ns = time.monotonic_ns()
            await asyncio.sleep(0.001)
            if rec.index in self.fail:
                raise ConnectionResetError("peer went away")
            for text in ("answer ", str(rec.index)):
                rec.chunks.append(Chunk.delta(text, 1, time.monotonic_ns(), num_input_tokens=10))
        finally:
            self.in_flight -= 1

    async def close(self):
        pass


def conversations(count: int, turns: int) -> Workload:
    return Workload([CHAT, Prompt(text="hi")], Sampling(seed=100), requests=count, turns=turns)


async def test_turns_send_the_history_with_the_answers_fed_back():
    """Turn t of conversation c is request c * turns + t - 1; it sends the turn before's history,
    that turn's answer and a follow-up; concurrency is conversations at once."""
    t = ChatTransport()
    records = await run_level(t, conversations(3, 4), Level(concurrency=2), progress=False)
    assert [(r.conversation, r.turn) for r in records] == [
        (c, n) for c in range(3) for n in (1, 2, 3, 4)
    ]
    assert [r.index for r in records] == list(range(12)) and t.max_in_flight == 2
    assert all(r.status == "ok" for r in records)
    assert t.sent[4][0].messages == ({"role": "user", "content": "hi"},)  # conversation 1
    for r in records[1:]:
        if r.turn == 1:
            continue
        before, _ = t.sent[r.index - 1]
        prompt, params = t.sent[r.index]
        assert prompt.messages == next_turn(
            before.messages, f"answer {r.index - 1}", follow_up(r.conversation, r.turn)
        )
        assert params["seed"] == 100 + r.index


async def test_a_failed_turn_ends_its_conversation():
    """Without an answer there is nothing to go on with: the later turns are not sent."""
    t = ChatTransport(fail=frozenset({1}))
    records = await run_level(t, conversations(2, 3), Level(concurrency=1), progress=False)
    assert [(r.conversation, r.turn, r.status) for r in records] == [
        (0, 1, "ok"),
        (0, 2, "error"),
        (1, 1, "ok"),
        (1, 2, "ok"),
        (1, 3, "ok"),
    ]


def test_what_cannot_run_conversations_is_refused_clearly(capsys):
    """A transport without chat messages or an open loop is named; the CLI exits 2 at once."""
    closed = [Level(concurrency=4)]
    assert multi_turn_problem(("grpc", "sse", "ws", "openai"), closed) is None
    assert "pigeon cannot carry a conversation" in multi_turn_problem(("grpc", "pigeon"), closed)
    rate = multi_turn_problem(("grpc",), [Level(request_rate=2.0)])
    assert "closed-loop" in rate and "--request-rate" in rate
    rc = cli.main(["bench", "--multi-turn", "3", "--request-rate", "2"])
    assert rc == 2 and "closed-loop" in capsys.readouterr().err


def test_multi_turn_options_become_the_workload():
    """--multi-turn N --conversations C: C conversations of N turns per level."""
    import argparse

    from clients.bench.cli import add_arguments, config_from_args, workload

    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = config_from_args(p.parse_args(["--multi-turn", "10", "--conversations", "4"]))
    wl = workload(cfg)
    assert (cfg.multi_turn, wl.turns, wl.requests) == (10, 10, 4)
    assert workload(config_from_args(p.parse_args([]))).turns is None
    with pytest.raises(SystemExit):
        p.parse_args(["--multi-turn", "0"])


@pytest.mark.server
async def test_multi_turn_bench_against_a_real_server(triton_server):
    """2 conversations of 3 turns over grpc: every turn answered and timed, the server's prompt
    count grows turn by turn in each conversation, and the cached-token figure is read."""
    from clients.bench.cli import BenchConfig, run_bench
    from clients.bench.report import format_run, validate_report

    cfg = BenchConfig(
        triton=triton_server.grpc_url,
        concurrency=(2,),
        multi_turn=3,
        conversations=2,
        warmup=0,
        output_tokens=4,
        temperature=0.0,
        out=None,
        plot=False,
        progress=False,
    )
    doc = await run_bench(cfg)
    validate_report(doc)
    (run,) = doc["runs"]
    mt = run["summary"]["multi_turn"]
    assert [t["turn"] for t in mt["per_turn"]] == [1, 2, 3]
    for t in mt["per_turn"]:
        assert (t["requests"], t["completed"], t["ttft_ms"]["count"]) == (2, 2, 2), run["requests"]
        assert t["ttft_ms"]["p50"] > 0 and t["cached_tokens"]["count"] == 2
    prompts: dict[int, list[int]] = {}
    for r in run["requests"]:
        prompts.setdefault(r["conversation"], []).append(r["input_tokens"])
    assert len(prompts) == 2
    for tokens in prompts.values():
        assert tokens[0] < tokens[1] < tokens[2], prompts
    averages = [t["input_tokens"]["avg"] for t in mt["per_turn"]]
    assert averages == sorted(averages) and mt["later_turns"]["requests"] == 0
    assert "TTFT per turn" in format_run(run)
