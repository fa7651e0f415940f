"""google.protobuf.Struct → plain Python. Struct stores every number as a
double, so integral values come back as int: a schema's `maxLength: 20` or a
template's `thinking_budget: 512` must not turn into 20.0."""
from __future__ import annotations

from typing import Any

from google.protobuf import json_format, struct_pb2


def _restore_ints(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _restore_ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_restore_ints(v) for v in value]
    return value


def struct_to_dict(struct: struct_pb2.Struct) -> dict[str, Any]:
    return _restore_ints(json_format.MessageToDict(struct))
