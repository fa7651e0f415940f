"""Pydantic models of what the edge answers, for /openapi.json: the
`chat.completion` render.py builds, each `chat.completion.chunk` of a stream
(and the error frame that can end one), the model list and the one error body.

render.py, app.py and errors.py build these shapes as plain dicts (one per
token, so no model is built on the hot path); these models only describe
them. They forbid unknown keys, and tests/e2e/test_openapi_e2e.py validates
real replies of the running chain against them, so a key added to a reply
without a line here fails that test.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

FinishReason = Literal["stop", "length", "tool_calls", "content_filter", "insufficient_system_resource"]


class Shape(BaseModel):
    """A reply shape: no unknown keys; a field with a default may be left out."""

    model_config = ConfigDict(extra="forbid", strict=True)


class ErrorBody(Shape):
    """Every failure (reference §9.1): MindIE's `error`/`error_type` with the
    product page's `code`/`result`/`message`."""

    error: str
    error_type: str = Field(description="e.g. Input Validation Error, Service Unavailable, Unauthorized")
    code: int = Field(description="802 timeout, 9999 generation failure, 801/702 auth, else the HTTP status")
    result: None
    message: str = Field(description="the same text as error")


class StreamErrorFrame(ErrorBody):
    """The last `data:` event of a stream that failed after it started, before `data: [DONE]`."""

    finish_reason: FinishReason


class PromptTokensDetails(Shape):
    cached_tokens: int


class CompletionTokensDetails(Shape):
    reasoning_tokens: int


class Usage(Shape):
    prompt_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens: int
    completion_tokens_details: CompletionTokensDetails | None = Field(
        default=None, description="only when the model reasoned"
    )
    total_tokens: int
    batch_size: list[int] = Field(description="sequences in the batch at each generated token")
    queue_wait_time: list[int] = Field(description="µs waited in the queue before each generated token")


class TopLogprob(Shape):
    token: str
    logprob: float = Field(description="-9999.0 stands for a probability too small to report")
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(Shape):
    content: list[TokenLogprob]


class CalledFunction(Shape):
    name: str
    arguments: str = Field(description="JSON text, as the model wrote it")


class AssistantToolCall(Shape):
    id: str
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(Shape):
    role: Literal["assistant"]
    content: str
    reasoning_content: str | None = Field(default=None, description="only when the model reasoned")
    reasoning: str | None = Field(default=None, description="vLLM's name for reasoning_content")
    tool_calls: list[AssistantToolCall]


class CompletionChoice(Shape):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = Field(description="null unless the request asked for logprobs")
    finish_reason: FinishReason


class ChatCompletion(Shape):
    """The reply when `stream` is false."""

    id: str
    object: Literal["chat.completion"]
    created: int = Field(description="arrival, Unix seconds")
    model: str
    system_fingerprint: str = Field(description="fp_ + a hash of the stormserve version and the served model")
    choices: list[CompletionChoice]
    usage: Usage
    prefill_time: int | None = Field(description="ms to the first token")
    decode_time_arr: list[int] = Field(description="ms per later token")


class CalledFunctionDelta(Shape):
    name: str | None = Field(default=None, description="in the first delta of a call only")
    arguments: str


class ToolCallDelta(Shape):
    index: int
    id: str | None = Field(default=None, description="in the first delta of a call only")
    type: Literal["function"] | None = Field(default=None, description="in the first delta of a call only")
    function: CalledFunctionDelta


class Delta(Shape):
    role: Literal["assistant"]
    content: str
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(Shape):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None = Field(default=None, description="present only when logprobs were asked for")
    finish_reason: FinishReason | None


class ChatCompletionChunk(Shape):
    """One `data:` event when `stream` is true; `data: [DONE]` ends the stream.
    With stream_options.include_usage the last chunk has `"choices": []` and the
    usage, and every other chunk `"usage": null`."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: str
    full_text: str | None = Field(default=None, description="fullTextEnabled: the whole text, on the final chunk")
    usage: Usage | None = Field(default=None, description="on the final chunk")
    choices: list[ChunkChoice]


class ModelCard(Shape):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: None
    max_model_len: int


class ModelList(Shape):
    object: Literal["list"]
    data: list[ModelCard]


RESPONSE_MODELS: tuple[type[BaseModel], ...] = (
    ChatCompletion, ChatCompletionChunk, StreamErrorFrame, ModelList, ModelCard, ErrorBody,
)
