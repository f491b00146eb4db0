import random

import pytest

from engine.detokenizer import IncrementalDetokenizer, TokenBytes


@pytest.fixture(scope="module")
def token_bytes(default_tokenizer):
    return TokenBytes.from_tokenizer(default_tokenizer)


def stream(token_bytes, ids):
    detok = IncrementalDetokenizer(token_bytes)
    deltas = [detok.decode([t]) for t in ids]
    return deltas, detok.flush()


def byte_token(tokenizer, byte: int) -> int:
    """The id of the single-byte token for `byte` in a byte-level vocabulary."""
    return tokenizer.get_vocab()[_byte_char(byte)]


def _byte_char(byte: int) -> str:
    from engine.detokenizer import _byte_level_alphabet

    return next(c for c, b in _byte_level_alphabet().items() if b == byte)


def test_random_sequences_join_to_the_one_shot_decode(default_tokenizer, token_bytes):
    rng = random.Random(0)
    for _ in range(500):
        ids = [rng.randrange(len(default_tokenizer)) for _ in range(rng.randint(1, 30))]
        deltas, tail = stream(token_bytes, ids)
        assert "".join(deltas) + tail == default_tokenizer.decode(ids, skip_special_tokens=True)


def test_multibyte_character_split_across_tokens_is_held_until_complete(default_tokenizer, token_bytes):
    # "🎉" is F0 9F 8E 89: feed it one byte token at a time.
    ids = [byte_token(default_tokenizer, b) for b in "🎉".encode()]
    deltas, tail = stream(token_bytes, ids)
    assert deltas == ["", "", "", "🎉"]
    assert tail == ""


def test_real_text_round_trips_with_every_delta_valid(default_tokenizer, token_bytes):
    text = "naïve café — 世界 🎉 ok\n\ttabs  and  spaces"
    ids = default_tokenizer.encode(text)
    deltas, tail = stream(token_bytes, ids)
    assert "".join(deltas) + tail == text
    for delta in deltas:
        delta.encode("utf-8")  # every delta is well-formed on its own


def test_invalid_bytes_become_replacement_characters(default_tokenizer, token_bytes):
    # 0x9F is a continuation byte with no lead byte before it.
    ids = [byte_token(default_tokenizer, 0x9F), byte_token(default_tokenizer, ord("a"))]
    deltas, tail = stream(token_bytes, ids)
    assert "".join(deltas) + tail == "\ufffda"


def test_unfinished_character_is_flushed_as_replacement(default_tokenizer, token_bytes):
    ids = [byte_token(default_tokenizer, 0xE4), byte_token(default_tokenizer, 0xB8)]  # 2 of 3 bytes of 世
    deltas, tail = stream(token_bytes, ids)
    assert deltas == ["", ""]
    assert tail == "\ufffd"


def test_special_tokens_produce_no_text(default_tokenizer, token_bytes):
    deltas, tail = stream(token_bytes, [default_tokenizer.eos_token_id])
    assert deltas == [""] and tail == ""
