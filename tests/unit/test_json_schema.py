"""Schemas are decoded as OpenAI's strict mode reads them: objects that list their properties take no others."""

import pytest

from app.serving.json_schema import closed, decoded_schema
from app.serving.tools import Function, ToolUse
from engine.sampling.grammar import GrammarCompiler
from engine.types import GrammarSpec

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def test_objects_that_list_properties_are_closed_at_any_depth():
    schema = {
        "type": "object",
        "properties": {
            "where": CITY,
            "stops": {"type": "array", "items": CITY},
            "alt": {"anyOf": [CITY, {"type": "null"}]},
        },
        "$defs": {"city": CITY},
    }
    out = closed(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["where"]["additionalProperties"] is False
    assert out["properties"]["stops"]["items"]["additionalProperties"] is False
    assert out["properties"]["alt"]["anyOf"][0]["additionalProperties"] is False
    assert out["$defs"]["city"]["additionalProperties"] is False
    assert "additionalProperties" not in CITY, "the request's schema is left as it was"


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object"},
        {"type": "object", "additionalProperties": {"type": "integer"}},
        {"type": "object", "properties": {"a": {}}, "additionalProperties": True},
        {"type": "object", "properties": {"a": {}}, "allOf": [{"required": ["a"]}]},
        {"type": "string"},
        True,
    ],
)
def test_what_says_anything_of_further_keys_or_lists_none_is_left_as_written(schema):
    assert closed(schema) == schema


def test_allof_branches_stay_open_so_their_intersection_keeps_both_parts_keys():
    schema = {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}
    assert closed(schema) == schema


def test_strict_false_decodes_the_schema_as_plain_json_schema():
    assert decoded_schema(CITY, strict=False) is CITY
    assert decoded_schema(CITY, strict=None)["additionalProperties"] is False
    assert decoded_schema(CITY, strict=True)["additionalProperties"] is False


@pytest.fixture(scope="module")
def grammars(default_tokenizer):
    return GrammarCompiler(default_tokenizer, len(default_tokenizer), [default_tokenizer.eos_token_id])


def accepts(grammars, spec, text):
    """Whether `text` is a complete output under `spec`."""
    matcher = grammars.constraint(spec).matcher
    tokens = grammars.tokenizer.tokenize_str(text)
    return matcher.validate_tokens(tokens) == len(tokens) and matcher.consume_tokens(tokens) and matcher.is_accepting()


def call(arguments: str) -> str:
    return f'<tool_call>\n{{"name":"get_weather","arguments":{arguments}}}\n</tool_call>'


def test_a_tool_call_takes_only_the_declared_arguments_unless_strict_is_false(grammars):
    # LangChain's schema for `def get_weather(city: str)`: nothing about further keys.
    strict = ToolUse((Function("get_weather", None, CITY),), "required").grammar()
    assert accepts(grammars, strict, call('{"city":"Oslo"}'))
    assert not accepts(grammars, strict, call('{"city":"Oslo","properties":{}}'))
    assert not accepts(grammars, strict, call('{"city": "Oslo"}')), "separators are compact"
    plain = ToolUse((Function("get_weather", None, CITY, strict=False),), "required").grammar()
    assert accepts(grammars, plain, call('{"city":"Oslo","properties":{}}'))


def test_calls_may_end_with_a_line_break_or_a_blank_line_so_a_model_that_writes_one_can_stop(grammars):
    # The default model writes a blank line after a call where it would stop: refusing it made the model
    # open a second call, and another, until the length limit.
    use = ToolUse((Function("get_weather", None, CITY),), "required")
    oslo, bergen = call('{"city":"Oslo"}'), call('{"city":"Bergen"}')
    for text in (oslo + "\n", oslo + "\n\n", oslo + "\n" + bergen + "\n\n"):
        assert accepts(grammars, use.grammar(), text)
    for text in (oslo + "\n\n\n", oslo + "\n\n" + bergen):
        assert not accepts(grammars, use.grammar(), text)


def test_response_format_schemas_are_closed_too(grammars):
    spec = GrammarSpec.json_schema(decoded_schema(CITY, strict=None))
    assert accepts(grammars, spec, '{"city":"Oslo"}')
    assert not accepts(grammars, spec, '{"city":"Oslo","x":1}')
