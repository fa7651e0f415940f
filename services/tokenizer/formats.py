"""Which output formats apply: per model (decided once at start, from the
config or detected from the model) and per request (tools offered, thinking
switched on or off, what the rendered prompt left open)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.tokenizer.config import TokenizerConfig
from services.tokenizer.parsers import DEFAULT_TOOL_PARSER, MARKERS, detect_reasoning, detect_tool_parser
from services.tokenizer.parsers.reasoning import THINK_END


@dataclass(frozen=True)
class ModelFormats:
    tool_parser: str  # a name in parsers.PARSERS
    reasoning: bool  # the model writes <think>…</think> (or the config says so)
    # Added tokens whose text is a parser marker, by text: the forcing grammar
    # names them by id so the model writes the one token it was trained on.
    marker_ids: dict[str, int] = field(default_factory=dict)
    # Those of them marked special: decoding with skip_special_tokens would
    # drop them (DeepSeek's tool markers may be), so the detokenizer keeps them.
    special_marker_ids: frozenset[int] = frozenset()

    @classmethod
    def detect(cls, config: TokenizerConfig, tokenizer, model_type: str) -> ModelFormats:
        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
        tool_parser = config.tool_call_parser or detect_tool_parser(model_type, template) or DEFAULT_TOOL_PARSER
        if config.reasoning_parser:
            reasoning = config.reasoning_parser != "none"
        else:
            reasoning = detect_reasoning(template)
        added = tokenizer.added_tokens_decoder
        marker_ids = {t.content: i for i, t in added.items() if t.content in MARKERS}
        special = frozenset(i for i in marker_ids.values() if added[i].special)
        return cls(tool_parser, reasoning, marker_ids, special)


@dataclass(frozen=True)
class OutputOptions:
    """How one request's output is parsed."""

    tool_parser: str | None = None  # None: the request offered no tools
    # The output starts inside a think block: Qwen3 opens it with `<think>`,
    # R1's template already opened it in the prompt; the parser takes both.
    reasoning: bool = False
    # Special tokens to keep in the text although special tokens are skipped.
    keep_special_ids: frozenset[int] = frozenset()


def prompt_closes_thinking(prompt: str) -> bool:
    """The template ended the prompt with `</think>`: thinking is off for this
    turn (Qwen3 with enable_thinking false, DeepSeek-V3.1 non-thinking)."""
    return prompt.rstrip().endswith(THINK_END)


def output_options(formats: ModelFormats, has_tools: bool, template_kwargs: dict[str, Any],
                   prompt: str) -> OutputOptions:
    # Tool output is parsed whenever tools were given, `tool_choice: none` too
    # (MindIE: active whenever `tools` is non-empty).
    tool_parser = formats.tool_parser if has_tools else None
    reasoning = (formats.reasoning and template_kwargs.get("enable_thinking") is not False
                 and not prompt_closes_thinking(prompt))
    keep = formats.special_marker_ids if tool_parser or reasoning else frozenset()
    return OutputOptions(tool_parser, reasoning, keep)
