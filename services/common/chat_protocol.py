"""Pydantic models of the documented `POST /v1/chat/completions` request body:
the one definition of a chat request's rules. The HTTP edge validates the JSON
body with them; the tokenizer validates every ChatService call (native gRPC,
gRPC-Web, transcoded JSON, the edge's own) with them too
(services/tokenizer/request_rules.py), so every door refuses the same requests
with the same words.

Every field of api-docs 000/001/003 is modelled. Types are strict (`"hot"`
or `true` is not a number, `1.0` is not an integer), `null` counts as absent,
unknown fields are ignored. Ranges follow the docs and the reference
(§1.2-1.4, §9): temperature [0, 2], top_k -1 or [0, 2^31-1], seed the full
uint64 range. Features the backend may not run yet (n > 1, beam search)
are accepted here; the backend answers INVALID_ARGUMENT.

Messages raised here name the rule ("must be in [0, 2]");
`validation.describe_validation` puts the field path in front. The building
blocks live in `validation.py`.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import AliasChoices, Field, Tag, field_validator, model_validator

from services.common.media_parts import MAX_MEDIA_PARTS
from services.common.template_kwargs import reserved_key
from services.common.validation import (
    LIST,
    OBJECT,
    STR,
    StrictModel,
    by_json_kind,
    in_range,
    matches,
    request_rule,
)

INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1
MAX_MESSAGES_CHARS = 4 * 1024 * 1024  # docs 001: messages <= 4 MB of characters
MAX_STOP_ITEMS = 1024
MAX_STOP_CHARS = 1024
MAX_STOP_TOTAL_CHARS = 32768
MAX_CHOICES = 128
MAX_TOP_LOGPROBS = 20

_MODEL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,256}")
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_\-\u4e00-\u9fff]{1,64}")

Penalty = Annotated[float, in_range(-2, 2)]
Choices = Annotated[int, in_range(1, MAX_CHOICES)]
ModelName = Annotated[str, matches(_MODEL_NAME, "must be 1-256 characters of [a-zA-Z0-9_.-]")]
FunctionName = Annotated[
    str, matches(_FUNCTION_NAME, "must be 1-64 characters of [a-zA-Z0-9_-] or CJK")
]


class MediaUrl(StrictModel):
    url: Annotated[str, Field(min_length=1)]
    detail: str | None = None


# `"image_url": "/x.png"` (MindIE) or `{"url": "/x.png"}` (OpenAI).
MediaValue = Annotated[
    Union[Annotated[str, Tag(STR)], Annotated[MediaUrl, Tag(OBJECT)]],
    by_json_kind("must be a string or an object with url"),
]
MediaType = Literal["image_url", "video_url", "audio_url"]
MEDIA_TYPES: tuple[MediaType, ...] = ("image_url", "video_url", "audio_url")


class ContentPart(StrictModel):
    type: Literal["text", "image_url", "video_url", "audio_url"]
    text: str | None = None
    image_url: MediaValue | None = None
    video_url: MediaValue | None = None
    audio_url: MediaValue | None = None

    @model_validator(mode="before")
    @classmethod
    def _infer_type(cls, data: Any) -> Any:
        # `type` is optional in the docs: a part with exactly one payload key is that type.
        if isinstance(data, dict) and data.get("type") is None:
            present = [k for k in ("text", *MEDIA_TYPES) if data.get(k) is not None]
            if len(present) == 1:
                return {**data, "type": present[0]}
        return data

    @model_validator(mode="after")
    def _payload_matches_type(self) -> ContentPart:
        if self.type == "text":
            if not self.text:
                raise request_rule("a text part needs a non-empty text")
        elif getattr(self, self.type) is None:
            raise request_rule(f"a part of type {self.type} needs a non-null {self.type}")
        return self

    @property
    def is_media(self) -> bool:
        return self.type != "text"

    def media(self) -> MediaUrl | None:
        value = getattr(self, self.type) if self.is_media else None
        return MediaUrl(url=value) if isinstance(value, str) else value


Content = Annotated[
    Union[Annotated[str, Tag(STR)], Annotated[list[ContentPart], Tag(LIST)]],
    by_json_kind("must be a string or a list of parts"),
]


class FunctionCall(StrictModel):
    name: FunctionName
    arguments: str


class ToolCall(StrictModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class Message(StrictModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: Content | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    prefix: bool | None = None  # DeepSeek: continue this assistant message
    reasoning_content: str | None = Field(
        default=None, validation_alias=AliasChoices("reasoning_content", "reasoning")
    )

    @model_validator(mode="after")
    def _role_rules(self) -> Message:
        if isinstance(self.content, list) and not self.content:
            raise request_rule("content must not be an empty list")
        if self.role == "tool" and not self.tool_call_id:
            raise request_rule("tool_call_id must be a non-empty string for role tool")
        if self.role == "assistant":
            if not self.tool_calls and not self.content:
                raise request_rule("content must not be empty for role assistant without tool_calls")
        elif self.content is None:
            raise request_rule(f"content is required for role {self.role}")
        return self

    @property
    def parts(self) -> list[ContentPart]:
        return self.content if isinstance(self.content, list) else []

    def num_chars(self) -> int:
        total = len(self.content) if isinstance(self.content, str) else 0
        total += sum(len(p.text or "") for p in self.parts)
        total += len(self.reasoning_content or "")
        total += sum(len(c.function.arguments) for c in self.tool_calls or ())
        return total


class FunctionDefinition(StrictModel):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: FunctionName


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoiceValue = Annotated[
    Union[
        Annotated[Literal["none", "auto", "required"], Tag(STR)],
        Annotated[NamedToolChoice, Tag(OBJECT)],
    ],
    by_json_kind("must be a string or an object"),
]


class JsonSchemaFormat(StrictModel):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise request_rule("json_schema is required when type is json_schema")
        return self


class StreamOptions(StrictModel):
    include_usage: bool | None = None


Stop = Annotated[
    Union[Annotated[str, Tag(STR)], Annotated[list[str], Tag(LIST)]],
    by_json_kind("must be a string or a list of strings"),
]


class ChatCompletionRequest(StrictModel):
    model: ModelName
    messages: Annotated[list[Message], Field(min_length=1)]
    stream: bool = False
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, in_range(0, 2, lo_open=True)] | None = None
    temperature: Annotated[float, in_range(0, 2)] | None = None
    top_p: Annotated[float, in_range(0, 1, lo_open=True)] | None = None
    top_k: Annotated[
        int, in_range(-1, INT32_MAX, message=f"must be -1 (disabled) or in [0, {INT32_MAX}]")
    ] | None = None
    seed: Annotated[int, in_range(0, UINT64_MAX)] | None = None
    stop: Stop | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    ignore_eos: bool | None = None
    max_tokens: Annotated[int, in_range(0, INT32_MAX, lo_open=True)] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoiceValue | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    stream_options: StreamOptions | None = None
    n: Choices | None = None
    best_of: Choices | None = None
    use_beam_search: bool | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, in_range(0, MAX_TOP_LOGPROBS)] | None = None
    # vLLM's spelling of DeepSeek's assistant `prefix: true`: continue the last message.
    continue_final_message: bool | None = None

    @field_validator("stop")
    @classmethod
    def _stop_limits(cls, stop: str | list[str]) -> list[str] | None:
        items = [stop] if isinstance(stop, str) else stop
        if len(items) > MAX_STOP_ITEMS:
            raise ValueError(f"must have at most {MAX_STOP_ITEMS} items")
        for item in items:
            if not 1 <= len(item) <= MAX_STOP_CHARS:
                raise ValueError(f"strings must be 1-{MAX_STOP_CHARS} characters")
        if sum(map(len, items)) > MAX_STOP_TOTAL_CHARS:
            raise ValueError(f"must total at most {MAX_STOP_TOTAL_CHARS} characters")
        return items or None  # [] means no stop strings

    @field_validator("stop_token_ids")
    @classmethod
    def _usable_token_ids(cls, ids: list[int]) -> list[int]:
        # Documented: ids outside int32 are ignored; duplicates add nothing.
        return list(dict.fromkeys(i for i in ids if 0 <= i <= INT32_MAX))

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        key = reserved_key(kwargs)
        if key is not None:
            raise request_rule(f"{key} is reserved and cannot be set by a request")
        thinking = kwargs.get("enable_thinking")
        if thinking is not None and not isinstance(thinking, bool):
            raise request_rule("enable_thinking must be a boolean")
        budget = kwargs.get("thinking_budget")
        if budget is not None and (
            isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget <= INT32_MAX
        ):
            raise request_rule(f"thinking_budget must be an integer in [1, {INT32_MAX}]")
        return kwargs

    @model_validator(mode="after")
    def _request_rules(self) -> ChatCompletionRequest:
        if self.tools:
            for index, message in enumerate(self.messages):
                if message.content == "" and message.role != "tool":
                    raise request_rule(
                        f"messages[{index}].content must not be empty when tools are given"
                    )
        num_media = sum(p.is_media for m in self.messages for p in m.parts)
        if num_media > MAX_MEDIA_PARTS:
            raise request_rule(f"messages may hold at most {MAX_MEDIA_PARTS} media parts, got {num_media}")
        if sum(m.num_chars() for m in self.messages) > MAX_MESSAGES_CHARS:
            raise request_rule(f"messages must be at most {MAX_MESSAGES_CHARS} characters")
        if self.logprobs is False and self.top_logprobs is not None:
            raise request_rule("top_logprobs needs logprobs to be true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise request_rule("continue_final_message needs the last message to be an assistant message")
        self._check_choices()
        return self

    def _check_choices(self) -> None:
        # Documented for sampling only; beam search does not check best_of.
        if self.use_beam_search:
            return
        n, best_of = self.n or 1, self.best_of
        if best_of is not None:
            if self.stream and best_of != n:
                raise request_rule("best_of must equal n when stream is true")
            if not self.stream and best_of < n:
                raise request_rule("best_of must be >= n")
        if max(n, best_of or 1) > 1 and not (self.temperature and self.temperature > 0):
            raise request_rule("n or best_of > 1 needs a temperature > 0")

    @property
    def include_usage(self) -> bool | None:
        """`stream_options.include_usage`; None when not given (`{}` included)."""
        return None if self.stream_options is None else self.stream_options.include_usage

    @property
    def wants_logprobs(self) -> bool:
        """logprobs true, or top_logprobs given alone (which implies it)."""
        return bool(self.logprobs) or (self.logprobs is None and self.top_logprobs is not None)
