"""Output parsers per model family: reasoning (`<think>`) and tool calls.

Each tool parser streams (`feed(text) -> ParsedDelta`, `flush()`) and has a
non-stream `parse_complete(text) -> (content, calls)`. `tool_parser_for`
chooses one from config or detects it from the model type and chat template.
"""
from __future__ import annotations

from services.tokenizer.parsers import deepseek, glm3, hermes

PARSERS = {
    "hermes": (hermes.HermesToolParser, hermes.parse_complete),
    "qwen2_5": (hermes.HermesToolParser, hermes.parse_complete),
    "qwen3": (hermes.HermesToolParser, hermes.parse_complete),
    "deepseek_v3": (deepseek.DeepSeekToolParser, deepseek.parse_complete),
    "chatglm3": (glm3.Glm3ToolParser, glm3.parse_complete),
}


def detect_tool_parser(model_type: str, chat_template: str | None) -> str | None:
    """The parser name for a model, from its config's model_type and its template."""
    template = chat_template or ""
    if deepseek.CALL_BEGIN in template or model_type.startswith("deepseek"):
        return "deepseek_v3"
    if hermes.START in template or model_type in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe"):
        return "hermes"
    if model_type == "chatglm" or "<|observation|>" in template:
        return "chatglm3"
    return None
