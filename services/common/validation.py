"""Building blocks of the strict request models (chat_protocol.py): the base model (strict types,
unknown keys ignored, `null` = absent), range and pattern checks with readable
messages, and unions chosen by JSON kind."""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Discriminator, GetCoreSchemaHandler, GetJsonSchemaHandler, model_validator
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, PydanticCustomError, core_schema

# Union members are chosen by JSON kind; their tags appear in error locations
# and are dropped by errors.py (every tag is wrapped in <>).
STR, LIST, OBJECT = "<str>", "<list>", "<object>"


def _json_kind(value: Any) -> str | None:
    if isinstance(value, str):
        return STR
    if isinstance(value, list):
        return LIST
    if isinstance(value, dict):
        return OBJECT
    return None


def by_json_kind(message: str) -> Discriminator:
    return Discriminator(_json_kind, custom_error_type="json_kind", custom_error_message=message)


def request_rule(message: str) -> PydanticCustomError:
    """A rule that spans several fields; errors.py shows it after the path."""
    return PydanticCustomError("request_rule", message)


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


class _Check:
    """An after-validator that also states its rule in the JSON schema (/openapi.json)."""

    def __init__(self, check: Callable[[Any], Any], schema: dict[str, Any]):
        self.check = check
        self.schema = schema

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.no_info_after_validator_function(self.check, handler(source))

    def __get_pydantic_json_schema__(self, schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        return {**handler(schema), **self.schema}


def in_range(lo: float, hi: float, *, lo_open: bool = False, message: str | None = None) -> _Check:
    """Closed range check [lo, hi] (or (lo, hi] with lo_open) with a readable message."""
    text = message or f"must be in {'(' if lo_open else '['}{_fmt(lo)}, {_fmt(hi)}]"

    def check(value: float) -> float:
        if (value > lo if lo_open else value >= lo) and value <= hi:
            return value
        raise ValueError(text)

    return _Check(check, {"exclusiveMinimum" if lo_open else "minimum": lo, "maximum": hi})


def matches(pattern: re.Pattern[str], message: str) -> _Check:
    """Whole-string pattern check; `message` names the rule."""

    def check(value: str) -> str:
        if pattern.fullmatch(value):
            return value
        raise ValueError(message)

    return _Check(check, {"pattern": f"^{pattern.pattern}$"})


class StrictModel(BaseModel):
    """Strict types, unknown keys ignored, and `null` treated as absent."""

    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


# -- messages: a pydantic error as '<field path> <rule>' ---------------------------

_TYPE_RULES = {
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "bool_type": "must be a boolean",
    "bool_parsing": "must be a boolean",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "dict_type": "must be an object",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
    "missing": "is required",
    "finite_number": "must be a finite number",
}


def field_path(loc: Sequence[str | int]) -> str:
    """('messages', 0, 'content', '<list>', 1, 'text') -> 'messages[0].content[1].text' (union tags dropped)."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not (part.startswith("<") and part.endswith(">")):
            path += f".{part}" if path else part
    return path


def describe_error(error: dict[str, Any]) -> str:
    """One pydantic error as '<field> <rule>'."""
    path = field_path(error.get("loc", ()))
    kind = error.get("type", "")
    ctx = error.get("ctx") or {}
    if kind == "value_error":
        rule = str(ctx.get("error", error.get("msg", "")))
    elif kind == "request_rule":
        return f"{path}: {error['msg']}" if path else error["msg"]
    elif kind == "literal_error":
        rule = f"must be one of {ctx.get('expected')}"
    elif kind in ("too_short", "string_too_short"):
        unit = "items" if kind == "too_short" else "characters"
        minimum = ctx.get("min_length")
        rule = "must not be empty" if minimum == 1 else f"must have at least {minimum} {unit}"
    elif kind == "string_too_long":
        rule = f"must be at most {ctx.get('max_length')} characters"
    else:
        rule = _TYPE_RULES.get(kind) or str(error.get("msg", "is invalid"))
    return f"{path} {rule}" if path else rule


def describe_validation(errors: Sequence[dict[str, Any]]) -> str:
    return "; ".join(dict.fromkeys(describe_error(e) for e in errors)) or "invalid request"
