"""Protobuf <-> worker dataclasses: the only module (besides server.py) that
touches worker_pb2."""
from __future__ import annotations

import math
import warnings

import grpc
import torch

from services.common.errors import ServiceError, invalid_argument
from services.worker.guided import GrammarSpec
from services.worker.kv_transfer import CacheRegion, PoolDescriptor
from services.worker.model_runner import ModelDescription
from services.worker.sequence import SamplingParams, SequenceInput, SequenceRefused, StepResult, decode_by_id
from services.worker.vision import ImageInput
from stormserve.media.v1 import media_pb2
from stormserve.worker.v1 import worker_pb2


_GRAMMAR_KINDS = {
    worker_pb2.GRAMMAR_KIND_JSON_OBJECT: "json_object",
    worker_pb2.GRAMMAR_KIND_JSON_SCHEMA: "json_schema",
    worker_pb2.GRAMMAR_KIND_LARK: "lark",
}


def sampling_from_proto(message: worker_pb2.SamplingParams) -> SamplingParams:
    # The scheduler resolves every default, so each field is taken as sent.
    grammar = message.grammar
    if grammar.kind and grammar.kind not in _GRAMMAR_KINDS:
        raise SequenceRefused(f"unknown grammar kind {grammar.kind}")
    return SamplingParams(
        temperature=message.temperature,
        top_k=message.top_k,
        top_p=message.top_p,
        seed=message.seed,
        repetition_penalty=message.repetition_penalty,
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        top_logprobs=message.top_logprobs,
        grammar=GrammarSpec(_GRAMMAR_KINDS[grammar.kind], grammar.source) if grammar.kind else None,
    )


def image_from_proto(message: media_pb2.ImageInput) -> ImageInput:
    """The pixels (absent for an image in cached blocks) are viewed in place
    (one copy: out of the message), never converted."""
    pixels = message.pixel_values
    shape = tuple(message.pixel_shape)
    if len(pixels) != (4 * math.prod(shape) if shape else 0):
        raise SequenceRefused(f"an image's pixel_values hold {len(pixels)} bytes, not float32 of shape {list(shape)}")
    grid = tuple(message.grid_thw)
    if grid and len(grid) != 3:
        raise SequenceRefused("an image's grid_thw must have 3 entries")
    pixel_values = None
    if pixels:
        with warnings.catch_warnings():
            # The view is read-only, as the bytes are; nothing writes to pixels.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            pixel_values = torch.frombuffer(pixels, dtype=torch.float32).view(shape)
    return ImageInput(message.offset, message.num_tokens, pixel_values, grid or None)  # type: ignore[arg-type]


def step_from_proto(
    request: worker_pb2.StepRequest,
) -> tuple[list[SequenceInput], list[int], list[tuple[int, int]]]:
    """The step's sequences (request order), the seq ids to release first, and the
    (src, dst) block copies to make before the forward. A sequence whose sampling
    or images cannot be read comes with its `refusal`, for the runner to leave out."""
    if len(request.decode_new_blocks) != len(request.decode_seq_ids):
        raise invalid_argument(f"{len(request.decode_seq_ids)} decode_seq_ids but "
                               f"{len(request.decode_new_blocks)} decode_new_blocks")
    inputs = list(map(decode_by_id, request.decode_seq_ids, request.decode_new_blocks))
    for s in request.sequences:
        sampling, images, refusal = None, (), ""
        try:
            if s.HasField("sampling"):
                sampling = sampling_from_proto(s.sampling)
            if s.images:
                images = tuple(image_from_proto(i) for i in s.images)
        except SequenceRefused as exc:
            refusal = exc.message
        inputs.append(SequenceInput(
            seq_id=s.seq_id,
            token_ids=list(s.token_ids),
            num_computed_tokens=s.num_computed_tokens,
            sample=s.sample,
            sampling=sampling,
            block_table=list(s.block_table),
            num_prompt_tokens=s.num_prompt_tokens,
            feed_last_sampled=s.feed_last_sampled,
            images=images,
            num_draft_tokens=s.num_draft_tokens,
            refusal=refusal,
        ))
    copies = [(c.src_block, c.dst_block) for c in request.block_copies]
    return inputs, list(request.release_seq_ids), copies


def step_to_proto(step_id: int, result: StepResult, pack_plain: bool = False) -> worker_pb2.StepResponse:
    """With `pack_plain`, the tokens that are nothing but an id go in the packed
    columns (StepRequest.pack_plain_tokens)."""
    response = worker_pb2.StepResponse(step_id=step_id, execute_time_us=result.execute_time_us)
    plain_seq_ids, plain_token_ids = [], []
    for token in result.tokens:
        if pack_plain and token.logprob is None and not token.num_accepted_draft_tokens and not token.draft_token_ids:
            plain_seq_ids.append(token.seq_id)
            plain_token_ids.append(token.token_id)
            continue
        entry = response.tokens.add(seq_id=token.seq_id, token_id=token.token_id,
                                    num_accepted_draft_tokens=token.num_accepted_draft_tokens,
                                    draft_token_ids=token.draft_token_ids)
        if token.logprob is not None:
            entry.logprob = token.logprob
        for alternative in token.top_logprobs:
            entry.top_logprobs.add(token_id=alternative.token_id, logprob=alternative.logprob)
    if plain_seq_ids:
        response.plain_seq_ids.extend(plain_seq_ids)
        response.plain_token_ids.extend(plain_token_ids)
    for refusal in result.refused:
        response.refused.add(seq_id=refusal.seq_id, message=refusal.message)
    return response


def describe_to_proto(description: ModelDescription) -> worker_pb2.DescribeResponse:
    defaults = description.sampling_defaults
    sampling_defaults = worker_pb2.SamplingDefaults()
    # optional fields: only set what the model's generation_config defines.
    if defaults.temperature is not None:
        sampling_defaults.temperature = defaults.temperature
    if defaults.top_k is not None:
        sampling_defaults.top_k = defaults.top_k
    if defaults.top_p is not None:
        sampling_defaults.top_p = defaults.top_p
    if defaults.repetition_penalty is not None:
        sampling_defaults.repetition_penalty = defaults.repetition_penalty
    return worker_pb2.DescribeResponse(
        model_path=description.model_path,
        vocab_size=description.vocab_size,
        eos_token_ids=description.eos_token_ids,
        max_position_embeddings=description.max_position_embeddings,
        device=description.device,
        dtype=description.dtype,
        num_kv_blocks=description.num_kv_blocks,
        block_size=description.block_size,
        max_batch_size=description.max_batch_size,
        sampling_defaults=sampling_defaults,
        holds_block_tables=True,
        max_decode_steps=description.max_decode_steps,
    )


def pool_to_proto(pool: PoolDescriptor, into: worker_pb2.KVPool) -> worker_pb2.KVPool:
    """A KV transfer pool descriptor, filled into `into`."""
    into.session, into.num_layers, into.num_blocks = pool.session, pool.num_layers, pool.num_blocks
    for region in pool.regions:
        into.regions.add(address=region.address, layer_stride=region.layer_stride, block_bytes=region.block_bytes)
    return into


def pool_from_proto(pool: worker_pb2.KVPool) -> PoolDescriptor:
    if not pool.session or not pool.regions:
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "the peer's KV pool has no session or no regions")
    return PoolDescriptor(pool.session, pool.num_layers, pool.num_blocks,
                          tuple(CacheRegion(r.address, r.layer_stride, r.block_bytes) for r in pool.regions))
