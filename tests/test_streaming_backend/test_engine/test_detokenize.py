"""Incremental detokenising with the default model's byte-level tokenizer."""

import random

import pytest

from streaming_backend.engine.detokenize import REPLACEMENT, IncrementalDetokenizer, decoder

TEXTS = [
    "The Great Wall of China is long.",
    "长城是中国古代的军事防御工程。",
    "Ocean: 🌊🐠🐳🏝️ and 👩‍👩‍👧‍👦 families",
    "混合 text, emoji 🎉 and 日本語 and العربية",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_loaded):
    return tiny_loaded.tokenizer


def _stream(tokenizer, ids):
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add([i]) for i in ids]
    return deltas, detok.flush()


@pytest.mark.parametrize("text", TEXTS)
def test_known_text_streams_without_broken_characters(tokenizer, text):
    """Ids of Chinese/emoji text fed one by one never yield U+FFFD and concatenate to the text."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > 3
    deltas, rest = _stream(tokenizer, ids)
    assert all(REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) + rest == text
    assert rest == ""


def test_characters_split_over_tokens_are_held_back(tokenizer):
    """An emoji spread over several byte tokens appears whole, in one delta."""
    ids = tokenizer("🐳", add_special_tokens=False)["input_ids"]
    assert len(ids) > 1, "the test needs a character split over tokens"
    deltas, _ = _stream(tokenizer, ids)
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "🐳"


@pytest.mark.parametrize("text", ["ab🐳", "长城", "a👩‍👩‍👧"])
def test_a_stream_ending_inside_a_character_drops_that_character(tokenizer, text):
    """Cut off after part of the last character's bytes (a length stop), the stream's text ends
    before that character: no U+FFFD stands for half a character at the end."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids[:-1]).endswith(REPLACEMENT), "the test needs a split character"
    deltas, rest = _stream(tokenizer, ids[:-1])
    assert rest == ""
    assert "".join(deltas) + rest == text[:-1]


@pytest.mark.parametrize("seed", range(20))
def test_arbitrary_ids_concatenate_to_the_full_decode(tokenizer, seed):
    """Random ids (possibly invalid UTF-8): deltas add up to the full decode, U+FFFD only where
    the full decode has one, except at the very end: a full decode ending in U+FFFD ends inside a
    character (or on an invalid byte, which text alone cannot tell apart), and the stream drops
    that one U+FFFD. U+FFFD in the middle (invalid bytes) stay."""
    rng = random.Random(seed)
    # Byte tokens in the lower part of the vocabulary make broken UTF-8 likely.
    ids = [
        rng.randrange(0, 300) if rng.random() < 0.6 else rng.randrange(len(tokenizer))
        for _ in range(60)
    ]
    deltas, rest = _stream(tokenizer, ids)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    streamed = "".join(deltas) + rest
    assert streamed == full.removesuffix(REPLACEMENT)
    assert streamed.count(REPLACEMENT) == full.count(REPLACEMENT) - full.endswith(REPLACEMENT)


def test_special_tokens_produce_no_text(tokenizer):
    """EOS and other special tokens are skipped, as in the full decode."""
    ids = tokenizer("hi", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    deltas, rest = _stream(tokenizer, ids)
    assert "".join(deltas) + rest == "hi"


def test_the_backends_decode_gives_the_tokenizers_text(tokenizer, monkeypatch):
    """`decoder` skips the Hugging Face wrapper where it adds nothing: the same text as
    tokenizer.decode(ids, skip_special_tokens=True) for random ids, special ones among them;
    a tokenizer that cleans up spaces keeps its own decode."""
    decode = decoder(tokenizer)
    assert decode.func == tokenizer._tokenizer.decode
    rng = random.Random(4)
    specials = tokenizer.all_special_ids
    for _ in range(500):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(0, 6))]
        ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=True), ids
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    assert decoder(tokenizer).func == tokenizer.decode
