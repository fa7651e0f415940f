"""Building blocks of the strict request models: the base model (strict types,
unknown keys ignored, `null` = absent), range and pattern checks with readable
messages, and unions chosen by JSON kind."""
from __future__ import annotations

import re
from collections.abc import Callable
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
