import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.detokenizer import IncrementalDetokenizer, StopMatcher, TokenBytes


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


# Property tests: streamed deltas always join to the one-shot text, however the tokens split.

MULTIBYTE = "aé☃😀 \n"


@st.composite
def split(draw, items):
    """`items` cut into consecutive non-empty pieces at random points."""
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(items) - 1)), max_size=len(items))))
    bounds = [0, *[c for c in cuts if c < len(items)], len(items)]
    return [items[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


@st.composite
def byte_tokens(draw):
    """A vocabulary of random byte strings (invalid UTF-8 and split characters included) and a
    sequence of its ids."""
    pieces = st.one_of(
        st.binary(min_size=0, max_size=4),
        st.text(alphabet=MULTIBYTE, max_size=3).map(str.encode),
        st.sampled_from(["😀".encode()[:2], "😀".encode()[2:], "☃".encode()[1:], b"\xff", b"\xc3"]),
    )
    table = draw(st.lists(pieces, min_size=1, max_size=30))
    ids = draw(st.lists(st.integers(0, len(table) - 1), max_size=60))
    return TokenBytes(table), ids


@settings(max_examples=300, deadline=None)
@given(data=st.data(), vocab=byte_tokens())
def test_deltas_join_to_the_one_shot_decode_for_any_bytes_and_split(data, vocab):
    token_bytes, ids = vocab
    detok = IncrementalDetokenizer(token_bytes)
    deltas = [detok.decode(piece) for piece in data.draw(split(ids))] + [detok.flush()]
    assert "".join(deltas) == token_bytes.join(ids).decode("utf-8", errors="replace")


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_real_vocabulary_multibyte_text_round_trips_through_deltas(data, default_tokenizer, token_bytes):
    text = data.draw(st.text(alphabet=MULTIBYTE + "xyz", min_size=1, max_size=40))
    ids = default_tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(token_bytes)
    deltas = [detok.decode(piece) for piece in data.draw(split(ids))] + [detok.flush()]
    assert "".join(deltas) == text


def reference_cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """Generation ends where the first stop string completes, read one character at a time."""
    for end in range(1, len(text) + 1):
        ending = [len(s) for s in stops if text[:end].endswith(s)]
        if ending:
            return text[: end - max(ending)], True
    return text, False


@settings(max_examples=500, deadline=None)
@given(
    data=st.data(),
    text=st.text(alphabet="ab☃é", max_size=40),
    stops=st.lists(st.text(alphabet="ab☃é", min_size=1, max_size=4), min_size=1, max_size=4),
)
def test_stop_matcher_releases_exactly_the_text_before_the_first_stop(data, text, stops):
    matcher = StopMatcher(stops)
    released, stopped = [], False
    for delta in data.draw(split(text)) if text else []:
        out, stopped = matcher.feed(delta)
        released.append(out)
        # Nothing released so far may contain a stop string.
        assert not any(s in "".join(released) for s in stops)
        if stopped:
            break
    if not stopped:
        released.append(matcher.flush())
    assert ("".join(released), stopped) == reference_cut(text, stops)


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(), vocab=byte_tokens(), stops=st.lists(st.text(alphabet=MULTIBYTE, min_size=1, max_size=3), max_size=4)
)
def test_detokenizer_then_stop_matcher_equals_cutting_the_one_shot_text(data, vocab, stops):
    token_bytes, ids = vocab
    detok, matcher = IncrementalDetokenizer(token_bytes), StopMatcher(stops)
    released, stopped = [], False
    pieces = data.draw(split(ids)) if ids else []
    for i, piece in enumerate(pieces):
        text = detok.decode(piece) + (detok.flush() if i == len(pieces) - 1 else "")
        out, stopped = matcher.feed(text)
        released.append(out)
        if stopped:
            break
    if not stopped:
        released.append(matcher.feed(detok.flush())[0] + matcher.flush())
    assert "".join(released) == reference_cut(token_bytes.join(ids).decode("utf-8", errors="replace"), stops)[0]
