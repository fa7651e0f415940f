"""Which `chat_template_kwargs` a client may send: the edge refuses the rest
before a request goes anywhere, the tokenizer (which gRPC callers reach
directly) again before it renders."""
from __future__ import annotations

# `chat_template_kwargs.chat_template` replaces the model's template with the
# client's; only an operator who trusts every client turns that on.
REQUEST_TEMPLATE_KEY = "chat_template"

# Names the renderer passes itself (transformers' apply_chat_template and the
# template's own variables): a client's value would clash with ours or change
# how the prompt is built rather than what the template sees.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "conversations", "tools", "documents",
    "add_generation_prompt", "continue_final_message", "tokenize", "return_dict", "return_tensors",
    "return_assistant_tokens_mask", "padding", "truncation", "max_length", "tokenizer_kwargs",
    "sanitize_control_tokens",
})


def reserved_key(kwargs: dict) -> str | None:
    """The first reserved key in `kwargs`, in the client's order, or None."""
    return next((key for key in kwargs if key in RESERVED_TEMPLATE_KWARGS), None)
