"""The validated JSON request -> `chat_pb2.ChatRequest`, in one place.

Absent optional fields stay unset (the proto marks them `optional`), so the
backend applies the real defaults. The string form of `stop` becomes a
one-item list, `tool_choice` a `ToolChoice`, and free-form JSON objects
(`chat_template_kwargs`, function `parameters`, a json_schema) a
`google.protobuf.Struct` (numbers become doubles there).
"""
from __future__ import annotations

import time
import uuid
from typing import Any

from google.protobuf import struct_pb2
from stormserve.chat.v1 import chat_pb2

from services.common.chat_protocol import (
    ChatCompletionRequest,
    ContentPart,
    Message,
    ResponseFormat,
    Tool,
    ToolCall,
)

_OPTIONAL_SCALARS = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "ignore_eos",
    "max_tokens",
    "n",
    "best_of",
    "use_beam_search",
    "top_logprobs",
)
_TOOL_CHOICE_MODES = {
    "none": chat_pb2.TOOL_CHOICE_MODE_NONE,
    "auto": chat_pb2.TOOL_CHOICE_MODE_AUTO,
    "required": chat_pb2.TOOL_CHOICE_MODE_REQUIRED,
}
_RESPONSE_FORMAT_TYPES = {
    "text": chat_pb2.RESPONSE_FORMAT_TYPE_TEXT,
    "json_object": chat_pb2.RESPONSE_FORMAT_TYPE_JSON_OBJECT,
    "json_schema": chat_pb2.RESPONSE_FORMAT_TYPE_JSON_SCHEMA,
}


def new_request_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex


def now_us() -> int:
    return time.time_ns() // 1000


def to_struct(value: dict[str, Any]) -> struct_pb2.Struct:
    struct = struct_pb2.Struct()
    struct.update(value)
    return struct


def to_chat_request(
    request: ChatCompletionRequest, request_id: str | None = None, arrival_time_us: int | None = None
) -> chat_pb2.ChatRequest:
    message = chat_pb2.ChatRequest(
        request_id=request_id or new_request_id(),
        model=request.model,
        messages=[_message(m) for m in request.messages],
        stream=request.stream,
        stop=request.stop or [],
        stop_token_ids=request.stop_token_ids or [],
        tools=[_tool(t) for t in request.tools or ()],
        arrival_time_us=now_us() if arrival_time_us is None else arrival_time_us,
    )
    for name in _OPTIONAL_SCALARS:
        value = getattr(request, name)
        if value is not None:
            setattr(message, name, value)
    if request.wants_logprobs or request.logprobs is not None:
        message.logprobs = request.wants_logprobs
    choice = request.tool_choice
    if isinstance(choice, str):
        message.tool_choice.mode = _TOOL_CHOICE_MODES[choice]
    elif choice is not None:
        message.tool_choice.mode = chat_pb2.TOOL_CHOICE_MODE_FUNCTION
        message.tool_choice.function_name = choice.function.name
    if request.continue_final_message:
        message.messages[-1].prefix = True  # one mechanism for both spellings
    if request.chat_template_kwargs is not None:
        message.chat_template_kwargs.CopyFrom(to_struct(request.chat_template_kwargs))
    if request.response_format is not None:
        message.response_format.CopyFrom(_response_format(request.response_format))
    if request.include_usage is not None:
        # Present only when the client chose: absent keeps usage on the final chunk (the pages).
        message.stream_options.include_usage = request.include_usage
    return message


def _message(message: Message) -> chat_pb2.ChatMessage:
    out = chat_pb2.ChatMessage(
        role=message.role,
        content_parts=[_part(p) for p in message.parts],
        tool_calls=[_tool_call(i, c) for i, c in enumerate(message.tool_calls or ())],
    )
    if isinstance(message.content, str):
        out.content = message.content
    for name in ("name", "tool_call_id", "prefix", "reasoning_content"):
        value = getattr(message, name)
        if value is not None:
            setattr(out, name, value)
    return out


def _part(part: ContentPart) -> chat_pb2.ContentPart:
    out = chat_pb2.ContentPart(type=part.type, text=part.text or "")
    media = part.media()
    if media is not None:
        getattr(out, part.type).CopyFrom(chat_pb2.MediaUrl(url=media.url, detail=media.detail or ""))
    return out


def _tool_call(index: int, call: ToolCall) -> chat_pb2.ToolCall:
    return chat_pb2.ToolCall(
        index=index,
        id=call.id,
        type=call.type,
        function=chat_pb2.FunctionCall(name=call.function.name, arguments=call.function.arguments),
    )


def _tool(tool: Tool) -> chat_pb2.Tool:
    function = chat_pb2.FunctionDefinition(
        name=tool.function.name, description=tool.function.description or ""
    )
    if tool.function.parameters is not None:
        function.parameters.CopyFrom(to_struct(tool.function.parameters))
    if tool.function.strict is not None:
        function.strict = tool.function.strict
    return chat_pb2.Tool(type=tool.type, function=function)


def _response_format(response_format: ResponseFormat) -> chat_pb2.ResponseFormat:
    out = chat_pb2.ResponseFormat(type=_RESPONSE_FORMAT_TYPES[response_format.type])
    schema = response_format.json_schema
    if schema is not None:
        out.json_schema.name = schema.name
        out.json_schema.description = schema.description or ""
        out.json_schema.schema.CopyFrom(to_struct(schema.schema_))
        if schema.strict is not None:
            out.json_schema.strict = schema.strict
    return out
