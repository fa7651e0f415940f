"""Render a conversation with the model's own chat template and tokenize it."""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from typing import Any

from services.common.errors import invalid_argument
from services.tokenizer.structs import struct_to_dict
from stormserve.chat.v1 import chat_pb2

MEDIA_TYPES = ("image_url", "video_url", "audio_url")


@dataclass(frozen=True)
class RenderedPrompt:
    text: str
    token_ids: list[int]


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


def message_to_dict(message: chat_pb2.ChatMessage) -> dict[str, Any]:
    """The message as the template sees it (OpenAI-style dict)."""
    if message.content_parts:
        if any(part.type in MEDIA_TYPES for part in message.content_parts):
            raise invalid_argument("this model accepts text only; media content parts are not supported")
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


def render(tokenizer, messages: list[chat_pb2.ChatMessage], tools: list[chat_pb2.Tool],
           template_kwargs: dict[str, Any], add_generation_prompt: bool = True) -> RenderedPrompt:
    """Apply the template; a final assistant message with `prefix: true` is continued, not closed."""
    if not messages:
        raise invalid_argument("messages must not be empty")
    conversation = [message_to_dict(m) for m in messages]
    last = messages[-1]
    continue_final = last.role == "assistant" and last.HasField("prefix") and last.prefix
    apply = partial(tokenizer.apply_chat_template, tools=[tool_to_dict(t) for t in tools] or None,
                    tokenize=False, add_generation_prompt=add_generation_prompt and not continue_final,
                    continue_final_message=continue_final, **template_kwargs)
    try:
        # Prior calls' arguments as objects first; a template that
        # concatenates them as text (DeepSeek) fails on that and gets the text.
        as_object = _arguments_as_object(conversation)
        try:
            text = apply(as_object or conversation)
        except TypeError:
            if as_object is None:
                raise
            text = apply(conversation)
    except Exception as exc:  # noqa: BLE001 - template errors are the caller's input problem
        raise invalid_argument(f"chat template failed: {exc}") from exc
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    return RenderedPrompt(text=text, token_ids=token_ids)
