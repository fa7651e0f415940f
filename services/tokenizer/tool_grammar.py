"""`tool_choice` `required` or a named function, enforced: a llguidance Lark
grammar (scheduler Grammar kind LARK) that lets the model write only calls of
the offered functions, in the model's own tool format, with arguments that
match each function's `parameters` schema (embedded with `%json`). The output
then always parses as tool calls, whatever the model would have written.

Formats with a grammar: hermes (Qwen2.5/Qwen3 and the default), DeepSeek V3/R1
and V3.1, and ChatGLM3. ChatGLM3 writes one call as Python keyword arguments,
`tool_call(key=value, ...)`: each value is a JSON value from the property's
schema (JSON strings, numbers, arrays and objects are Python literals too),
except booleans and null, written `True`/`False`/`None`. A schema that nests a
boolean or null inside an array or object has no such grammar and is refused.
"""
from __future__ import annotations

import json
from typing import Any

import llguidance

from services.common.errors import invalid_argument
from services.tokenizer.formats import ModelFormats, OutputOptions
from services.common.json_grammar import JSON_OPTIONS
from services.tokenizer.parsers import deepseek, hermes
from services.tokenizer.parsers.reasoning import THINK_END
from services.tokenizer.structs import struct_to_dict
from stormserve.chat.v1 import chat_pb2
from stormserve.scheduler.v1 import scheduler_pb2

FORCING_MODES = (chat_pb2.TOOL_CHOICE_MODE_REQUIRED, chat_pb2.TOOL_CHOICE_MODE_FUNCTION)


def arguments_schema(function: chat_pb2.FunctionDefinition) -> dict[str, Any]:
    """The schema the arguments must match. No `parameters`: no arguments, `{}`.
    `additionalProperties` defaults to false, as the API page documents."""
    if function.HasField("parameters"):
        schema = struct_to_dict(function.parameters)
    else:
        schema = {"type": "object", "properties": {}}
    if schema.get("type") == "object":
        schema.setdefault("additionalProperties", False)
    return {**schema, "x-guidance": JSON_OPTIONS}


def _lit(text: str) -> str:
    """A Lark string literal (JSON string syntax)."""
    return json.dumps(text)


class _Writer:
    """Lark pieces for one model: a marker that is one added token is named by
    id (`<[id]>`), so the model writes that token, special or not."""

    def __init__(self, formats: ModelFormats):
        self._ids = formats.marker_ids

    def marker(self, text: str) -> str:
        return f"<[{self._ids[text]}]>" if text in self._ids else _lit(text)


def _hermes_call(w: _Writer, name: str, schema: dict[str, Any]) -> str:
    # The key order the hermes parser streams from: name first, then arguments.
    head = _lit('\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": ')
    return f'{w.marker(hermes.START)} {head} %json {json.dumps(schema)} {_lit("}")} "\\n" {w.marker(hermes.END)}'


def _deepseek_v3_call(w: _Writer, name: str, schema: dict[str, Any]) -> str:
    return (f'{w.marker(deepseek.CALL_BEGIN)} "function" {w.marker(deepseek.SEP)} '
            f'{_lit(name + chr(10) + "```json" + chr(10))} %json {json.dumps(schema)} {_lit(chr(10) + "```")} '
            f'{w.marker(deepseek.CALL_END)}')


def _deepseek_v31_call(w: _Writer, name: str, schema: dict[str, Any]) -> str:
    return (f'{w.marker(deepseek.CALL_BEGIN)} {_lit(name)} {w.marker(deepseek.SEP)} %json {json.dumps(schema)} '
            f'{w.marker(deepseek.CALL_END)}')


_PYTHON_ONLY = {"boolean": '("True" | "False")', "null": '"None"'}


def _python_value(name: str, schema: dict[str, Any]) -> str:
    """A Python literal for one keyword argument of a ChatGLM3 call."""
    kind = schema.get("type")
    kind = kind[0] if isinstance(kind, list) and len(kind) == 1 else kind
    if isinstance(kind, str) and kind in _PYTHON_ONLY:
        return _PYTHON_ONLY[kind]
    if _mentions_bool_or_null(schema):
        raise invalid_argument(f"tools cannot be enforced for the chatglm3 format: argument {name!r} "
                               "nests a boolean or null, which Python writes differently from JSON")
    return f"%json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}"


def _mentions_bool_or_null(value: Any) -> bool:
    if isinstance(value, dict):
        kinds = value.get("type")
        kinds = kinds if isinstance(kinds, list) else [kinds]
        literals = value.get("enum", []) + ([value["const"]] if "const" in value else [])
        if {"boolean", "null"} & set(kinds) or any(v is None or isinstance(v, bool) for v in literals):
            return True
        return any(_mentions_bool_or_null(v) for k, v in value.items() if k not in ("enum", "const"))
    if isinstance(value, list):
        return any(_mentions_bool_or_null(v) for v in value)
    return False


def _chatglm3_call(w: _Writer, name: str, schema: dict[str, Any]) -> str:
    """`NAME` line, then a python fence holding `tool_call(k=v, ...)`: the required
    arguments in schema order, then any of the optional ones, in schema order."""
    properties = schema.get("properties") or {}
    required = [k for k in properties if k in set(schema.get("required") or [])]
    optional = [k for k in properties if k not in required]
    pair = {k: f"{_lit(k + '=')} {_python_value(k, properties[k])}" for k in properties}
    comma = _lit(", ")
    if required:
        arguments = f" {comma} ".join(pair[k] for k in required)
        arguments += "".join(f" ({comma} {pair[k]})?" for k in optional)
    elif optional:
        # The first argument written has no comma before it.
        firsts = [pair[k] + "".join(f" ({comma} {pair[o]})?" for o in optional[i + 1:])
                  for i, k in enumerate(optional)]
        arguments = f"({' | '.join(f'({f})' for f in firsts)})?"
    else:
        arguments = ""
    return f'{_lit(name + chr(10) + "```python" + chr(10) + "tool_call(")} {arguments} {_lit(")" + chr(10) + "```")}'


# Spaces and newlines a forced call may follow `</think>` by (models write "\n\n").
MAX_BLANKS_AFTER_THINK = 4

# format -> (one call, what goes between calls (None: one call per reply), what wraps all of them)
_FORMATS = {
    "hermes": (_hermes_call, '"\\n"', None),
    "deepseek_v3": (_deepseek_v3_call, '"\\n"', (deepseek.CALLS_BEGIN, deepseek.CALLS_END)),
    "deepseek_v31": (_deepseek_v31_call, "", (deepseek.CALLS_BEGIN, deepseek.CALLS_END)),
    "chatglm3": (_chatglm3_call, None, None),
}
_FORMATS["qwen2_5"] = _FORMATS["qwen3"] = _FORMATS["hermes"]


def tool_choice_lark(tools: list[chat_pb2.Tool], tool_format: str, formats: ModelFormats,
                     reasoning: bool, single: bool) -> str:
    """The grammar text: one call (a named function) or one or more calls."""
    if tool_format not in _FORMATS:
        raise invalid_argument(f"tool_choice required or a named function is not supported for the "
                               f"{tool_format} tool format")
    write_call, separator, wrap = _FORMATS[tool_format]
    w = _Writer(formats)
    rules = [f"call: {' | '.join(f'call_{i}' for i in range(len(tools)))}"]
    for i, tool in enumerate(tools):
        rules.append(f"call_{i}: {write_call(w, tool.function.name, arguments_schema(tool.function))}")
    calls = "call" if single or separator is None else f"call ({separator} call)*"
    if wrap is not None:
        calls = f"{w.marker(wrap[0])} {calls} {w.marker(wrap[1])}"
    if reasoning:
        # The think block comes first and stays free; the calls follow `</think>`
        # after a little whitespace: bounded, or a model could put the call off
        # with blank lines until max_tokens.
        calls = f"think /[ \\n]{{0,{MAX_BLANKS_AFTER_THINK}}}/ {calls}"
        end_id = formats.marker_ids.get(THINK_END)
        if end_id in formats.special_marker_ids:  # not text: the free text cannot swallow it
            rules += [f"think: THINK_TEXT <[{end_id}]>", "THINK_TEXT: /(?s:.*)/"]
        else:  # text: lazy, so the block ends at the first `</think>`
            rules.append(r"think[lazy]: /(?s:.*)<\/think>/")
    return "\n".join([f"start: {calls}", *rules]) + "\n"


def tool_choice_grammar(request: chat_pb2.ChatRequest, options: OutputOptions,
                        formats: ModelFormats) -> scheduler_pb2.Grammar | None:
    """The grammar that forces the call(s), or None when the model may choose."""
    choice = request.tool_choice
    if choice.mode not in FORCING_MODES:
        return None
    if not request.tools:
        raise invalid_argument("tool_choice required or a named function needs tools")
    if request.response_format.type not in (chat_pb2.RESPONSE_FORMAT_TYPE_UNSPECIFIED,
                                            chat_pb2.RESPONSE_FORMAT_TYPE_TEXT):
        raise invalid_argument("response_format cannot be combined with tool_choice required or a named function")
    tools = list(request.tools)
    if choice.mode == chat_pb2.TOOL_CHOICE_MODE_FUNCTION:
        tools = [t for t in tools if t.function.name == choice.function_name]
        if not tools:
            raise invalid_argument(f"tool_choice names function {choice.function_name!r}, which is not in tools")
        tools = tools[:1]
    source = tool_choice_lark(tools, options.tool_parser or formats.tool_parser, formats, options.reasoning,
                              single=choice.mode == chat_pb2.TOOL_CHOICE_MODE_FUNCTION)
    try:
        message = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(source))
    except (ValueError, RuntimeError) as exc:
        message = str(exc)
    if message and not message.startswith("WARNING"):
        raise invalid_argument(f"tools cannot be enforced: {message}")
    return scheduler_pb2.Grammar(kind=scheduler_pb2.GRAMMAR_KIND_LARK, source=source)
