"""Tokenizer/template service configuration (reference names in `alias`)."""
from __future__ import annotations

from dataclasses import dataclass

from services.common.config import require, setting
from services.common.drain import check_drain_timeout, drain_timeout_setting
from services.common.model_files import DEFAULT_MODEL_NAME
from services.tokenizer.parsers import PARSERS, REASONING_PARSERS


@dataclass(frozen=True)
class TokenizerConfig:
    """Chat template, tokenization, detokenization and the public ChatService."""

    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(50051, "gRPC port")
    metrics_port: int = setting(0, "HTTP port of the Prometheus /metrics endpoint (process metrics); 0 = off")
    scheduler_address: str = setting("127.0.0.1:50052", "scheduler host:port")
    model_path: str = setting("", "HF directory or .gguf file; empty = the bundled SmolLM2-135M-Instruct",
                              alias="modelWeightPath")
    model_name: str = setting(DEFAULT_MODEL_NAME, "name clients send in `model`", alias="modelName")
    max_seq_len: int = setting(2560, "prompt + output cap in tokens", alias="maxSeqLen")
    max_input_token_len: int = setting(2048, "longest accepted prompt in tokens", alias="maxInputTokenLen")
    full_text_enabled: bool = setting(
        False, "stream deltas carry the whole text so far, and the final chunk `full_text`",
        alias="fullTextEnabled")
    tool_call_parser: str = setting(
        "", "tool-call format: " + ", ".join(PARSERS) + "; empty = detect from the model (hermes if unknown)")
    reasoning_parser: str = setting(
        "", "<think> reasoning: " + ", ".join(REASONING_PARSERS) + " force it on, `none` off; "
        "empty = on when the chat template mentions <think>")
    early_stopping_text: str = setting(
        "\n\nConsidering the limited time by the user, I have to give the solution based on the thinking "
        "directly now.\n</think>\n\n",
        "appended when a request's chat_template_kwargs.thinking_budget is spent; must end the think block",
        alias="early_stopping_text")
    trust_request_chat_template: bool = setting(
        False, "render a template a request sends in chat_template_kwargs.chat_template; off: refused with "
        "422. Only for servers whose every client is trusted: a template is a program")
    template_timeout_s: float = setting(
        5.0, "seconds one chat-template render may run before it is stopped (the request gets 422), (0, 600]")
    template_memory_mib: int = setting(
        1024, "memory in MiB one render process may add to what it maps at start, [64, 65536]")
    render_processes: int = setting(
        2, "processes rendering the model's chat template, [1, 64]; request-supplied templates get one more")
    drain_timeout_s: float = drain_timeout_setting()

    def __post_init__(self) -> None:
        require(0 <= self.metrics_port <= 65535, f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        require(0 < len(self.model_name) <= 256, "modelName must have 1-256 characters")
        require(all(c.isascii() and (c.isalnum() or c in "_.-") for c in self.model_name),
                "modelName may contain only letters, digits, '_', '.' and '-'")
        require(self.max_seq_len >= 2, "maxSeqLen must be >= 2")
        require(self.tool_call_parser in ("", *PARSERS), f"tool_call_parser must be one of {', '.join(PARSERS)}")
        require(self.reasoning_parser in ("", "none", *REASONING_PARSERS),
                f"reasoning_parser must be none or one of {', '.join(REASONING_PARSERS)}")
        require(1 <= self.max_input_token_len <= 4194304, "maxInputTokenLen must be in [1, 4194304]")
        require(0 < self.template_timeout_s <= 600, "template_timeout_s must be in (0, 600]")
        require(64 <= self.template_memory_mib <= 65536, "template_memory_mib must be in [64, 65536]")
        require(1 <= self.render_processes <= 64, "render_processes must be in [1, 64]")
        require("</think>" in self.early_stopping_text, "early_stopping_text must contain </think>")
        check_drain_timeout(self.drain_timeout_s)
