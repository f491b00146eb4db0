"""The base of the OpenAI wire models clients send (protocol.py, messages.py, response_format.py,
responses_protocol.py): strict as OpenAI reads them, unknown fields ignored."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from app.serving.request_rules import TOKEN_ID


class RequestModel(BaseModel):
    # Strict, as OpenAI: 0 is not a boolean, 1.5 not an integer, "2" not a number; what the OpenAPI
    # document says a field takes is what it accepts.
    model_config = ConfigDict(extra="ignore", strict=True)


def _whole(value: object) -> object:
    # JSON Schema counts 1.0 as an integer; strict mode alone would refuse it.
    return int(value) if isinstance(value, float) and value.is_integer() else value


# After a field's own constraints in its Annotated (before them, pydantic drops them from the JSON schema).
WHOLE = BeforeValidator(_whole)
Int = Annotated[int, WHOLE]
TokenId = Annotated[int, Field(json_schema_extra={TOKEN_ID: True, "minimum": 0}), WHOLE]
