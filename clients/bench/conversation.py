"""Multi-turn conversations of a benchmark workload: the history each turn sends.

Turn 1 is a shared chat (a workload prompt, sent whole: its system message and earlier turns
too). Every next turn appends the model's own answer to the turn before as an assistant message,
then a follow-up user message, and sends the whole history as `messages` (the model renders its
chat template server-side). So each prompt begins with the one before it plus its answer, which
is what a prefix cache can reuse. Deterministic: the follow-ups depend only on the conversation's
number and the turn, the answers only on what the server sent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from clients.bench.transports import Prompt

USER, ASSISTANT = "user", "assistant"  # roles of wire.ROLES

# Follow-up questions that fit after any answer, so a conversation can go on from every shared
# chat. Conversation c asks them in turn from FOLLOW_UPS[c % len(FOLLOW_UPS)] on.
FOLLOW_UPS = (
    "Can you say more about that?",
    "Give me a concrete example.",
    "Summarise your answer in one sentence.",
    "What is a common mistake people make about this?",
    "Explain it as you would to a ten-year-old.",
    "Is there another way to look at it?",
    "Which part of your answer is the least certain, and why?",
    "Put the key points in a short list.",
    "What should I read or try next?",
)

Messages = tuple[dict[str, str], ...]


def first_turn(prompt: Prompt) -> Messages:
    """Turn 1's messages: a chat as it is, plain text as one user message."""
    if prompt.messages is not None:
        return tuple(dict(m) for m in prompt.messages)
    return ({"role": USER, "content": prompt.text or ""},)


def follow_up(conversation: int, turn: int) -> str:
    """The user message that opens `turn` (2, 3, ...) of conversation number `conversation`."""
    if turn < 2:
        raise ValueError(f"turn {turn} has no follow-up: turn 1 is a shared chat")
    return FOLLOW_UPS[(conversation + turn - 2) % len(FOLLOW_UPS)]


def next_turn(history: Sequence[Mapping[str, str]], answer: str, question: str) -> Messages:
    """The history plus the model's answer (even an empty one, so roles keep alternating) and
    the next question."""
    return (
        *(dict(m) for m in history),
        {"role": ASSISTANT, "content": answer},
        {"role": USER, "content": question},
    )
