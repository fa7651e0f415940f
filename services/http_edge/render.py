"""`ChatChunk` -> the documented JSON: one `chat.completion.chunk` per chunk
when streaming, or the chunks of a request folded into one `chat.completion`.
A usage-only chunk (stream_options.include_usage) renders as `"choices":[]`.
Every object carries `system_fingerprint` after `model` (DeepSeek's order).

Shapes follow api-docs 000/001 and reference §2: `delta.role` is always
"assistant", `logprobs` appears only when the request asked for it, `usage`
carries `prompt_tokens_details`, `batch_size[]` and `queue_wait_time[]` (µs),
and a non-stream reply carries `prefill_time` and `decode_time_arr` in whole ms.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from stormserve.chat.v1 import chat_pb2

FINISH_REASONS = {
    chat_pb2.FINISH_REASON_STOP: "stop",
    chat_pb2.FINISH_REASON_LENGTH: "length",
    chat_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
    chat_pb2.FINISH_REASON_CONTENT_FILTER: "content_filter",
    chat_pb2.FINISH_REASON_INSUFFICIENT_SYSTEM_RESOURCE: "insufficient_system_resource",
}
# Documented stand-in for a probability too small to report (DeepSeek page);
# JSON has no -Infinity.
MIN_LOGPROB = -9999.0


@dataclass(frozen=True)
class ReplyContext:
    """What the edge knows about a request, for chunks that leave fields empty."""

    request_id: str
    model: str
    created: int  # arrival, Unix seconds
    include_logprobs: bool = False
    # fingerprint.py; a chunk that carries its own wins.
    system_fingerprint: str = ""
    # stream_options.include_usage true: chunks without usage say `"usage": null`
    # (DeepSeek/OpenAI), the extra last chunk carries it.
    null_usage: bool = False


def finish_reason(value: int) -> str | None:
    return FINISH_REASONS.get(value)


def _whole_ms(value: float) -> int:
    return round(value) if math.isfinite(value) else 0


def _logprob(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


def usage_json(
    usage: chat_pb2.Usage,
    completion_tokens: int | None = None,
    reasoning_tokens: int | None = None,
    batch_size: list[int] | None = None,
    queue_wait_time: list[int] | None = None,
) -> dict[str, Any]:
    """`usage` as documented; the keyword overrides serve the aggregated reply."""
    completion = usage.completion_tokens if completion_tokens is None else completion_tokens
    if reasoning_tokens is None:
        reasoning_tokens = usage.completion_tokens_details.reasoning_tokens
    out: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.prompt_tokens_details.cached_tokens},
        "completion_tokens": completion,
    }
    if reasoning_tokens > 0:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    out["total_tokens"] = usage.prompt_tokens + completion
    out["batch_size"] = list(usage.batch_size if batch_size is None else batch_size)
    out["queue_wait_time"] = list(usage.queue_wait_time if queue_wait_time is None else queue_wait_time)
    return out


def _token_logprob(entry: chat_pb2.TokenLogprob | chat_pb2.TopLogprob) -> dict[str, Any]:
    return {"token": entry.token, "logprob": _logprob(entry.logprob), "bytes": list(entry.bytes)}


def logprob_entries(logprobs: chat_pb2.ChoiceLogprobs) -> list[dict[str, Any]]:
    return [
        {**_token_logprob(t), "top_logprobs": [_token_logprob(a) for a in t.top_logprobs]}
        for t in logprobs.content
    ]


def tool_call_delta_json(call: chat_pb2.ToolCall) -> dict[str, Any]:
    """A streamed tool-call delta: the first has id, type and name; later ones add arguments."""
    out: dict[str, Any] = {"index": call.index}
    if call.id:
        out["id"] = call.id
    if call.type:
        out["type"] = call.type
    function: dict[str, Any] = {"name": call.function.name} if call.function.name else {}
    function["arguments"] = call.function.arguments
    out["function"] = function
    return out


def delta_json(delta: chat_pb2.ChatDelta) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": delta.content}
    if delta.HasField("reasoning_content"):
        out["reasoning_content"] = delta.reasoning_content
        out["reasoning"] = delta.reasoning_content
    if delta.tool_calls:
        out["tool_calls"] = [tool_call_delta_json(c) for c in delta.tool_calls]
    return out


def chunk_json(chunk: chat_pb2.ChatChunk, ctx: ReplyContext) -> dict[str, Any]:
    """One `chat.completion.chunk` (an SSE event)."""
    out: dict[str, Any] = {
        "id": chunk.id or ctx.request_id,
        "object": "chat.completion.chunk",
        "created": chunk.created or ctx.created,
        "model": chunk.model or ctx.model,
    }
    out["system_fingerprint"] = chunk.system_fingerprint or ctx.system_fingerprint
    if chunk.HasField("full_text"):
        out["full_text"] = chunk.full_text
    if chunk.HasField("usage"):
        out["usage"] = usage_json(chunk.usage)
    elif ctx.null_usage:
        out["usage"] = None
    choices = []
    for choice in chunk.choices:
        rendered: dict[str, Any] = {"index": choice.index, "delta": delta_json(choice.delta)}
        if ctx.include_logprobs:
            rendered["logprobs"] = (
                {"content": logprob_entries(choice.logprobs)} if choice.HasField("logprobs") else None
            )
        rendered["finish_reason"] = finish_reason(choice.finish_reason)
        choices.append(rendered)
    out["choices"] = choices
    return out


@dataclass
class _ChoiceState:
    content: list[str] = field(default_factory=list)
    reasoning: list[str] | None = None  # None: the backend never sent reasoning
    full_text: str | None = None
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    usage: chat_pb2.Usage | None = None
    decode_time_arr: list[float] = field(default_factory=list)

    def add_delta(self, delta: chat_pb2.ChatDelta) -> None:
        self.content.append(delta.content)
        if delta.HasField("reasoning_content"):
            self.reasoning = (self.reasoning or []) + [delta.reasoning_content]
        for call in delta.tool_calls:
            merged = self.tool_calls.setdefault(
                call.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
            )
            merged["id"] = merged["id"] or call.id
            merged["type"] = call.type or merged["type"]
            merged["function"]["name"] = merged["function"]["name"] or call.function.name
            merged["function"]["arguments"] += call.function.arguments

    def message(self) -> dict[str, Any]:
        content = self.full_text if self.full_text is not None else "".join(self.content)
        out: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning is not None:
            out["reasoning_content"] = out["reasoning"] = "".join(self.reasoning)
        out["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        return out


class CompletionBuilder:
    """Folds the chunk stream of one request into one `chat.completion`.

    Per choice: content concatenated (or the final `full_text` when the backend
    sends cumulative text), tool-call deltas merged by index, the last
    finish_reason, the last usage. Across choices: completion tokens summed;
    the per-step arrays (`batch_size`, `queue_wait_time`, `decode_time_arr`)
    are those of the longest choice, as documented for n > 1.
    """

    def __init__(self, ctx: ReplyContext):
        self.ctx = ctx
        self.id = ctx.request_id
        self.created = ctx.created
        self.model = ctx.model
        self.system_fingerprint = ctx.system_fingerprint
        self.prefill_time: float | None = None
        self.request_usage: chat_pb2.Usage | None = None  # a usage-only chunk
        self.choices: dict[int, _ChoiceState] = {}

    def add(self, chunk: chat_pb2.ChatChunk) -> None:
        self.id = chunk.id or self.id
        self.created = chunk.created or self.created
        self.model = chunk.model or self.model
        self.system_fingerprint = chunk.system_fingerprint or self.system_fingerprint
        if chunk.HasField("prefill_time") and self.prefill_time is None:
            self.prefill_time = chunk.prefill_time
        if not chunk.choices and chunk.HasField("usage"):
            self.request_usage = chunk.usage
        for choice in chunk.choices:
            state = self.choices.setdefault(choice.index, _ChoiceState())
            state.add_delta(choice.delta)
            if choice.HasField("logprobs"):
                state.logprobs.extend(logprob_entries(choice.logprobs))
            state.finish_reason = finish_reason(choice.finish_reason) or state.finish_reason
            if chunk.HasField("usage"):
                state.usage = chunk.usage
            if chunk.HasField("full_text"):
                state.full_text = chunk.full_text
            if chunk.decode_time_arr:
                state.decode_time_arr = list(chunk.decode_time_arr)

    def result(self) -> dict[str, Any]:
        choices = []
        for index in sorted(self.choices):
            state = self.choices[index]
            choices.append(
                {
                    "index": index,
                    "message": state.message(),
                    "logprobs": {"content": state.logprobs} if self.ctx.include_logprobs else None,
                    "finish_reason": state.finish_reason or "stop",
                }
            )
        out: dict[str, Any] = {
            "id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
            "system_fingerprint": self.system_fingerprint, "choices": choices,
        }
        out["usage"] = self._usage()
        out["prefill_time"] = None if self.prefill_time is None else _whole_ms(self.prefill_time)
        longest = max((s.decode_time_arr for s in self.choices.values()), key=len, default=[])
        out["decode_time_arr"] = [_whole_ms(t) for t in longest]
        return out

    def _usage(self) -> dict[str, Any]:
        usages = [s.usage for s in self.choices.values() if s.usage is not None]
        if not usages:
            return usage_json(self.request_usage or chat_pb2.Usage())
        longest = max(usages, key=lambda u: len(u.batch_size))
        return usage_json(
            usages[0],
            completion_tokens=sum(u.completion_tokens for u in usages),
            reasoning_tokens=sum(u.completion_tokens_details.reasoning_tokens for u in usages),
            batch_size=list(longest.batch_size),
            queue_wait_time=list(longest.queue_wait_time),
        )
