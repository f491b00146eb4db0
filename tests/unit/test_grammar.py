"""Grammar-constrained decoding in the engine: masks, jump-forward, speculation and n choices.

A tiny random model knows nothing of JSON, so whatever it produces under a grammar
shows the constraint, not the model, doing the work.
"""

import json
import re

import jsonschema
import pytest

from engine.sampling.grammar import GrammarError
from engine.tiny import tiny_engine, tiny_loaded
from engine.types import FinishReason, GrammarSpec, SamplingParams
from tests.unit.helpers import collect

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def loaded(default_tokenizer):
    # The whole vocabulary: a grammar may need any token (`{"` is one token of its own).
    return tiny_loaded(default_tokenizer, vocab_size=len(default_tokenizer))


@pytest.fixture(scope="module")
def repetitive(default_tokenizer):
    return tiny_loaded(default_tokenizer, repetitive=True, vocab_size=len(default_tokenizer))


def text_of(chunks):
    return "".join(c.text for c in chunks)


def choices_of(chunks, n):
    return ["".join(c.text for c in chunks if c.index == i) for i in range(n)]


async def generate(engine, spec, max_tokens=200, prompt=(1, 2, 3), **params):
    chunks = await collect(
        engine, list(prompt), SamplingParams(max_tokens=max_tokens, grammar=spec, **{"temperature": 0.0, **params})
    )
    return chunks


@pytest.mark.parametrize("jump_forward", [True, False])
async def test_json_schema_output_validates_and_finishes_with_stop(loaded, jump_forward):
    engine = tiny_engine(loaded, jump_forward=jump_forward)
    engine.start()
    try:
        for seed in range(4):
            chunks = await generate(engine, GrammarSpec.json_schema(SCHEMA), temperature=1.0, seed=seed)
            assert chunks[-1].finish_reason == FinishReason.STOP
            jsonschema.validate(json.loads(text_of(chunks)), SCHEMA)
    finally:
        engine.shutdown()


async def test_jump_forward_emits_forced_tokens_in_the_same_step(loaded):
    """With jump-forward the keys come in bursts: fewer steps for the same kind of output."""
    steps = {}
    for jump_forward in (True, False):
        engine = tiny_engine(loaded, jump_forward=jump_forward)
        engine.start()
        try:
            chunks = await generate(engine, GrammarSpec.json_schema(SCHEMA))
            jsonschema.validate(json.loads(text_of(chunks)), SCHEMA)
            steps[jump_forward] = engine.stats.num_steps
        finally:
            engine.shutdown()
    assert steps[True] < steps[False]


@pytest.mark.parametrize(
    ("spec", "check"),
    [
        (GrammarSpec("regex", r"[a-c]{3}-\d{2}"), lambda t: re.fullmatch(r"[a-c]{3}-\d{2}", t)),
        (GrammarSpec.choice(["yes", "no", "maybe"]), lambda t: t in ("yes", "no", "maybe")),
        (
            GrammarSpec("grammar", 'start: "(" item ("," item)* ")"\nitem: /[0-9]/'),
            lambda t: re.fullmatch(r"\(\d(,\d)*\)", t),
        ),
        (GrammarSpec("grammar", 'root ::= "x" [0-9]+ "y"'), lambda t: re.fullmatch(r"x\d+y", t)),
        (GrammarSpec.json_schema({"type": "object"}), lambda t: isinstance(json.loads(t), dict)),
    ],
)
async def test_every_grammar_kind_constrains_the_output(loaded, spec, check):
    engine = tiny_engine(loaded)
    engine.start()
    try:
        stopped = 0
        # Eight seeds: the random model rambles through an open object's keys past max_tokens for most.
        for seed in range(8):
            chunks = await generate(engine, spec, max_tokens=64, temperature=1.0, seed=seed)
            if chunks[-1].finish_reason == FinishReason.STOP:
                assert check(text_of(chunks)), text_of(chunks)
                stopped += 1
            else:
                # Cut by max_tokens: still a prefix the grammar allows.
                assert chunks[-1].finish_reason == FinishReason.LENGTH
        # The check ran: some output was complete.
        assert stopped
    finally:
        engine.shutdown()


async def test_speculation_under_a_grammar_gives_the_same_greedy_output(repetitive):
    outputs = {}
    for speculative in ("off", "ngram"):
        from engine.config import SpeculativeConfig

        spec_config = SpeculativeConfig("ngram", num_tokens=4) if speculative == "ngram" else None
        engine = tiny_engine(repetitive, speculative=spec_config)
        engine.start()
        try:
            outputs[speculative] = [
                text_of(await generate(engine, GrammarSpec.json_schema(SCHEMA), prompt=(5, 6, 7, i))) for i in range(6)
            ]
            if speculative == "ngram":
                assert engine.stats.num_draft_tokens > 0
        finally:
            engine.shutdown()
    assert outputs["ngram"] == outputs["off"]
    for text in outputs["off"]:
        jsonschema.validate(json.loads(text), SCHEMA)


async def test_n_choices_each_keep_their_own_grammar_and_repeat_with_a_seed(loaded):
    engine = tiny_engine(loaded)
    engine.start()
    try:
        runs = [
            choices_of(await generate(engine, GrammarSpec.json_schema(SCHEMA), temperature=1.0, seed=7, n=3), 3)
            for _ in range(2)
        ]
    finally:
        engine.shutdown()
    assert runs[0] == runs[1]
    assert len(set(runs[0])) > 1
    for text in runs[0]:
        jsonschema.validate(json.loads(text), SCHEMA)


async def test_constrained_and_free_requests_share_a_batch(loaded):
    import asyncio

    engine = tiny_engine(loaded)
    engine.start()
    try:
        free_alone = await collect(engine, [9, 9, 9], SamplingParams(max_tokens=20, temperature=0.0))
        results = await asyncio.gather(
            *[generate(engine, GrammarSpec.json_schema(SCHEMA), temperature=1.0, seed=s) for s in range(6)],
            collect(engine, [9, 9, 9], SamplingParams(max_tokens=20, temperature=0.0)),
        )
    finally:
        engine.shutdown()
    for chunks in results[:-1]:
        jsonschema.validate(json.loads(text_of(chunks)), SCHEMA)
    assert text_of(results[-1]) == text_of(free_alone)


def test_invalid_grammars_are_refused_with_the_reason(loaded):
    engine = tiny_engine(loaded)
    for spec, words in [
        (GrammarSpec("regex", "a(b"), "unclosed group"),
        (GrammarSpec.json_schema({"type": "frobnicate"}), "frobnicate"),
        (GrammarSpec("grammar", "start: undefined_rule"), "undefined_rule"),
    ]:
        with pytest.raises(GrammarError, match=words):
            engine.grammars.compile(spec)
    engine.shutdown()


def test_a_spec_is_compiled_once(loaded):
    engine = tiny_engine(loaded)
    spec = GrammarSpec.json_schema(SCHEMA)
    assert engine.grammars.compile(spec) is engine.grammars.compile(GrammarSpec.json_schema(dict(SCHEMA)))
    engine.shutdown()
