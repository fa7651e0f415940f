"""What the batching policy and the worker client exchange: the worker's capacity,
a planned step, and the tokens it sampled (or the sequences it refused)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from services.scheduler.sequence import Sequence


@dataclass(frozen=True)
class WorkerCapacity:
    """What the worker reported in Describe."""

    num_kv_blocks: int
    block_size: int
    max_batch_size: int
    eos_token_ids: frozenset[int]
    role: str = "both"  # prefill, decode or both
    # It keeps block tables between steps: decodes may go by id (StepRequest.decode_seq_ids).
    holds_block_tables: bool = False
    # The most steps one message may run its decodes by id (StepRequest.decode_steps).
    max_decode_steps: int = 1


class ScheduledSequence(NamedTuple):
    """One sequence's part of a step: `num_new_tokens` tokens from `num_computed_tokens` on.

    Built by the policy only (`BatchPolicy._schedule_entry`), which fixes the
    fields that depend on the sequence at planning time. A tuple, not a frozen
    dataclass: one is built per sequence per step, and a frozen dataclass takes
    five times as long to build."""

    seq: Sequence
    num_computed_tokens: int
    num_new_tokens: int
    # The input is the token sampled for the sequence in a step still running
    # (planned ahead): the worker fills it in, and this step samples.
    feeds_last_sampled: bool = False
    # False for a prefill chunk that does not reach the end of the sequence.
    is_sampling: bool = False
    # The first step on the worker since admission: it carries the sampling parameters.
    sends_sampling: bool = False
    # The sequence's preemption count at planning: a step planned before a
    # preemption no longer applies to it.
    epoch: int = 0
    # Speculative decoding: tokens guessed to follow, fed after the sequence's
    # last token to be verified (counted in num_new_tokens; see speculation.py).
    draft_token_ids: tuple[int, ...] = ()
    # None: the step carries the sequence's part whole (a SequenceStep). Else a
    # decode on the block table the worker holds, extended by this block (-1:
    # none): the step sends its id and that block alone (StepRequest.decode_seq_ids).
    extends_table: int | None = None

    @property
    def token_ids(self) -> list[int]:
        if self.feeds_last_sampled:
            return []
        start = self.num_computed_tokens
        end = start + self.num_new_tokens - len(self.draft_token_ids)
        prompt, outputs = self.seq.prompt_token_ids, self.seq.output_token_ids
        num_prompt = len(prompt)
        # Sliced from the prompt and the outputs, never their concatenation (all_token_ids):
        # a decode would copy the whole sequence each step to feed one token.
        if start >= num_prompt:
            known = outputs[start - num_prompt : end - num_prompt]
        elif end <= num_prompt:
            known = prompt[start:end]
        else:
            known = prompt[start:] + outputs[: end - num_prompt]
        return known + list(self.draft_token_ids) if self.draft_token_ids else known


class SteadyDecodes(NamedTuple):
    """A step's steady decodes (see steady.py) as columns: the sequences, their
    ids and the block each one's table gains (-1: none), sent as they are
    (StepRequest.decode_seq_ids, decode_new_blocks); how many members had
    ended or been preempted when it was planned (if more have by the time it
    is accounted, their tokens are looked for and dropped); and how many steps
    the message runs them (StepRequest.decode_steps: a token each per step)."""

    seqs: list[Sequence]
    seq_ids: list[int]
    new_blocks: list[int]
    leaves: int = 0
    steps: int = 1


NO_STEADY_DECODES = SteadyDecodes([], [], [])  # never changed in place


@dataclass
class StepPlan:
    step_id: int
    scheduled: list[ScheduledSequence]
    release_seq_ids: list[int] = field(default_factory=list)
    # (src, dst) KV blocks the worker copies before the forward (a forked beam's partial block).
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Parts that feed one known token past the prompt (the rest are prefills), for the metrics.
    num_decodes: int = 0
    # The steady decodes, beside `scheduled` (one ScheduledSequence per other part).
    steady: SteadyDecodes = NO_STEADY_DECODES

    @property
    def sequences(self) -> list[Sequence]:
        return [s.seq for s in self.scheduled] + self.steady.seqs

    @property
    def batch_size(self) -> int:
        return len(self.scheduled) + len(self.steady.seqs)


class SampledToken(NamedTuple):
    """One per sampling sequence per step: a tuple, quick to build (see ScheduledSequence)."""

    seq_id: int
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    num_accepted_draft_tokens: int = 0  # drafted tokens kept before token_id
    draft_token_ids: tuple[int, ...] = ()  # the worker's guess at the tokens after token_id (MTP)


@dataclass(frozen=True)
class StepAnswer:
    """The worker's answer to a step: the sampled tokens by seq id (a token with
    nothing but its id as that id alone), and the sequences it refused alone
    (seq id -> why, written for the request's client). `steady_tokens`: where
    the worker answered every steady decode of the step (StepPlan.steady) with
    its id alone, their tokens in the columns' order, step after step (then
    not in `tokens`)."""

    tokens: dict[int, SampledToken | int]
    refused: dict[int, str] = field(default_factory=dict)
    steady_tokens: list[int] | None = None


class CapacityError(ValueError):
    """The request can never fit this worker, whatever else is running."""
