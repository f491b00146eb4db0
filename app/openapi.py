"""The OpenAPI document as this server enforces it: FastAPI's, from the routes and wire models, with
this server's limits filled in where the models cannot know them (the vocabulary, --max-num-seqs,
--max-tokens-limit, whether the model takes images) and without FastAPI's 422 responses (validation errors
are answered 400)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from app.serving.protocol import ServingLimits
from app.serving.request_rules import IMAGE_PART, TOKEN_ID

_MAX_TOKENS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def install_openapi(app: FastAPI, limits: Callable[[], ServingLimits | None]) -> None:
    """`app.openapi()` builds the document once the server's limits are known (before that, as
    `create_app` alone does, without them)."""

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for operations in document.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        _exact_integer_bounds(document)
        served = limits()
        if served is None:
            return document
        _bound_token_ids(document, served.vocab_size)
        schemas = document["components"]["schemas"]
        for schema in schemas.values():
            _bound_request(schema.get("properties", {}), served)
        if not served.takes_images:
            # A text-only model refuses every image part (400): the unions of parts offer none.
            _drop_branches(document, {f"#/components/schemas/{n}" for n, s in schemas.items() if s.get(IMAGE_PART)})
        app.openapi_schema = document
        return document

    app.openapi = openapi


def _bound_token_ids(node: Any, vocab_size: int) -> None:
    """Every schema marked TOKEN_ID: an integer below vocab_size, or a string naming one."""
    if isinstance(node, list):
        for item in node:
            _bound_token_ids(item, vocab_size)
    elif isinstance(node, dict):
        if node.get(TOKEN_ID):
            if node.get("type") == "string":
                node["pattern"] = f"^{below(vocab_size)}$"
            else:
                node["maximum"] = vocab_size - 1
        for value in node.values():
            _bound_token_ids(value, vocab_size)


def _exact_integer_bounds(node: Any) -> None:
    """An integer's bounds as the integers the models declare. FastAPI's OpenAPI model reads every bound as a
    float (a seed's -2**63 became -9.223372036854776e+18), and a validator that then compares in floats takes
    a seed of -2**63 - 191 for a valid one, which the server refuses. Every integer bound the models
    declare is a float exactly (small, or a power of two), so the float's value is the bound's."""
    if isinstance(node, list):
        for item in node:
            _exact_integer_bounds(item)
    elif isinstance(node, dict):
        if node.get("type") == "integer":
            for key in _BOUNDS:
                if isinstance(node.get(key), float) and node[key].is_integer():
                    node[key] = int(node[key])
        for value in node.values():
            _exact_integer_bounds(value)


def _drop_branches(node: Any, refs: set[str]) -> None:
    """Take the schemas `refs` out of every oneOf / anyOf (and its discriminator's mapping)."""
    if isinstance(node, list):
        for item in node:
            _drop_branches(item, refs)
    elif isinstance(node, dict):
        for key in ("oneOf", "anyOf"):
            if key in node:
                node[key] = [branch for branch in node[key] if branch.get("$ref") not in refs]
        mapping = node.get("discriminator", {}).get("mapping", {})
        for value, ref in list(mapping.items()):
            if ref in refs:
                del mapping[value]
        for value in node.values():
            _drop_branches(value, refs)


def _bound_request(properties: dict[str, Any], served: ServingLimits) -> None:
    if "n" in properties:
        properties["n"]["maximum"] = min(properties["n"].get("maximum", served.max_num_seqs), served.max_num_seqs)
    for name in _MAX_TOKENS:
        if name in properties and served.max_tokens_limit is not None:
            for branch in properties[name].get("anyOf", [properties[name]]):
                if branch.get("type") == "integer":
                    branch["maximum"] = served.max_tokens_limit


def below(n: int) -> str:
    """A regular expression matching exactly the decimal numbers 0 to n - 1, without leading zeros."""
    top = str(n - 1)
    # Numbers with fewer digits than n - 1, then those with as many digits, prefix by prefix.
    if top == "0":
        return "(0)"
    alternatives = ["0", *(f"[1-9][0-9]{{{width - 1}}}" for width in range(1, len(top)))]
    for i, digit in enumerate(top):
        low = "1" if i == 0 else "0"
        rest = len(top) - i - 1
        if digit > low:
            alternatives.append(f"{re.escape(top[:i])}[{low}-{int(digit) - 1}][0-9]{{{rest}}}")
    alternatives.append(top)
    return "(" + "|".join(alternatives) + ")"
