"""Turns one choice's stream of scheduler token messages into ChatChunks:
incremental text, stop strings, log-probabilities and the final usage.

Two options change the stream's shape (not an aggregated non-stream reply):
- `stream_options.include_usage` (OpenAI/DeepSeek) moves usage out of the final
  choice chunk: true puts it in one extra chunk with no choices, false drops
  it. Without `stream_options` usage stays on the final chunk, as the
  product pages show.
- `fullTextEnabled` (MindIE) makes each delta the whole text so far and adds
  `full_text` to the final chunk.

Reasoning and tool calls are split out by `parsed_output.OutputParser`; a
choice that made tool calls finishes with `tool_calls`, except a stream cut by
`length`, which keeps `length` (reference §2.4).
"""
from __future__ import annotations

import enum

from stormserve.chat.v1 import chat_pb2
from stormserve.scheduler.v1 import scheduler_pb2

from services.tokenizer.detokenizer import IncrementalDetokenizer
from services.tokenizer.formats import OutputOptions
from services.tokenizer.parsed_output import OutputParser, Parsed
from services.tokenizer.stop_strings import StopStringMatcher

_FINISH = {
    scheduler_pb2.FINISH_REASON_STOP: chat_pb2.FINISH_REASON_STOP,
    scheduler_pb2.FINISH_REASON_LENGTH: chat_pb2.FINISH_REASON_LENGTH,
    # An aborted sequence ends normally with `stop`, as the reference does.
    scheduler_pb2.FINISH_REASON_ABORT: chat_pb2.FINISH_REASON_STOP,
}


class UsagePlacement(enum.Enum):
    FINAL_CHUNK = "final_chunk"  # on the final choice chunk (the pages)
    SEPARATE_CHUNK = "separate_chunk"  # only in a usage-only chunk after it (include_usage true)
    NONE = "none"  # nowhere (include_usage false)


def usage_placement(request: chat_pb2.ChatRequest) -> UsagePlacement:
    """Where usage goes. A non-stream caller aggregates chunks and always needs it."""
    if not request.stream or not request.HasField("stream_options"):
        return UsagePlacement.FINAL_CHUNK
    if request.stream_options.include_usage:
        return UsagePlacement.SEPARATE_CHUNK
    return UsagePlacement.NONE


class ChoiceOutput:
    def __init__(self, tokenizer, request: chat_pb2.ChatRequest, chunk_id: str, created: int,
                 prompt_tokens: int, index: int = 0, full_text_enabled: bool = False,
                 options: OutputOptions = OutputOptions()):
        self._tokenizer = tokenizer
        self._chunk_id = chunk_id
        self._created = created
        self._model = request.model
        self._index = index
        skip_special = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        self._detokenizer = IncrementalDetokenizer(tokenizer.backend_tokenizer, skip_special,
                                                   options.keep_special_ids)
        self._parser = OutputParser(options, request.stream)
        self._stream = request.stream
        self._stop = StopStringMatcher(list(request.stop), request.include_stop_str_in_output)
        self._want_logprobs = request.logprobs or request.HasField("top_logprobs")
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = 0
        self.completion_tokens = 0
        self._batch_sizes: list[int] = []
        self._queue_waits: list[int] = []
        self._prefill_time: float | None = None
        self._decode_times: list[float] = []
        self.usage_placement = usage_placement(request)
        # Cumulative deltas only for a streaming caller: an aggregating one would repeat text.
        self._is_full_text = full_text_enabled and request.stream
        self._text_so_far = ""
        self.usage: chat_pb2.Usage | None = None  # set once the choice finished
        self.is_finished = False

    @property
    def stopped_by_string(self) -> bool:
        return self._stop.is_stopped

    def on_response(self, response: scheduler_pb2.GenerateResponse) -> chat_pb2.ChatChunk | None:
        """The chunk for this message, or None when it adds nothing visible yet."""
        if response.cached_tokens:
            self.cached_tokens = response.cached_tokens
        parsed = Parsed()
        logprobs: list[chat_pb2.TokenLogprob] = []
        last = len(response.tokens) - 1
        for i, token in enumerate(response.tokens):
            self._record(token)
            if i == last and response.ended_by_stop_token:
                continue  # EOS or a stop token: counted, never shown
            # Token by token, so the parser knows which tokens were reasoning.
            parsed.extend(self._parser.feed(self._stop.feed(self._detokenizer.step(token.token_id))))
            if self._want_logprobs:
                logprobs.append(self._logprob_entry(token))
        finish = chat_pb2.FINISH_REASON_UNSPECIFIED
        if self._stop.is_stopped:
            finish = chat_pb2.FINISH_REASON_STOP
        elif response.finish_reason != scheduler_pb2.FINISH_REASON_UNSPECIFIED:
            parsed.extend(self._parser.feed(self._stop.flush(), tokens=0))
            finish = _FINISH[response.finish_reason]
        if finish != chat_pb2.FINISH_REASON_UNSPECIFIED:
            parsed.extend(self._parser.finish())
            if self._parser.has_tool_calls and (finish == chat_pb2.FINISH_REASON_STOP or not self._stream):
                finish = chat_pb2.FINISH_REASON_TOOL_CALLS
        elif not parsed and not logprobs:
            return None
        chunk = self._chunk(parsed, finish)
        if logprobs:
            chunk.choices[0].logprobs.content.extend(logprobs)
        return chunk

    def error_chunk(self, code: int, message: str) -> chat_pb2.ChatChunk:
        """The last chunk of a stream that failed after it started."""
        parsed = self._parser.feed(self._stop.flush(), tokens=0)
        parsed.extend(self._parser.finish())
        chunk = self._chunk(parsed, chat_pb2.FINISH_REASON_STOP)
        chunk.error.CopyFrom(chat_pb2.ChatError(code=code, message=message, error_type="Generation Error"))
        return chunk

    def _record(self, token: scheduler_pb2.GeneratedToken) -> None:
        self.completion_tokens += 1
        self._batch_sizes.append(token.batch_size)
        self._queue_waits.append(token.queue_wait_us)
        if self._prefill_time is None:
            self._prefill_time = token.latency_ms
        else:
            self._decode_times.append(token.latency_ms)

    def _logprob_entry(self, token: scheduler_pb2.GeneratedToken) -> chat_pb2.TokenLogprob:
        text = self._tokenizer.decode([token.token_id])
        return chat_pb2.TokenLogprob(
            token=text,
            logprob=token.logprob,
            bytes=text.encode(),
            top_logprobs=[
                chat_pb2.TopLogprob(token=(t := self._tokenizer.decode([a.token_id])), logprob=a.logprob,
                                    bytes=t.encode())
                for a in token.top_logprobs
            ],
        )

    def usage_chunk(self) -> chat_pb2.ChatChunk | None:
        """The usage-only chunk (no choices) that follows the final chunk when
        the caller asked for `include_usage`; None otherwise."""
        if self.usage is None or self.usage_placement != UsagePlacement.SEPARATE_CHUNK:
            return None
        return chat_pb2.ChatChunk(id=self._chunk_id, created=self._created, model=self._model,
                                  usage=self.usage)

    def _chunk(self, parsed: Parsed, finish: int) -> chat_pb2.ChatChunk:
        self._text_so_far += parsed.content
        delta = chat_pb2.ChatDelta(role="assistant",
                                   content=self._text_so_far if self._is_full_text else parsed.content,
                                   tool_calls=parsed.tool_calls)
        # The final chunk always says the parser ran (`""` when nothing was
        # reasoning): a non-stream reply has `reasoning_content` exactly then.
        if parsed.reasoning or (self._parser.reasoning_enabled and finish):
            delta.reasoning_content = parsed.reasoning
        chunk = chat_pb2.ChatChunk(
            id=self._chunk_id,
            created=self._created,
            model=self._model,
            choices=[chat_pb2.ChunkChoice(
                index=self._index,
                delta=delta,
                finish_reason=finish,
            )],
        )
        if finish != chat_pb2.FINISH_REASON_UNSPECIFIED:
            self.is_finished = True
            if self._is_full_text:
                chunk.full_text = self._text_so_far
            self.usage = chat_pb2.Usage(
                prompt_tokens=self.prompt_tokens,
                completion_tokens=self.completion_tokens,
                total_tokens=self.prompt_tokens + self.completion_tokens,
                prompt_tokens_details=chat_pb2.PromptTokensDetails(cached_tokens=self.cached_tokens),
                completion_tokens_details=chat_pb2.CompletionTokensDetails(
                    reasoning_tokens=self._parser.reasoning_tokens),
                batch_size=self._batch_sizes,
                queue_wait_time=self._queue_waits,
            )
            if self.usage_placement == UsagePlacement.FINAL_CHUNK:
                chunk.usage.CopyFrom(self.usage)
            if self._prefill_time is not None:
                chunk.prefill_time = self._prefill_time
            chunk.decode_time_arr.extend(self._decode_times)
        return chunk
