"""Every ChatService call checked against the rules the HTTP edge applies to
its JSON bodies (services/common/chat_protocol.py), whichever door it came
through: the edge, native gRPC, gRPC-Web or Envoy's transcoded JSON.

A ChatRequest is turned back into the JSON shape of the documented request
(the inverse of the edge's services/http_edge/convert.py) and validated by the
same pydantic model, so one definition of the rules serves both. A violation
is INVALID_ARGUMENT naming the field, as the edge's 422 does; nothing of it
reaches the scheduler or a worker."""
from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter, ValidationError
from stormserve.chat.v1 import chat_pb2

from services.common.chat_protocol import ChatCompletionRequest, Message
from services.common.errors import invalid_argument
from services.common.validation import describe_validation
from services.tokenizer.structs import struct_to_dict

_OPTIONAL_SCALARS = (
    "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k", "seed",
    "include_stop_str_in_output", "skip_special_tokens", "ignore_eos", "max_tokens", "n", "best_of",
    "use_beam_search", "logprobs", "top_logprobs",
)
_TOOL_CHOICE_MODES = {
    chat_pb2.TOOL_CHOICE_MODE_NONE: "none",
    chat_pb2.TOOL_CHOICE_MODE_AUTO: "auto",
    chat_pb2.TOOL_CHOICE_MODE_REQUIRED: "required",
}
_RESPONSE_FORMAT_TYPES = {
    chat_pb2.RESPONSE_FORMAT_TYPE_UNSPECIFIED: "text",
    chat_pb2.RESPONSE_FORMAT_TYPE_TEXT: "text",
    chat_pb2.RESPONSE_FORMAT_TYPE_JSON_OBJECT: "json_object",
    chat_pb2.RESPONSE_FORMAT_TYPE_JSON_SCHEMA: "json_schema",
}
_MESSAGES = TypeAdapter(list[Message])


def _optional(message: Any, names: tuple[str, ...]) -> dict[str, Any]:
    return {name: getattr(message, name) for name in names if message.HasField(name)}


def _message(message: chat_pb2.ChatMessage, index: int) -> dict[str, Any]:
    if message.HasField("content") and message.content_parts:
        raise invalid_argument(f"messages[{index}]: content and content_parts exclude each other")
    out: dict[str, Any] = {"role": message.role,
                           **_optional(message, ("content", "name", "tool_call_id", "prefix", "reasoning_content"))}
    if message.content_parts:
        out["content"] = [_part(p) for p in message.content_parts]
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": c.type,
                              "function": {"name": c.function.name, "arguments": c.function.arguments}}
                             for c in message.tool_calls]
    return out


def _part(part: chat_pb2.ContentPart) -> dict[str, Any]:
    out: dict[str, Any] = {"type": part.type or None}
    if part.text:
        out["text"] = part.text
    for kind in ("image_url", "video_url", "audio_url"):
        if part.HasField(kind):
            media = getattr(part, kind)
            out[kind] = {"url": media.url, "detail": media.detail or None}
    return out


def _tool(tool: chat_pb2.Tool) -> dict[str, Any]:
    function = tool.function
    out: dict[str, Any] = {"name": function.name, "description": function.description or None}
    if function.HasField("parameters"):
        out["parameters"] = struct_to_dict(function.parameters)
    if function.HasField("strict"):
        out["strict"] = function.strict
    return {"type": tool.type, "function": out}


def _tool_choice(choice: chat_pb2.ToolChoice) -> Any:
    if choice.mode == chat_pb2.TOOL_CHOICE_MODE_FUNCTION:
        return {"type": "function", "function": {"name": choice.function_name}}
    return _TOOL_CHOICE_MODES.get(choice.mode)


def _response_format(response_format: chat_pb2.ResponseFormat) -> dict[str, Any]:
    out: dict[str, Any] = {"type": _RESPONSE_FORMAT_TYPES[response_format.type]}
    if response_format.HasField("json_schema"):
        schema = response_format.json_schema
        out["json_schema"] = {"name": schema.name, "description": schema.description or None,
                              "schema": struct_to_dict(schema.schema), **_optional(schema, ("strict",))}
    return out


def request_json(request: chat_pb2.ChatRequest) -> dict[str, Any]:
    """The documented JSON request that `request` carries (absent fields left out)."""
    out: dict[str, Any] = {
        "model": request.model or None,
        "messages": [_message(m, i) for i, m in enumerate(request.messages)],
        "stream": request.stream,
        **_optional(request, _OPTIONAL_SCALARS),
    }
    if request.stop:
        out["stop"] = list(request.stop)
    if request.stop_token_ids:
        out["stop_token_ids"] = list(request.stop_token_ids)
    if request.tools:
        out["tools"] = [_tool(t) for t in request.tools]
    if request.HasField("tool_choice"):
        out["tool_choice"] = _tool_choice(request.tool_choice)
    if request.HasField("chat_template_kwargs"):
        out["chat_template_kwargs"] = struct_to_dict(request.chat_template_kwargs)
    if request.HasField("response_format"):
        out["response_format"] = _response_format(request.response_format)
    if request.HasField("stream_options"):
        out["stream_options"] = {"include_usage": request.stream_options.include_usage}
    return out


def _refuse(exc: ValidationError, *prefix: str) -> Exception:
    errors = [{**e, "loc": (*prefix, *e["loc"])} for e in exc.errors(include_url=False)]
    return invalid_argument(describe_validation(errors))


def check_chat_request(request: chat_pb2.ChatRequest) -> None:
    """INVALID_ARGUMENT naming the field when `request` breaks a documented rule."""
    try:
        ChatCompletionRequest.model_validate(request_json(request))
    except ValidationError as exc:
        raise _refuse(exc) from None


def check_messages(messages: Any) -> None:
    """The same for a bare conversation (TokenizerService.ApplyChatTemplate)."""
    try:
        _MESSAGES.validate_python([_message(m, i) for i, m in enumerate(messages)])
    except ValidationError as exc:
        raise _refuse(exc, "messages") from None
