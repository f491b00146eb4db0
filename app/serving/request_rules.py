"""What the request models' validators refuse, as JSON Schema: the OpenAPI document declares it, so that
what the document allows is accepted and what is refused is documented (app/openapi.py fills in the
served model's vocabulary where TOKEN_ID marks a token id)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# Marks a token id in the wire models' JSON schemas: the OpenAPI document bounds it by the served
# model's vocabulary (app/openapi.py), which the models do not know.
TOKEN_ID = "x-token-id"
# Marks an image part: on a server of a text-only model the document allows none (app/openapi.py).
IMAGE_PART = "x-image-part"


# format_grammar's rule, declared: a json_schema format has a schema (`holder`: where it sits).
def schema_needed(holder: dict) -> dict:
    return {"if": {"properties": {"type": {"const": "json_schema"}}}, "then": holder}


NOT_NULL_SCHEMA = {"required": ["schema"], "properties": {"schema": {"not": {"type": "null"}}}}

# Each field that may constrain the output, and what it holds when it does not (JSON Schema).
UNCONSTRAINED = {
    "response_format": {"anyOf": [{"type": "null"}, {"properties": {"type": {"const": "text"}}}]},
    **{
        name: {"type": "null"}
        for name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
    },
}


def one_output_constraint(unconstrained: dict[str, dict]) -> dict:
    """What grammar() refuses, declared: at most one of these fields constrains the output (one branch per
    field that may)."""
    return {
        "anyOf": [
            {"properties": {other: schema for other, schema in unconstrained.items() if other != name}}
            for name in unconstrained
        ]
    }


_NOT_JSON = {"type": "null"}
# What the tools' grammar refuses, declared, where a request reads tools (chat, Responses; a completion
# ignores them, so declaring this there refused what the server accepts): with tools in use only a JSON
# constraint may apply.
ONLY_JSON_WITH_TOOLS = {
    "if": {
        "required": ["tools"],
        "properties": {"tools": {"type": "array", "minItems": 1}, "tool_choice": {"not": {"const": "none"}}},
    },
    "then": {
        "properties": {
            "guided_regex": _NOT_JSON,
            "guided_choice": _NOT_JSON,
            "guided_grammar": _NOT_JSON,
            "structured_outputs": {
                "anyOf": [
                    {"type": "null"},
                    {"properties": {"regex": _NOT_JSON, "choice": _NOT_JSON, "grammar": _NOT_JSON}},
                ]
            },
        }
    },
}


# resolve_tool_use's first rule, as the OpenAPI document declares it.
TOOL_CHOICE_NEEDS_TOOLS = {
    "if": {"required": ["tool_choice"], "properties": {"tool_choice": {"not": {"type": "null"}}}},
    "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}},
}

# ChatMessage's rule: a tool result names the call it answers and has content.
TOOL_MESSAGE = {
    "if": {"properties": {"role": {"const": "tool"}}},
    "then": {
        "required": ["tool_call_id", "content"],
        "properties": {"tool_call_id": {"type": "string"}, "content": {"not": {"type": "null"}}},
    },
}

TOP_LOGPROBS_NEED_LOGPROBS = {
    "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer", "minimum": 1}}},
    "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
}

# CompletionRequest.single_prompt()'s rules: one prompt, not empty (a batch of one is accepted too) ...
_TOKEN_IDS = {"type": "array", "items": {TOKEN_ID: True, "type": "integer", "minimum": 0}, "minItems": 1}
ONE_PROMPT = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        _TOKEN_IDS,
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1},
        {"type": "array", "items": _TOKEN_IDS, "minItems": 1, "maxItems": 1},
    ]
}
# ... and best_of only equal to n: JSON Schema cannot compare two fields, so 1 with n 1 is what is declared.
BEST_OF_ONE = {
    "if": {"required": ["best_of"], "properties": {"best_of": {"type": "integer"}}},
    "then": {"properties": {"best_of": {"const": 1}, "n": {"const": 1}}},
}


LOGIT_BIAS = {
    "anyOf": [
        {
            "type": "object",
            "propertyNames": {TOKEN_ID: True, "type": "string"},
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        },
        {"type": "null"},
    ]
}


def array_bounds(**bounds: int) -> Callable[[dict[str, Any]], None]:
    """For a field that takes a value or a list of them: `bounds` (minItems, maxItems) on the list."""

    def apply(schema: dict[str, Any]) -> None:
        for branch in schema["anyOf"]:
            if branch.get("type") == "array":
                branch.update(bounds)

    return apply
