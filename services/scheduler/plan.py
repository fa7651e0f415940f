"""What the batching policy and the worker client exchange: the worker's capacity,
a planned step, and the tokens it sampled."""
from __future__ import annotations

from dataclasses import dataclass, field

from services.scheduler.sequence import Sequence


@dataclass(frozen=True)
class WorkerCapacity:
    """What the worker reported in Describe."""

    num_kv_blocks: int
    block_size: int
    max_batch_size: int
    eos_token_ids: frozenset[int]


@dataclass(frozen=True)
class ScheduledSequence:
    """One sequence's part of a step: `num_new_tokens` tokens from `num_computed_tokens` on."""

    seq: Sequence
    num_computed_tokens: int
    num_new_tokens: int
    # False for a prefill chunk that does not reach the end of the sequence. Fixed
    # at planning: the sequence grows once the step's token is appended.
    is_sampling: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "is_sampling", self.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens)

    @property
    def token_ids(self) -> list[int]:
        return self.seq.all_token_ids[self.num_computed_tokens : self.num_computed_tokens + self.num_new_tokens]


@dataclass
class StepPlan:
    step_id: int
    scheduled: list[ScheduledSequence]
    release_seq_ids: list[int] = field(default_factory=list)
    # (src, dst) KV blocks the worker copies before the forward (a forked beam's partial block).
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def sequences(self) -> list[Sequence]:
        return [s.seq for s in self.scheduled]

    @property
    def batch_size(self) -> int:
        return len(self.scheduled)


@dataclass(frozen=True)
class SampledToken:
    seq_id: int
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


class CapacityError(ValueError):
    """The request can never fit this worker, whatever else is running."""
