"""Output constraints as clients send them: chat's `response_format`, vLLM's `structured_outputs`, and the
grammar each asks for (Responses' `text.format` reads the same through format_grammar)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import ConfigDict, Field

from app.errors import OpenAIError
from app.serving.json_schema import decoded_schema
from app.serving.request_rules import NOT_NULL_SCHEMA, schema_needed
from app.serving.wire import RequestModel
from engine.types import GrammarSpec


class JsonSchemaFormat(RequestModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    model_config = ConfigDict(
        json_schema_extra=schema_needed(
            {"required": ["json_schema"], "properties": {"json_schema": {"type": "object", **NOT_NULL_SCHEMA}}}
        )
    )

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def grammar(self) -> GrammarSpec | None:
        fmt = self.json_schema
        return format_grammar(self.type, fmt.schema_ if fmt else None, fmt.strict if fmt else None, "response_format")


class StructuredOutputs(RequestModel):
    """Extension (as vLLM's `structured_outputs`): exactly one of these constrains the output."""

    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": [
                *(
                    {"required": [name], "properties": {name: {"not": {"type": "null"}}}}
                    for name in ("json", "regex", "choice", "grammar")
                ),
                {"required": ["json_object"], "properties": {"json_object": {"const": True}}},
            ]
        }
    )

    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None

    def spec(self, param: str) -> GrammarSpec:
        found = [
            *([json_spec(self.json_, f"{param}.json")] if self.json_ is not None else []),
            *([GrammarSpec("regex", self.regex)] if self.regex is not None else []),
            *([GrammarSpec.choice(self.choice)] if self.choice is not None else []),
            *([GrammarSpec("grammar", self.grammar)] if self.grammar is not None else []),
            *([format_grammar("json_object", None, None, param)] if self.json_object else []),
        ]
        if len(found) != 1:
            raise OpenAIError(
                400, f"{param} needs exactly one of json, regex, choice, grammar, json_object", param=param
            )
        return found[0]


def format_grammar(kind: str, schema: dict | bool | None, strict: bool | None, param: str) -> GrammarSpec | None:
    """The grammar of an output format (chat's `response_format`, Responses' `text.format`); a schema
    is read as strict mode reads it unless `strict` is False (json_schema.py)."""
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec.json_schema({"type": "object"})
    if schema is None:
        raise OpenAIError(400, f"{param} of type json_schema needs a schema", param=param)
    return json_spec(schema, param, strict)


def json_spec(schema: dict | bool | str, param: str, strict: bool | None = None) -> GrammarSpec:
    """The grammar of a JSON schema given as an object or as JSON text (guided_json, structured_outputs'
    json), read as strict mode reads it unless `strict` is False."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise OpenAIError(400, f"{param} is not valid JSON: {exc}", param=param) from exc
    if not isinstance(schema, (dict, bool)):
        raise OpenAIError(400, f"{param} must be a JSON schema (an object)", param=param)
    if schema is False:
        raise OpenAIError(400, f"{param}: the schema false admits no JSON value", param=param)
    if schema is True:
        # JSON Schema's true admits any value, as {} does; the grammar compiler takes objects only.
        schema = {}
    return GrammarSpec.json_schema(decoded_schema(schema, strict))
