"""GenerateRequest/GenerateResponse <-> scheduler dataclasses, defaults resolved here."""
from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

from services.common.errors import invalid_argument
from services.scheduler.beam import MAX_BEAM_TOKENS, BeamSearch
from services.scheduler.choices import ChoiceUpdate, Choices, sibling_seed
from services.scheduler.config import SchedulerConfig
from services.scheduler.engine import EngineLoop
from services.scheduler.sequence import (
    FinishReason,
    ImageSpan,
    SamplingParams,
    Sequence,
    StoppingCriteria,
    ThinkingBudget,
)
from stormserve.scheduler.v1 import scheduler_pb2

_FINISH = {
    FinishReason.STOP: scheduler_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: scheduler_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: scheduler_pb2.FINISH_REASON_ABORT,
}
_SEED_BITS = 63  # torch generators take a signed 64-bit seed; uint64 seeds are folded in
MAX_BEST_OF = 128  # MindIE's best_of range


def _fold_seed(seed: int) -> int:
    return seed % (1 << _SEED_BITS) ^ (seed >> _SEED_BITS)


def to_sequences(request: scheduler_pb2.GenerateRequest, next_seq_id: Callable[[], int], config: SchedulerConfig,
                 now_us: int) -> tuple[list[Sequence], Choices]:
    """The request's best_of sibling sequences and how their tokens become its n
    choices (for beam search: its n result placeholders, see beam.py)."""
    n = request.n if request.HasField("n") else 1
    best_of = request.best_of if request.HasField("best_of") else n
    if n < 1:
        raise invalid_argument("n must be >= 1")
    limit = min(MAX_BEST_OF, config.max_batch_size)
    if request.use_beam_search:
        # best_of is not checked against n here (MindIE): the width is the larger.
        width = max(n, best_of)
        if width > limit:
            raise invalid_argument(f"the beam width, max(n, best_of), must be <= {limit}, got {width}")
        return _beam_search(to_sequence(request, next_seq_id(), config, now_us), n, width, next_seq_id,
                            explicit_max_tokens=request.stopping.HasField("max_tokens"))
    if best_of < n:
        raise invalid_argument(f"best_of ({best_of}) must be >= n ({n})")
    if best_of > limit:
        raise invalid_argument(f"best_of (or n) must be <= {limit}, got {best_of}")
    first = to_sequence(request, next_seq_id(), config, now_us)
    report_logprobs = first.sampling.top_logprobs >= 0
    if best_of == 1:
        return [first], Choices([first], 1, report_logprobs)
    # Siblings are ranked (or may be sorted by the caller) by cumulative logprob,
    # so every token needs its logprob; top_logprobs 0 costs the worker next to nothing.
    sampling = dataclasses.replace(first.sampling, top_logprobs=max(first.sampling.top_logprobs, 0))
    seqs = []
    for i in range(best_of):
        seqs.append(Sequence(
            seq_id=first.seq_id if i == 0 else next_seq_id(),
            request_id=first.request_id,
            prompt_token_ids=list(first.prompt_token_ids),
            images=first.images,
            sampling=dataclasses.replace(sampling, seed=sibling_seed(sampling.seed, i)),
            stopping=first.stopping,
            arrival_us=first.arrival_us,
            index=i,
        ))
    return seqs, Choices(seqs, n, report_logprobs)


def _beam_search(first: Sequence, n: int, width: int, next_seq_id: Callable[[], int],
                 explicit_max_tokens: bool) -> tuple[list[Sequence], Choices]:
    conflicts = [name for name, used in (
        ("presence_penalty, frequency_penalty or repetition_penalty", first.sampling.has_penalties),
        ("response_format or a forced tool_choice", first.sampling.grammar is not None),
        ("stop_token_ids", bool(first.stopping.stop_token_ids)),
        ("thinking_budget", first.stopping.thinking_budget is not None),
    ) if used]
    if conflicts:
        raise invalid_argument("use_beam_search cannot be combined with " + ", ".join(conflicts))
    max_tokens = first.stopping.max_tokens
    if max_tokens > MAX_BEAM_TOKENS:
        default = "" if explicit_max_tokens else " (the default: maxIterTimes, capped by maxSeqLen)"
        raise invalid_argument(f"use_beam_search needs max_tokens <= {MAX_BEAM_TOKENS}, got {max_tokens}{default}")
    report_top = first.sampling.top_logprobs
    # Beams rank the model's own distribution: greedy rows return their 2 x width best tokens.
    sampling = SamplingParams(temperature=0.0, top_logprobs=max(2 * width, report_top))
    results = [
        Sequence(seq_id=next_seq_id(), request_id=first.request_id, prompt_token_ids=first.prompt_token_ids,
                 images=first.images, sampling=sampling, stopping=first.stopping, arrival_us=first.arrival_us, index=i)
        for i in range(n)
    ]
    search = BeamSearch(width, results, next_seq_id, top_logprobs=report_top)
    search.beams = [dataclasses.replace(first, sampling=sampling, beam=search)]
    for result in results:
        result.beam = search
    return results, Choices(results, n, report_logprobs=report_top >= 0)


def to_sequence(request: scheduler_pb2.GenerateRequest, seq_id: int, config: SchedulerConfig,
                now_us: int) -> Sequence:
    prompt = list(request.prompt_token_ids)
    if not request.request_id:
        raise invalid_argument("request_id is required")
    if not prompt:
        raise invalid_argument("prompt_token_ids must not be empty")
    if len(prompt) >= config.max_seq_len:
        raise invalid_argument(
            f"prompt has {len(prompt)} tokens; maxSeqLen {config.max_seq_len} leaves no room for output"
        )
    s = request.sampling
    seed = s.seed if s.HasField("seed") else random.getrandbits(64)
    sampling = SamplingParams(
        temperature=s.temperature if s.HasField("temperature") else 1.0,
        top_k=max(0, s.top_k) if s.HasField("top_k") else 0,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        seed=_fold_seed(seed),
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
        presence_penalty=s.presence_penalty if s.HasField("presence_penalty") else 0.0,
        frequency_penalty=s.frequency_penalty if s.HasField("frequency_penalty") else 0.0,
        top_logprobs=s.top_logprobs if s.HasField("top_logprobs") else -1,
        grammar=(s.grammar.kind, s.grammar.source) if s.grammar.kind else None,
    )
    if sampling.temperature < 0:
        raise invalid_argument("temperature must be >= 0")
    if not 0 < sampling.top_p <= 1:
        raise invalid_argument("top_p must be in (0, 1]")
    st = request.stopping
    cap = min(config.max_iter_times, config.max_seq_len - len(prompt))
    if st.HasField("max_tokens") and st.max_tokens <= 0:
        raise invalid_argument("max_tokens must be > 0")
    max_tokens = min(st.max_tokens, cap) if st.HasField("max_tokens") else cap
    budget = None
    if st.HasField("thinking_budget"):
        tb = st.thinking_budget
        if tb.max_tokens < 1 or not tb.end_token_ids or not tb.early_stop_token_ids:
            raise invalid_argument("thinking_budget needs max_tokens >= 1, end_token_ids and early_stop_token_ids")
        budget = ThinkingBudget(tb.max_tokens, tuple(tb.end_token_ids), tuple(tb.early_stop_token_ids))
    stopping = StoppingCriteria(
        max_tokens=max_tokens,
        stop_token_ids=frozenset(st.stop_token_ids),
        ignore_eos=st.ignore_eos,
        thinking_budget=budget,
    )
    return Sequence(
        seq_id=seq_id,
        request_id=request.request_id,
        prompt_token_ids=prompt,
        images=_image_spans(request, len(prompt)),
        sampling=sampling,
        stopping=stopping,
        arrival_us=request.arrival_time_us or now_us,
    )


def _image_spans(request: scheduler_pb2.GenerateRequest, num_prompt_tokens: int) -> tuple[ImageSpan, ...]:
    """The request's images; their spans must lie in the prompt, in order."""
    spans, end = [], 0
    for image in request.images:
        if image.offset < end or image.num_tokens < 1 or image.offset + image.num_tokens > num_prompt_tokens:
            raise invalid_argument("images must fill non-empty spans of the prompt, in order, not overlapping")
        if len(image.content_hash) != 32:
            raise invalid_argument("an image's content_hash must be its SHA-256 (32 bytes)")
        spans.append(ImageSpan(image.content_hash, image.offset, image.num_tokens, image, image.ByteSize()))
        end = image.offset + image.num_tokens
    return tuple(spans)


def fill_response(reply: scheduler_pb2.GenerateResponse, update: ChoiceUpdate,
                  choices: Choices) -> scheduler_pb2.GenerateResponse:
    """`reply`, an empty message, filled with `update` (and returned)."""
    seq = update.seq
    report = choices.report_logprobs  # else logprobs were only computed to rank siblings
    reply.index = update.index
    add = reply.tokens.add  # in place: a GeneratedToken built apart is copied in
    for e in update.events:
        token = add(token_id=e.token_id, batch_size=e.batch_size, queue_wait_us=e.queue_wait_us,
                    latency_ms=e.latency_ms)
        if report and e.logprob is not None:
            token.logprob = e.logprob
        if e.top_logprobs:
            add_alternative = token.top_logprobs.add
            for t, lp in e.top_logprobs:
                add_alternative(token_id=t, logprob=lp)
    if update.is_first:
        reply.prompt_tokens = seq.num_prompt_tokens
        reply.cached_tokens = seq.num_cached_tokens
    if update.is_last and seq.finish_reason is not None:
        reply.finish_reason = _FINISH[seq.finish_reason]
        reply.ended_by_stop_token = seq.ended_by_stop_token
        if choices.has_logprobs:
            reply.cumulative_logprob = seq.cumulative_logprob
    return reply


def to_worker_load(engine: EngineLoop, draining: bool = False) -> scheduler_pb2.WorkerLoad:
    load = scheduler_pb2.WorkerLoad(
        address=engine.worker.address,
        # A draining worker (its endpoint or its own health says so) is not ready for new sequences.
        is_ready=engine.accepts_sequences and not draining,
        draining=draining or engine.is_draining,
        num_steps=engine.num_steps,
        num_sequences=engine.num_sequences,
    )
    policy = engine.policy
    if policy is not None:
        load.num_waiting = policy.num_unfinished - len(policy.running)  # siblings yet to fork count
        load.num_running = len(policy.running)
        load.num_kv_blocks = policy.capacity.num_kv_blocks
        load.num_free_kv_blocks = policy.num_free_blocks
        load.num_preemptions = policy.num_preemptions
        load.num_cached_tokens = policy.num_cached_tokens
    return load
