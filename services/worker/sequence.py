"""What one step carries per sequence, in and out: plain dataclasses that the
core logic uses; convert.py maps them to and from protobuf."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from services.worker.guided import GrammarSpec
from services.worker.vision import ImageInput

# The API caps top_logprobs at 20; beam search asks for 2 x its width (<= 128).
MAX_TOP_LOGPROBS = 256


@dataclass(frozen=True)
class SamplingParams:
    """Per-sequence sampling settings with defaults already resolved by the caller."""

    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int = 0
    repetition_penalty: float = 1.0  # 1 = off
    presence_penalty: float = 0.0  # 0 = off
    frequency_penalty: float = 0.0  # 0 = off
    top_logprobs: int = -1  # -1 = no logprobs; 0 = the chosen token's only; n = plus n alternatives
    grammar: GrammarSpec | None = None  # constrained decoding; None = free

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def validate(self) -> None:
        """Raise SequenceRefused for values the sampler cannot honour. NaN fails
        every comparison below, so it is refused wherever it is sent."""
        _check(math.isfinite(self.temperature) and self.temperature >= 0,
               "temperature must be a finite number >= 0")
        _check(self.top_k >= 0, "top_k must be >= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]")
        _check(0 <= self.seed < 2**64, "seed must fit in 64 bits")
        _check(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty must be in (0, 2]")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]")
        _check(self.top_logprobs <= MAX_TOP_LOGPROBS, f"top_logprobs must be at most {MAX_TOP_LOGPROBS}")
        _check(self.top_logprobs >= -1, "top_logprobs must not be negative")


class SequenceRefused(Exception):
    """The worker cannot serve one sequence of a step (what its request asks is
    out of its ranges): the step runs without it. The message is for the
    request's client: it names the field or rule, never ids, paths or classes."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise SequenceRefused(message)


@dataclass(frozen=True)
class SequenceInput:
    """One sequence's part of a step.

    token_ids: the tokens to feed — the prompt (or a chunk of it) first, then the
    last sampled token. num_computed_tokens: how many of the sequence's tokens the
    KV cache already holds (the position of token_ids[0]); on a first step it may
    be > 0 when the scheduler hands over prefix-cached blocks. sample: whether to
    sample after these tokens. sampling: required on the sequence's first step,
    ignored after (the worker keeps the first one until release). block_table:
    the scheduler's block ids for the sequence, covering num_computed_tokens +
    len(token_ids) tokens. num_prompt_tokens: on a first step, how many tokens
    are prompt (0 = all); later tokens are outputs recomputed after preemption.
    feed_last_sampled: token_ids is empty and the input is the token sampled for
    the sequence in its previous step (the caller planned this step before it
    saw that one's result). images: a vision-language model's images of the
    sequence, with `sampling` only (the worker keeps them until release).
    num_draft_tokens: the last that many token_ids are a draft to verify (see
    speculative.py). refusal: why the sequence was refused while its step was
    read (convert.py), "" when it was not: the worker leaves it out of the step.
    extends_table: a decode of StepRequest.decode_seq_ids (feed_last_sampled,
    sample): block_table holds only the block to append to the table the worker
    holds (or nothing), and num_computed_tokens is the worker's; both are
    resolved when the step runs (admission.py).
    """

    seq_id: int
    token_ids: list[int]
    num_computed_tokens: int
    sample: bool
    sampling: SamplingParams | None = None
    block_table: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    feed_last_sampled: bool = False
    images: tuple[ImageInput, ...] = ()
    num_draft_tokens: int = 0
    refusal: str = ""
    extends_table: bool = False


def decode_by_id(seq_id: int, new_block: int = -1) -> SequenceInput:
    """A decode of StepRequest.decode_seq_ids: the worker's table, extended by
    `new_block` (-1: none), fed the token it sampled for the sequence last."""
    return SequenceInput(seq_id, [], 0, True, block_table=[] if new_block < 0 else [new_block],
                         feed_last_sampled=True, extends_table=True)


@dataclass(frozen=True)
class Refusal:
    """A sequence the step left out (SequenceRefused), and why, for the client."""

    seq_id: int
    message: str


@dataclass(frozen=True)
class TokenLogprob:
    """A token with its natural-log probability."""

    token_id: int
    logprob: float


@dataclass(frozen=True)
class SampledToken:
    """The token sampled for one sequence in a step."""

    seq_id: int
    token_id: int
    logprob: float | None = None  # set when top_logprobs >= 0
    top_logprobs: list[TokenLogprob] = field(default_factory=list)  # best first
    num_accepted_draft_tokens: int = 0  # drafts kept before token_id
    draft_token_ids: tuple[int, ...] = ()  # the MTP module's guess at the tokens after token_id (mtp.py)


@dataclass(frozen=True)
class StepResult:
    """A step's sampled tokens (request order), how long it ran, and the
    sequences it refused one by one (left out of the step)."""

    tokens: list[SampledToken]
    execute_time_us: int
    refused: list[Refusal] = field(default_factory=list)
