"""Output parsers per model family: reasoning (`<think>`) and tool calls.

Each tool parser streams (`feed(text) -> ParsedDelta`, `flush()`) and has a
non-stream `parse_complete(text) -> (content, calls)`. Names follow MindIE's
`tool_call_parser` values; `detect_tool_parser` picks one from the model type
and chat template.
"""
from __future__ import annotations

from services.tokenizer.parsers import deepseek, glm3, hermes
from services.tokenizer.parsers.reasoning import THINK_END, THINK_START

PARSERS = {
    "hermes": (hermes.HermesToolParser, hermes.parse_complete),
    "qwen2_5": (hermes.HermesToolParser, hermes.parse_complete),
    "qwen3": (hermes.HermesToolParser, hermes.parse_complete),
    # One parser reads both DeepSeek forms; the names differ for the grammar
    # that forces a call (tool_grammar.py), which must write the right one.
    "deepseek_v3": (deepseek.DeepSeekToolParser, deepseek.parse_complete),
    "deepseek_v31": (deepseek.DeepSeekToolParser, deepseek.parse_complete),
    "chatglm3": (glm3.Glm3ToolParser, glm3.parse_complete),
}
# A model with no known format still gets parsed output, so tool_choice
# `required` (forced into this format by the grammar) works on any model.
DEFAULT_TOOL_PARSER = "hermes"
# Reasoning parser names (MindIE/vLLM style); all use the `<think>` split.
REASONING_PARSERS = ("deepseek_r1", "qwen3")

# Every marker a parser looks for: a tokenizer may hold these as special
# tokens, which must reach the parser even when special tokens are skipped.
MARKERS = (
    hermes.START, hermes.END,
    deepseek.CALLS_BEGIN, deepseek.CALLS_END, deepseek.CALL_BEGIN, deepseek.CALL_END, deepseek.SEP,
    THINK_START, THINK_END,
)


def detect_tool_parser(model_type: str, chat_template: str | None) -> str | None:
    """The parser name for a model, from its config's model_type and its template."""
    template = chat_template or ""
    if deepseek.CALL_BEGIN in template:
        # V3/R1 templates fence the arguments in ```json; V3.1 writes them bare.
        return "deepseek_v3" if "```json" in template else "deepseek_v31"
    if model_type.startswith("deepseek"):
        return "deepseek_v3"
    if hermes.START in template or model_type in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe"):
        return "hermes"
    if model_type == "chatglm" or "<|observation|>" in template:
        return "chatglm3"
    return None


def detect_reasoning(chat_template: str | None) -> bool:
    """Whether the model writes `<think>…</think>` (Qwen3, DeepSeek-R1 templates mention it)."""
    template = chat_template or ""
    return THINK_START in template or THINK_END in template
