"""A request's life inside the scheduler: tokens, limits and per-token stats."""
from __future__ import annotations

import enum
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from services.scheduler.beam import BeamSearch


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    # A sibling waiting, outside the queue, for its leader's prompt KV to fork from.
    FORK_PENDING = "fork_pending"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingParams:
    """Defaults already resolved (see convert.py)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_logprobs: int = -1  # -1: no log-probabilities
    # Constrained decoding: (kind, source) as in scheduler.proto's Grammar; None = free.
    grammar: tuple[int, str] | None = None

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def needs_full_history(self) -> bool:
        """The worker must see every token it conditions on (penalty counts, grammar
        state), so such a sequence cannot start from prefix-cached blocks."""
        return self.has_penalties or self.grammar is not None


@dataclass(frozen=True)
class ThinkingBudget:
    """At most `max_tokens` generated inside the think block the output starts
    with; then `early_stop_token_ids` (ending with `end_token_ids`) are appended."""

    max_tokens: int
    end_token_ids: tuple[int, ...]
    early_stop_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class StoppingCriteria:
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    thinking_budget: ThinkingBudget | None = None


@dataclass(frozen=True)
class ImageSpan:
    """An image of a vision-language model's prompt: the placeholder tokens
    [offset, offset + num_tokens) it fills, and the content hash the prefix
    cache keys them by. `message` is the image as the worker gets it (a
    media.v1 ImageInput, pixels included), passed on untouched."""

    content_hash: bytes
    offset: int
    num_tokens: int
    message: Any
    num_bytes: int = 0  # the message's size, pixels included


class TokenEvent(NamedTuple):
    """One generated token and the statistics the API reports for it (a tuple:
    one is built per token)."""

    token_id: int
    batch_size: int
    queue_wait_us: int
    latency_ms: float
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | list[tuple[int, float]] = ()


@dataclass(eq=False, slots=True)  # identity: siblings reference each other, and queues remove by identity
class Sequence:
    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stopping: StoppingCriteria
    arrival_us: int
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    ended_by_stop_token: bool = False
    # Time of the last token delivered (or arrival): queue wait and latency count from here.
    last_event_us: int = 0
    # Tokens whose KV the worker holds (prefix-cache hits count from admission).
    num_computed_tokens: int = 0
    # Whether a step that gives the worker the sequence's sampling state is planned
    # (False again after preemption).
    is_sent_to_worker: bool = False
    # Preemptions so far: results of steps planned before the last one are stale.
    epoch: int = 0
    # Prompt tokens served from the prefix cache, as reported with the first token.
    num_cached_tokens: int = 0
    # KV blocks on the worker, owned by the BlockManager, and the chain hashes of
    # the full blocks already computed (the prefix-cache keys).
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    # The block table as the worker holds it: the list last sent (whole, or
    # extended by a block) and how many of its blocks were sent. A table changes
    # in place only by growing (anything else makes a new list), so while
    # block_table is that list, the worker's table is its first num_sent_blocks.
    sent_table: list[int] | None = None
    num_sent_blocks: int = 0
    # Several sequences per request: this one's sibling number (0 = the leader), the
    # siblings that fork from its prompt once computed, and the leader it forks from.
    index: int = 0
    forks: list[Sequence] = field(default_factory=list)
    fork_of: Sequence | None = None
    # Sum of the sampled tokens' logprobs (ranks best_of siblings; 0 without logprobs).
    cumulative_logprob: float = 0.0
    # The think block is over (closed by the model, or by the budget), or there is none to watch.
    is_thinking_done: bool = False
    # Beam search: the search this sequence is a live beam of, or one of whose
    # result placeholders it is (see beam.py); None otherwise.
    beam: BeamSearch | None = None
    # Request timing for the metrics (0 = not yet): first admitted to a batch, first token out.
    first_scheduled_us: int = 0
    first_token_us: int = 0
    # With tracing on: the W3C traceparent of the request's span, sent to the worker.
    traceparent: str = ""
    # A vision-language model's images, in prompt order; sent to the worker with the sampling.
    images: tuple[ImageSpan, ...] = ()
    # The worker's guess at the tokens after the sequence's tokens (MTP drafting),
    # valid while the sequence has `worker_draft_at` tokens.
    worker_draft: tuple[int, ...] = ()
    worker_draft_at: int = 0
    # Prefill/decode disaggregation: placed on a prefill worker, it moves to a
    # decode worker once its first token is sampled (see transfer_steps.py).
    moves: bool = False
    # Where its tokens go packed once the request's first message is out (a
    # one-choice request without log-probabilities; set by the server):
    # sink(token_id, (batch_size, queue_wait_us, latency_ms)) -> whether it took
    # the token (the tuple is often one object for a whole step's tokens). A
    # token it does not take (nor a sequence's last) is delivered as an event.
    sink: Callable[[int, tuple[int, int, float]], bool] | None = None
    # The tokens that end it: its stop_token_ids, and the model's EOS unless
    # ignore_eos (set by the policy it is added to).
    stop_ids: frozenset[int] = frozenset()
    # A steady decode's output length at which planning handles it again, and
    # the policy's step count at which its output has that length (see steady.py).
    steady_due: int = 0
    steady_due_at: int = 0

    def __post_init__(self) -> None:
        self.last_event_us = self.last_event_us or self.arrival_us

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def prompt_cache_keys(self) -> list[Hashable]:
        """The prompt as the prefix cache keys it: an image's placeholder tokens
        paired with its content hash, so the same text with another image is
        another prefix, and the same image the same one."""
        if not self.images:
            return list(self.prompt_token_ids)
        keys: list[Hashable] = list(self.prompt_token_ids)
        for image in self.images:
            end = image.offset + image.num_tokens
            keys[image.offset : end] = [(token, image.content_hash) for token in keys[image.offset : end]]
        return keys

    @property
    def cache_keys(self) -> list[Hashable]:
        """all_token_ids as the prefix cache keys them (see prompt_cache_keys)."""
        return self.cache_keys_in(0, self.num_tokens)

    def cache_keys_in(self, start: int, end: int) -> list[Hashable]:
        """cache_keys[start:end], sliced from the prompt's and the outputs' without
        building the whole (a block of a long sequence fills every block_size tokens)."""
        prompt = self.prompt_cache_keys if self.images else self.prompt_token_ids
        num_prompt = len(prompt)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        if end <= num_prompt:
            return prompt[start:end]
        return prompt[start:] + self.output_token_ids[: end - num_prompt]
