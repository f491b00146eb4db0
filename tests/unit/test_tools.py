"""The tool-call parser: the same calls and content however the text is split into chunks."""

import json
import random

from app.serving.tools import ArgumentsDelta, CallStarted, Content, Function, ToolCallParser, ToolUse

CALLS = (
    'Let me check.<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris","when":{"day":"mon"}}}\n</tool_call>'
    '\n<tool_call>\n{"name":"get_time","arguments":{"tz":"a}b</tool"}}\n</tool_call>'
)


def parse(pieces_of_text):
    parser = ToolCallParser()
    pieces = [p for text in pieces_of_text for p in parser.feed(text)] + parser.finish()
    content = "".join(p.text for p in pieces if isinstance(p, Content))
    started = [(p.index, p.name) for p in pieces if isinstance(p, CallStarted)]
    arguments = {}
    for p in pieces:
        if isinstance(p, ArgumentsDelta):
            arguments[p.index] = arguments.get(p.index, "") + p.text
    return content, started, arguments, parser


def test_calls_and_content_come_apart_whole():
    content, started, arguments, parser = parse([CALLS])
    assert content == "Let me check."
    assert started == [(0, "get_weather"), (1, "get_time")]
    assert json.loads(arguments[0]) == {"city": "Paris", "when": {"day": "mon"}}
    assert json.loads(arguments[1]) == {"tz": "a}b</tool"}
    calls = [(name, args) for _, name, args in parser.calls()]
    assert calls == [("get_weather", arguments[0]), ("get_time", arguments[1])]


def test_any_chunking_gives_the_same_result():
    whole = parse([CALLS])[:3]
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(CALLS)), rng.randint(1, 30)))
        parts = [CALLS[a:b] for a, b in zip([0, *cuts], [*cuts, len(CALLS)])]
        assert parse(parts)[:3] == whole


def test_plain_text_and_a_lone_angle_bracket_stay_content():
    assert parse(["a < b and ", "<tool", " is not a call"])[0] == "a < b and <tool is not a call"


def test_a_call_cut_short_keeps_the_arguments_it_has():
    content, started, arguments, _ = parse(['<tool_call>\n{"name":"f","arguments":{"x":[1,2'])
    assert started == [(0, "f")] and arguments[0] == '{"x":[1,2'


def test_the_grammar_names_only_the_chosen_function():
    use = ToolUse((Function("a", None, {"type": "object"}), Function("b", None, {"type": "object"})), "b")
    grammar = use.grammar().source
    assert '"const": "b"' in grammar and '"const": "a"' not in grammar
    assert "TEXT" not in grammar
    assert "TEXT" in ToolUse(use.functions, "auto").grammar().source
