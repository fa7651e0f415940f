"""A conversation as the chat template sees it: the messages and tools as
dicts, checked template kwargs, and the jobs render_worker.py renders."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from services.common.errors import invalid_argument
from services.common.template_kwargs import REQUEST_TEMPLATE_KEY, reserved_key
from services.tokenizer.multimodal import ProcessedImage
from services.tokenizer.structs import struct_to_dict
from stormserve.chat.v1 import chat_pb2

MEDIA_TYPES = ("image_url", "video_url", "audio_url")


@dataclass(frozen=True)
class RenderedPrompt:
    text: str
    token_ids: list[int]  # image tokens expanded
    images: list[ProcessedImage] = field(default_factory=list)  # in prompt order


def media_parts(messages: list[chat_pb2.ChatMessage]) -> list[tuple[str, str, str]]:
    """(kind, url, where) of every media part, in conversation order."""
    return [
        (part.type.removesuffix("_url"), getattr(part, part.type).url, f"messages[{i}].content[{j}].{part.type}")
        for i, message in enumerate(messages)
        for j, part in enumerate(message.content_parts)
        if part.type in MEDIA_TYPES
    ]


def _arguments_as_object(conversation: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The conversation with prior calls' arguments as dicts, or None when no
    call has JSON-object arguments. Templates disagree: most (Qwen2.5, Llama,
    Mistral) write `arguments | tojson`, the transformers convention, which
    would quote a JSON string twice; DeepSeek's concatenates the text."""
    changed = False
    out = []
    for message in conversation:
        calls = []
        for call in message.get("tool_calls", ()):
            try:
                value = json.loads(call["function"]["arguments"])
            except ValueError:
                value = None
            if isinstance(value, dict):
                call = {**call, "function": {**call["function"], "arguments": value}}
                changed = True
            calls.append(call)
        out.append({**message, "tool_calls": calls} if calls else message)
    return out if changed else None


def message_to_dict(message: chat_pb2.ChatMessage, accepts_images: bool = False) -> dict[str, Any]:
    """The message as the template sees it (OpenAI-style dict). With images,
    its content is the list of parts that vision-language templates read:
    {"type": "text", "text": ...} and {"type": "image"}."""
    content: str | list[dict[str, str]]
    media = [part.type for part in message.content_parts if part.type in MEDIA_TYPES]
    if media:
        if not accepts_images:
            # Before any fetch (media.py): a model that cannot use media never reaches out for it.
            raise invalid_argument("this model accepts text only; media content parts are not supported")
        if any(kind != "image_url" for kind in media):
            raise invalid_argument("this model accepts text and images only; video_url and audio_url parts "
                                   "are not supported")
        content = [{"type": "image"} if part.type == "image_url" else {"type": "text", "text": part.text}
                   for part in message.content_parts]
    elif message.content_parts:
        content = "".join(part.text for part in message.content_parts if part.type == "text")
    else:
        # Templates concatenate content; an assistant turn with only tool calls has none.
        content = message.content if message.HasField("content") else ""
    result: dict[str, Any] = {"role": message.role, "content": content}
    if message.HasField("name"):
        result["name"] = message.name
    if message.tool_calls:
        result["tool_calls"] = [
            {"id": c.id, "type": c.type or "function",
             "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in message.tool_calls
        ]
    if message.HasField("tool_call_id"):
        result["tool_call_id"] = message.tool_call_id
    if message.HasField("reasoning_content"):
        result["reasoning_content"] = message.reasoning_content
    return result


def tool_to_dict(tool: chat_pb2.Tool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.function.name}
    if tool.function.description:
        function["description"] = tool.function.description
    if tool.function.HasField("parameters"):
        function["parameters"] = struct_to_dict(tool.function.parameters)
    return {"type": tool.type or "function", "function": function}


def reject_unsafe_kwargs(template_kwargs: dict[str, Any], allow_request_template: bool) -> None:
    """Keys a client may not send: the renderer's own, and a template of its
    own unless the operator trusts request templates."""
    key = reserved_key(template_kwargs)
    if key is not None:
        raise invalid_argument(f"chat_template_kwargs.{key} is reserved and cannot be set by a request")
    if REQUEST_TEMPLATE_KEY in template_kwargs:
        if not allow_request_template:
            raise invalid_argument(
                "chat_template_kwargs.chat_template: request-supplied chat templates are disabled on this "
                "server (the operator enables them with TRUST_REQUEST_CHAT_TEMPLATE)")
        if not isinstance(template_kwargs[REQUEST_TEMPLATE_KEY], str):
            raise invalid_argument("chat_template_kwargs.chat_template must be a string")


def render_jobs(tokenizer, messages: list[chat_pb2.ChatMessage], tools: list[chat_pb2.Tool],
                template_kwargs: dict[str, Any], add_generation_prompt: bool, max_chars: int,
                accepts_images: bool = False) -> list[dict[str, Any]]:
    """The render_worker job(s) for a conversation, best first: prior calls'
    arguments as objects, then (only if that fails with a TypeError, as a
    template that concatenates them as text (DeepSeek) does) as sent.
    A final assistant message with `prefix: true` is continued, not closed."""
    if not messages:
        raise invalid_argument("messages must not be empty")
    conversation = [message_to_dict(m, accepts_images) for m in messages]
    last = messages[-1]
    continue_final = last.role == "assistant" and last.HasField("prefix") and last.prefix
    kwargs = dict(template_kwargs)
    request_template = kwargs.pop(REQUEST_TEMPLATE_KEY, None)
    tool_dicts = [tool_to_dict(t) for t in tools] or None
    try:
        template = tokenizer.get_chat_template(request_template, tool_dicts)
    except ValueError as exc:  # the model has no template
        raise invalid_argument(f"chat template failed: {exc}") from exc
    job = {
        "template": template, "tools": tool_dicts,
        # As apply_chat_template: the request's kwargs override the special tokens.
        "template_vars": {**tokenizer.special_tokens_map, **kwargs},
        "add_generation_prompt": add_generation_prompt and not continue_final,
        "continue_final_message": continue_final, "max_chars": max_chars,
    }
    as_object = _arguments_as_object(conversation)
    return [{**job, "messages": c} for c in (as_object, conversation) if c is not None]
