"""Turns `response_format` into the grammar the worker enforces, checked here
so a bad schema is the caller's 422, not a failed engine step."""
from __future__ import annotations

import json

import llguidance

from services.common.errors import invalid_argument
from services.tokenizer.structs import struct_to_dict
from stormserve.chat.v1 import chat_pb2
from stormserve.scheduler.v1 import scheduler_pb2


def response_format_grammar(response_format: chat_pb2.ResponseFormat) -> scheduler_pb2.Grammar | None:
    kind = response_format.type
    if kind == chat_pb2.RESPONSE_FORMAT_TYPE_JSON_OBJECT:
        return scheduler_pb2.Grammar(kind=scheduler_pb2.GRAMMAR_KIND_JSON_OBJECT)
    if kind != chat_pb2.RESPONSE_FORMAT_TYPE_JSON_SCHEMA:
        return None
    if not response_format.json_schema.HasField("schema"):
        raise invalid_argument("response_format.json_schema.schema is required")
    schema = json.dumps(struct_to_dict(response_format.json_schema.schema))
    check_json_schema(schema)
    return scheduler_pb2.Grammar(kind=scheduler_pb2.GRAMMAR_KIND_JSON_SCHEMA, source=schema)


def check_json_schema(schema: str) -> None:
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    except (ValueError, RuntimeError) as exc:
        raise invalid_argument(f"response_format.json_schema.schema cannot be enforced: {exc}") from exc
    message = llguidance.LLMatcher.validate_grammar(grammar)
    if message and not message.startswith("WARNING"):
        raise invalid_argument(f"response_format.json_schema.schema cannot be enforced: {message}")
