"""Reasoning output: the split of an output's tokens at its reasoning's end (engine/reasoning.py), the
parser a tokenizer gets (app/serving/reasoning.py), and the engine's chunks, stop strings and grammars
around a reasoning whose tags are tokens the tiny model writes itself."""

from __future__ import annotations

import json

import pytest

from app.serving.reasoning import ThinkTags, reasoning_parser
from engine.config import SpeculativeConfig
from engine.reasoning import Part, ReasoningSplit, split_of
from engine.tiny import tiny_engine, tiny_loaded
from engine.types import ChannelReasoning, FinishReason, GrammarSpec, Reasoning, SamplingParams
from tests.unit.helpers import collect, thinking_tokenizer, tokens_of

START, END = 1000, 1001


def split_in_pieces(
    spec: Reasoning | ChannelReasoning, token_ids: list[int], cuts: list[int]
) -> tuple[list[int], list[int]]:
    """(thinking tokens, answer tokens) of `token_ids` fed in pieces cut at `cuts`."""
    split, thinking, answer = split_of(spec), [], []
    bounds = [0, *cuts, len(token_ids)]
    for begin, end in zip(bounds, bounds[1:]):
        piece = token_ids[begin:end]
        parts = split.feed(piece)
        ends = [part.end for part in parts]
        assert ends == sorted(ends) and all(0 <= end <= len(piece) for end in ends)
        for part in parts:
            # A part ends where it says in this piece; only an answer's first may reach back (a held header).
            mine = min(len(part.token_ids), part.end)
            assert part.token_ids[len(part.token_ids) - mine :] == piece[part.end - mine : part.end]
            (thinking if part.thinking else answer).extend(part.token_ids)
    return thinking, answer


def _all_cuts(tokens: list[int]) -> list[list[int]]:
    return [[], *[[i] for i in range(1, len(tokens))], list(range(1, len(tokens)))]


@pytest.mark.parametrize(
    ("open_at_start", "tokens", "thinking", "answer"),
    [
        (True, [5, 6, END, 7, 8], [5, 6], [7, 8]),  # R1 style: the prompt opened it
        (True, [START, 5, END, 7], [5], [7]),  # a model that writes the prompt's tag again
        (False, [START, 5, 6, END, 7, 8], [5, 6], [7, 8]),  # Qwen3 style: the output opens it
        (False, [5, 6, END, 7], [], [5, 6, END, 7]),  # no reasoning: all answer, a stray tag too
        (False, [5, START, 6], [], [5, START, 6]),  # a tag past the first token opens nothing
        (True, [5, 6, 7], [5, 6, 7], []),  # no closing tag (cut): all thinking
        (True, [END, 7, END], [], [7, END]),  # empty reasoning; a later tag is answer
    ],
)
def test_the_split_is_the_same_however_the_tokens_are_cut(open_at_start, tokens, thinking, answer):
    spec = Reasoning(START, END, open_at_start)
    for cuts in _all_cuts(tokens):
        assert split_in_pieces(spec, tokens, cuts) == (thinking, answer), cuts


# A harmony vocabulary's tokens: <|channel|>, <|message|>, <|end|>, <|start|>, "analysis", "final", text.
CHANNEL, MESSAGE, H_END, H_START, ANALYSIS, FINAL, ASSISTANT = 2000, 2001, 2002, 2003, 2004, 2005, 2006
HARMONY = ChannelReasoning(MESSAGE, H_END, (CHANNEL, ANALYSIS))
ANSWER_HEADER = [H_START, ASSISTANT, CHANNEL, FINAL, MESSAGE]


@pytest.mark.parametrize(
    ("tokens", "thinking", "answer"),
    [
        # Analysis, then the final message: its header starts the answer.
        ([CHANNEL, ANALYSIS, MESSAGE, 5, 6, H_END, *ANSWER_HEADER, 7, 8], [5, 6], [*ANSWER_HEADER, 7, 8]),
        # Two analysis messages.
        (
            [
                CHANNEL,
                ANALYSIS,
                MESSAGE,
                5,
                H_END,
                H_START,
                ASSISTANT,
                CHANNEL,
                ANALYSIS,
                MESSAGE,
                6,
                H_END,
                *ANSWER_HEADER,
            ],
            [5, 6],
            ANSWER_HEADER,
        ),
        # No analysis: the answer from the first token.
        ([CHANNEL, FINAL, MESSAGE, 7, 8], [], [CHANNEL, FINAL, MESSAGE, 7, 8]),
        # A tool call's header (a recipient after the channel) is the answer's.
        ([CHANNEL, FINAL, 9, 10, MESSAGE, 7], [], [CHANNEL, FINAL, 9, 10, MESSAGE, 7]),
        # Cut while thinking, or inside the header after it: all thinking, the header unshown.
        ([CHANNEL, ANALYSIS, MESSAGE, 5, 6], [5, 6], []),
        ([CHANNEL, ANALYSIS, MESSAGE, 5, H_END, H_START, ASSISTANT], [5], []),
        # A preamble, then analysis again, then the final message: the later analysis is thinking too.
        (
            [CHANNEL, FINAL, MESSAGE, 7, H_END, H_START, ASSISTANT, CHANNEL, ANALYSIS, MESSAGE, 5, H_END]
            + [*ANSWER_HEADER, 8],
            [5],
            [CHANNEL, FINAL, MESSAGE, 7, H_END, *ANSWER_HEADER, 8],
        ),
        # Analysis, a preamble, analysis twice more with an empty one between, cut while thinking.
        (
            [CHANNEL, ANALYSIS, MESSAGE, 5, H_END, *ANSWER_HEADER, 7, H_END, H_START, CHANNEL, ANALYSIS, MESSAGE]
            + [H_END, CHANNEL, ANALYSIS, MESSAGE, 6, 9],
            [5, 6, 9],
            [*ANSWER_HEADER, 7, H_END],
        ),
        # An "analysis" that is not the header's end does not make it analysis.
        ([CHANNEL, ANALYSIS, 9, MESSAGE, 7], [], [CHANNEL, ANALYSIS, 9, MESSAGE, 7]),
    ],
)
def test_harmony_s_analysis_is_split_off_however_the_tokens_are_cut(tokens, thinking, answer):
    for cuts in _all_cuts(tokens):
        assert split_in_pieces(HARMONY, tokens, cuts) == (thinking, answer), cuts


def test_text_that_never_makes_a_harmony_header_is_answer_once_too_long_for_one():
    split = split_of(HARMONY)
    assert split.feed([7] * 64) == [] and not split.answering
    assert split.feed([8, 9]) == [Part(False, [7] * 64 + [8, 9], 2)] and split.answering


def test_answering_begins_after_the_end_tag_or_at_once_without_reasoning():
    split = ReasoningSplit(Reasoning(START, END, open_at_start=False))
    assert not split.answering and split.feed([START, 5]) == [Part(True, [5], 2)] and not split.answering
    assert split.feed([6, END, 7]) == [Part(True, [6], 1), Part(False, [7], 3)] and split.answering
    plain = ReasoningSplit(Reasoning(START, END, open_at_start=False))
    assert plain.feed([9, 10]) == [Part(False, [9, 10], 2)] and plain.answering


def test_auto_reads_think_tags_where_the_template_writes_them(default_tokenizer):
    assert reasoning_parser("auto", default_tokenizer) is None
    with pytest.raises(ValueError, match="<think>"):
        reasoning_parser("qwen3", default_tokenizer)
    thinking = thinking_tokenizer(default_tokenizer)
    start, end = thinking.convert_tokens_to_ids(["<think>", "</think>"])
    parser = reasoning_parser("auto", thinking)
    assert parser == ThinkTags("qwen3", start, end)
    assert reasoning_parser("none", thinking) is None

    def prompt(**kwargs) -> list[int]:
        text = thinking.apply_chat_template(
            [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True, **kwargs
        )
        return thinking.encode(text, add_special_tokens=False)

    # The template opens the reasoning in the prompt, unless enable_thinking is false.
    assert parser.for_prompt(prompt()) == Reasoning(start, end, open_at_start=True)
    assert parser.for_prompt(prompt(enable_thinking=False)) == Reasoning(start, end, open_at_start=False)
    assert reasoning_parser("deepseek_r1", thinking).for_prompt(prompt(enable_thinking=False)).open_at_start


# The engine, with tags the tiny model writes itself: its own greedy output's tokens stand for them.


@pytest.fixture(scope="module")
def loaded(default_tokenizer):
    # The whole vocabulary: a grammar may need any token.
    return tiny_loaded(default_tokenizer, vocab_size=len(default_tokenizer))


@pytest.fixture(scope="module")
def engine(loaded):
    engine = tiny_engine(loaded)
    engine.start()
    yield engine
    engine.shutdown()


PROMPT = [20, 30, 40, 50]


def decode(engine, token_ids) -> str:
    return engine.token_bytes.join(token_ids).decode(errors="replace")


def first_new_token(output: list[int], at_least: int, avoid: int | None = None) -> int:
    """The position of the first token from `at_least` on that has not come before (nor is `avoid`)."""
    return next(i for i in range(at_least, len(output)) if output[i] not in output[:i] and output[i] != avoid)


async def greedy_output(engine, n: int = 24) -> list[int]:
    return tokens_of(await collect(engine, PROMPT, SamplingParams(max_tokens=n, temperature=0.0)))


@pytest.mark.parametrize("stream_interval", [1, 3])
async def test_the_reasoning_comes_apart_from_the_answer_at_its_end_tag(engine, stream_interval):
    full = await greedy_output(engine)
    k = first_new_token(full, 5)
    spec = Reasoning(start_token_id=-1, end_token_id=full[k], open_at_start=True)
    params = SamplingParams(max_tokens=24, temperature=0.0, reasoning=spec, stream_interval=stream_interval)
    chunks = await collect(engine, PROMPT, params)
    assert tokens_of(chunks) == full
    assert "".join(c.reasoning for c in chunks) == decode(engine, full[:k])
    assert "".join(c.text for c in chunks) == decode(engine, full[k + 1 :])
    assert chunks[-1].timings.reasoning_tokens == k and chunks[-1].finish_reason == FinishReason.LENGTH
    # The reasoning leads: no chunk has answer text before a later chunk's reasoning.
    seen_answer = False
    for chunk in chunks:
        assert not (seen_answer and chunk.reasoning)
        seen_answer = seen_answer or bool(chunk.text)


async def test_the_first_token_may_open_the_reasoning(engine):
    full = await greedy_output(engine)
    k = first_new_token(full, 4, avoid=full[0])
    spec = Reasoning(start_token_id=full[0], end_token_id=full[k], open_at_start=False)
    chunks = await collect(engine, PROMPT, SamplingParams(max_tokens=24, temperature=0.0, reasoning=spec))
    assert "".join(c.reasoning for c in chunks) == decode(engine, full[1:k])
    assert "".join(c.text for c in chunks) == decode(engine, full[k + 1 :])
    assert chunks[-1].timings.reasoning_tokens == k - 1


async def test_an_output_cut_while_thinking_is_all_reasoning_and_ends_with_length(engine):
    full = await greedy_output(engine)
    k = first_new_token(full, 8)
    spec = Reasoning(start_token_id=-1, end_token_id=full[k], open_at_start=True)
    chunks = await collect(engine, PROMPT, SamplingParams(max_tokens=6, temperature=0.0, reasoning=spec))
    assert "".join(c.reasoning for c in chunks) == decode(engine, full[:6])
    assert all(c.text == "" for c in chunks)
    assert chunks[-1].finish_reason == FinishReason.LENGTH and chunks[-1].timings.reasoning_tokens == 6


async def test_stop_strings_never_match_inside_the_reasoning(engine):
    full = await greedy_output(engine, 32)
    k = first_new_token(full, 8)
    reasoning, answer = decode(engine, full[:k]), decode(engine, full[k + 1 :])
    stop = next(reasoning[i : i + 3] for i in range(len(reasoning) - 3) if reasoning[i : i + 3].strip())
    spec = Reasoning(start_token_id=-1, end_token_id=full[k], open_at_start=True)
    params = SamplingParams(max_tokens=32, temperature=0.0, reasoning=spec, stop=(stop,))
    chunks = await collect(engine, PROMPT, params)
    assert "".join(c.reasoning for c in chunks) == reasoning
    cut = answer.find(stop)
    assert "".join(c.text for c in chunks) == (answer[:cut] if cut >= 0 else answer)
    answer_stop = answer[4:7]
    params = SamplingParams(max_tokens=32, temperature=0.0, reasoning=spec, stop=(answer_stop,))
    chunks = await collect(engine, PROMPT, params)
    assert "".join(c.text for c in chunks) == answer[: answer.index(answer_stop)]
    assert chunks[-1].finish_reason == FinishReason.STOP


@pytest.mark.parametrize("opens", [False, True])
@pytest.mark.parametrize("speculative", [False, True])
async def test_the_grammar_constrains_the_answer_after_the_reasoning(loaded, opens, speculative):
    """The thinking is what the model writes unconstrained; the answer then follows the grammar. Where
    the output may open its reasoning, its first token may be the tag, whatever the grammar says."""
    engine = tiny_engine(loaded, speculative=SpeculativeConfig("ngram", num_tokens=4) if speculative else None)
    engine.start()
    try:
        full = await greedy_output(engine)
        k = first_new_token(full, 5, avoid=full[0])
        spec = Reasoning(start_token_id=full[0] if opens else -1, end_token_id=full[k], open_at_start=not opens)
        grammar = GrammarSpec.choice(["yes", "no"])
        params = SamplingParams(max_tokens=24, temperature=0.0, reasoning=spec, grammar=grammar)
        chunks = await collect(engine, PROMPT, params)
        assert tokens_of(chunks)[: k + 1] == full[: k + 1]
        assert "".join(c.text for c in chunks) in json.loads(grammar.source)
        assert chunks[-1].finish_reason == FinishReason.STOP
    finally:
        engine.shutdown()
