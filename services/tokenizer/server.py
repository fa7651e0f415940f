"""ChatService (the public API) and TokenizerService wiring."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from functools import partial
from itertools import chain, repeat
from typing import TYPE_CHECKING

import grpc
from opentelemetry import trace

from services.common import tracing
from services.common.drain import Drain
from services.common.errors import ServiceError, client_message, invalid_argument
from services.common.fingerprint import system_fingerprint
from services.common.api_keys import KeyStore
from services.common.multiplex import call_metadata, call_method, multiplexed_method
from services.common.multiplex_client import CallMultiplexer, MultiplexedCall
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.formats import ModelFormats, OutputOptions, output_options
from services.tokenizer.grammar import response_format_grammar
from services.tokenizer.key_gate import Admission, KeyGate
from services.tokenizer.multimodal import ImageProcessor
from services.tokenizer.output import ChoiceOutput
from services.tokenizer.parsers.reasoning import THINK_END
from services.tokenizer.structs import struct_to_dict
from services.tokenizer.prompt import PromptBuilder, too_long
from services.tokenizer.request_rules import check_chat_request, check_messages
from services.tokenizer.template import RenderedPrompt
from services.tokenizer.tool_grammar import tool_choice_grammar
from stormserve.chat.v1 import chat_pb2, chat_pb2_grpc
from stormserve.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from stormserve.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc

if TYPE_CHECKING:
    from services.tokenizer.scheduler_groups import SchedulerGroups

log = logging.getLogger(__name__)

# Documented error codes carried by a mid-stream failure.
CODE_TIMEOUT = 802
CODE_GENERATION_FAILED = 9999


class TokenizerCore:
    """What both services share: the loaded tokenizer and the limits."""

    def __init__(self, config: TokenizerConfig, tokenizer, model_root: str, max_position_embeddings: int,
                 model_type: str = "", images: ImageProcessor | None = None):
        self.config = config
        self.tokenizer = tokenizer
        self.formats = ModelFormats.detect(config, tokenizer, model_type)
        self.model_root = model_root
        self.system_fingerprint = system_fingerprint(config.model_name, model_root)
        self.created = int(time.time())
        self.max_input_tokens = min(config.max_input_token_len, config.max_seq_len - 1, max_position_embeddings)
        encode = partial(tokenizer.encode, add_special_tokens=False)
        self.think_end_ids: list[int] = encode(THINK_END)
        self.early_stop_ids: list[int] = encode(config.early_stopping_text)
        self.prompts = PromptBuilder(config, tokenizer, self.max_input_tokens, images)

    def thinking_budget(self, options: OutputOptions, kwargs: dict) -> scheduler_pb2.ThinkingBudget | None:
        """`chat_template_kwargs.thinking_budget` (validated at the edge) for a
        request whose output starts in a think block; None otherwise."""
        budget = kwargs.get("thinking_budget")
        if not options.reasoning or not isinstance(budget, int):
            return None
        return scheduler_pb2.ThinkingBudget(
            max_tokens=budget, end_token_ids=self.think_end_ids, early_stop_token_ids=self.early_stop_ids)

    def check_model(self, model: str) -> None:
        if model and model != self.config.model_name:
            raise ServiceError(grpc.StatusCode.NOT_FOUND, f"Model not found: {model}")


def _check_beam_search(request: chat_pb2.ChatRequest) -> None:
    """What the API pages forbid with beam search and only this service sees (the
    scheduler checks the token-level rest): text stop strings and function calls."""
    if not request.use_beam_search:
        return
    conflicts = [name for name, used in (("stop", bool(request.stop)), ("tools", bool(request.tools))) if used]
    if conflicts:
        raise invalid_argument("use_beam_search cannot be combined with " + ", ".join(conflicts))


def _generate_request(request: chat_pb2.ChatRequest, request_id: str, prompt: RenderedPrompt, arrival_us: int,
                      grammar: scheduler_pb2.Grammar | None,
                      thinking_budget: scheduler_pb2.ThinkingBudget | None) -> scheduler_pb2.GenerateRequest:
    sampling = scheduler_pb2.SamplingParams()
    for name in ("temperature", "top_k", "top_p", "seed", "repetition_penalty", "presence_penalty",
                 "frequency_penalty"):
        if request.HasField(name):
            setattr(sampling, name, getattr(request, name))
    if request.logprobs or request.HasField("top_logprobs"):
        sampling.top_logprobs = request.top_logprobs
    if grammar is not None:
        sampling.grammar.CopyFrom(grammar)
    stopping = scheduler_pb2.StoppingCriteria(
        stop_token_ids=[t for t in request.stop_token_ids if 0 <= t < 2**31],
        ignore_eos=request.ignore_eos,
    )
    if request.HasField("max_tokens"):
        stopping.max_tokens = request.max_tokens
    if thinking_budget is not None:
        stopping.thinking_budget.CopyFrom(thinking_budget)
    generate = scheduler_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt.token_ids, sampling=sampling, stopping=stopping,
        arrival_time_us=arrival_us, use_beam_search=request.use_beam_search,
    )
    for image in prompt.images:
        # Built in place: the pixels are copied once, into the message.
        generate.images.add(content_hash=image.content_hash, offset=image.offset, num_tokens=image.num_tokens,
                            pixel_values=image.pixel_values.astype("<f4", copy=False).tobytes(),
                            pixel_shape=image.pixel_values.shape, grid_thw=image.grid_thw or ())
    for name in ("n", "best_of"):
        if request.HasField(name):
            setattr(generate, name, getattr(request, name))
    return generate


def _usage_chunk(outputs: list[ChoiceOutput]) -> chat_pb2.ChatChunk | None:
    """The usage-only chunk (include_usage) for the whole request: completion
    tokens summed over the choices."""
    chunk = outputs[0].usage_chunk()
    if chunk is None or len(outputs) == 1:
        return chunk
    chunk.usage.completion_tokens = sum(o.completion_tokens for o in outputs)
    chunk.usage.total_tokens = chunk.usage.prompt_tokens + chunk.usage.completion_tokens
    return chunk


def unpack_tokens(message: scheduler_pb2.GenerateStreamResponse):
    """A GenerateStreamResponse's packed tokens, each as the GenerateResponse it
    stands for. Columns that do not line up (a run or a value short or over)
    raise ValueError: the stream then fails rather than lose or invent tokens."""
    packed = message.tokens
    if not packed.call_ids:
        return
    response, token = scheduler_pb2.GenerateResponse, scheduler_pb2.GeneratedToken
    shared = zip(packed.batch_sizes, packed.queue_wait_us, packed.latency_ms, strict=True)
    if runs := packed.run_lengths:  # a value per run of entries
        if len(runs) != len(packed.batch_sizes) or sum(runs) != len(packed.call_ids):
            raise ValueError(f"{len(runs)} runs of {sum(runs)} entries for {len(packed.batch_sizes)} values "
                             f"and {len(packed.call_ids)} entries")
        shared = chain.from_iterable(map(repeat, shared, runs))
    for call_id, token_id, (batch_size, queue_wait_us, latency_ms) in zip(
            packed.call_ids, packed.token_ids, shared, strict=True):
        yield call_id, response(tokens=[token(token_id=token_id, batch_size=batch_size, queue_wait_us=queue_wait_us,
                                              latency_ms=latency_ms)])


class SchedulerClient:
    """The scheduler as ChatServicer calls it: every Generate call of this
    process on one GenerateStream, whose plain tokens come packed."""

    def __init__(self, channel: grpc.aio.Channel):
        self._stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        self._calls = CallMultiplexer(self._stub.GenerateStream, scheduler_pb2.GenerateStreamRequest,
                                      unpack=unpack_tokens)

    def generate(self, request: scheduler_pb2.GenerateRequest) -> MultiplexedCall:
        return self._calls.start(request)

    async def abort(self, request: scheduler_pb2.AbortRequest) -> scheduler_pb2.AbortResponse:
        return await self._stub.Abort(request)

    async def close(self) -> None:
        await self._calls.close()


class ChatServicer(chat_pb2_grpc.ChatServiceServicer):
    def __init__(self, core: TokenizerCore, scheduler: SchedulerClient | SchedulerGroups, gate: KeyGate | None = None,
                 drain: Drain | None = None):
        self.core = core
        self.scheduler = scheduler
        self.gate = gate or KeyGate(KeyStore())  # every call's key and its limits
        self.drain = drain or Drain("tokenizer")  # refuses new Chat calls once SIGTERM came

    async def _chat(self, request):
        # The key first: an unauthenticated caller learns nothing of the request's rules.
        with self.gate.admit(call_metadata()) as admission, tracing.span("chat", trace.SpanKind.SERVER) as span:
            async for response in self._respond(request, span, admission):
                response.chunk.system_fingerprint = self.core.system_fingerprint
                yield response

    async def _respond(self, request, span, admission: Admission):
        arrival_us = request.arrival_time_us or time.time_ns() // 1000
        check_chat_request(request)
        self.core.check_model(request.model)
        _check_beam_search(request)
        kwargs = struct_to_dict(request.chat_template_kwargs)
        tools = [] if request.tool_choice.mode == chat_pb2.TOOL_CHOICE_MODE_NONE else request.tools
        with tracing.span("chat_template"):
            prompt = await self.core.prompts.render(request.messages, tools, kwargs)
        if len(prompt.token_ids) > self.core.max_input_tokens:
            raise too_long(self.core.max_input_tokens, str(len(prompt.token_ids)))
        request_id = request.request_id or f"chatcmpl-{uuid.uuid4().hex}"
        if span is not None:
            span.set_attributes({"gen_ai.operation.name": "chat", "gen_ai.request.model": request.model,
                                 "gen_ai.usage.input_tokens": len(prompt.token_ids),
                                 "stormserve.request_id": request_id})
        options = output_options(self.core.formats, bool(request.tools), kwargs, prompt.text)
        # A forced tool call, else response_format (the two together are refused).
        grammar = tool_choice_grammar(request, options, self.core.formats) or response_format_grammar(
            request.response_format)
        num_choices = request.n if request.HasField("n") else 1
        outputs = [
            ChoiceOutput(self.core.tokenizer, request, request_id, arrival_us // 1_000_000,
                         len(prompt.token_ids), index=index,
                         full_text_enabled=self.core.config.full_text_enabled, options=options)
            for index in range(num_choices)
        ]
        # With best_of > n or beam search the scheduler sends each choice whole at the end.
        streams_choices = not request.use_beam_search and (
            not request.HasField("best_of") or request.best_of == num_choices)
        call = self.scheduler.generate(
            _generate_request(request, request_id, prompt, arrival_us, grammar,
                              self.core.thinking_budget(options, kwargs)))
        has_sent = False
        try:
            async for response in call:
                output = outputs[response.index]
                if output.is_finished:
                    continue  # the scheduler confirming a choice we already ended
                chunk = output.on_response(response)
                if chunk is not None:
                    has_sent = True
                    yield chat_pb2.ChatResponse(chunk=chunk)
                if all(o.is_finished for o in outputs):
                    if (usage := _usage_chunk(outputs)) is not None:
                        yield chat_pb2.ChatResponse(chunk=usage)
                    return
                if output.stopped_by_string and streams_choices:
                    # One choice hit a stop string while others go on: end just that one.
                    await self.scheduler.abort(
                        scheduler_pb2.AbortRequest(request_id=request_id, index=response.index))
            log.error("%s: the scheduler ended the stream without finishing", request_id)
            raise ServiceError(grpc.StatusCode.INTERNAL, "the scheduler ended the stream without finishing")
        except grpc.aio.AioRpcError as exc:
            # The details (a scheduler's address, a worker lost) are for this log; the client gets
            # our own message for its code.
            log.warning("%s: Generate failed%s: %s %s", request_id, " mid-stream" if has_sent else "",
                        exc.code().name, exc.details())
            message = client_message(exc.code(), exc.details())
            if not has_sent:
                raise ServiceError(exc.code(), message) from exc
            code = CODE_TIMEOUT if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED else CODE_GENERATION_FAILED
            for output in outputs:
                if not output.is_finished:
                    yield chat_pb2.ChatResponse(chunk=output.error_chunk(code, message))
        finally:
            # Ends the sequence in the scheduler on a stop string or when our caller went away.
            call.cancel()
            admission.add_tokens(len(prompt.token_ids) + sum(o.completion_tokens for o in outputs))

    Chat = call_method(_chat)
    ChatStream = multiplexed_method(_chat, chat_pb2.ChatStreamResponse, chat_pb2.ChatStreamEvent)

    async def ListModels(self, request, context):
        self.gate.authenticate(context.invocation_metadata())
        core = self.core
        return chat_pb2.ListModelsResponse(models=[chat_pb2.Model(
            id=core.config.model_name, root=core.config.model_name, created=core.created,
            owned_by="stormserve", max_model_len=core.config.max_seq_len,
            system_fingerprint=core.system_fingerprint,
        )])


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServiceServicer):
    def __init__(self, core: TokenizerCore, gate: KeyGate | None = None):
        self.core = core
        self.gate = gate or KeyGate(KeyStore())

    async def Tokenize(self, request, context):
        self.gate.authenticate(context.invocation_metadata())
        self.core.check_model(request.model)
        # Off the event loop: a long text would hold every other call of this process.
        ids = await asyncio.to_thread(self.core.tokenizer.encode, request.text,
                                      add_special_tokens=request.add_special_tokens)
        return tokenizer_pb2.TokenizeResponse(
            token_ids=ids, tokens=self.core.tokenizer.convert_ids_to_tokens(ids)
        )

    async def Detokenize(self, request, context):
        self.gate.authenticate(context.invocation_metadata())
        self.core.check_model(request.model)
        text = await asyncio.to_thread(self.core.tokenizer.decode, list(request.token_ids),
                                       skip_special_tokens=request.skip_special_tokens)
        return tokenizer_pb2.DetokenizeResponse(text=text)

    async def ApplyChatTemplate(self, request, context):
        self.gate.authenticate(context.invocation_metadata())
        self.core.check_model(request.model)
        check_messages(request.messages)
        add = request.add_generation_prompt if request.HasField("add_generation_prompt") else True
        prompt = await self.core.prompts.render(request.messages, request.tools,
                                        struct_to_dict(request.chat_template_kwargs), add)
        return tokenizer_pb2.ApplyChatTemplateResponse(prompt=prompt.text, token_ids=prompt.token_ids)
