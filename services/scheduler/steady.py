"""Steady decodes: the sequences that decode one plain token a step, planned
and accounted as columns (BatchPolicy inherits this).

A sequence's decode planned ahead on the block table the worker holds (its
ScheduledSequence's `extends_table` is set) joins the steady set when nothing
of it needs the scheduler between two tokens: no beam, no move to another
worker, no thinking budget left to watch, no log-probabilities, and no drafts
(the policy does not speculate). From the next step on it is planned without
a ScheduledSequence: a step's steady decodes are three columns (SteadyDecodes:
the sequences, their ids, the block each table gains), which the worker client
sends as they are and accounting walks in one loop.

Planning looks at one number per member, its output length against
`steady_due`: the length at which its table needs a block, or its next token
could be its last (max_tokens). Only the members that reach it are handled one
by one. A member leaves the set when it finishes or is preempted, when its
token in flight could be its last (it then waits for that token, as any
sequence does), and when no block is free for it (the ordinary planning then
preempts, as for any decode). The set dissolves when none of its steps is in
flight (the engine went idle): its members are planned whole again, and join
again a step later.

Invariant: every member is in every step planned while it is a member, so
when a step is planned its members' last step is the one in flight, and each
one's position is its accounted one plus the token in flight."""
from __future__ import annotations

from services.scheduler.block_manager import BlockManager
from services.scheduler.plan import NO_STEADY_DECODES, ScheduledSequence, SteadyDecodes, WorkerCapacity
from services.scheduler.sequence import Sequence, SequenceStatus


class SteadySteps:
    capacity: WorkerCapacity
    blocks: BlockManager
    _is_speculating: bool

    def _init_steady(self) -> None:
        # Members, and those in the step in flight (at most one at planning: see policy.py).
        self._steady: dict[int, Sequence] = {}
        self._steady_in_flight: dict[int, Sequence] = {}
        self._steady_step_id = -1  # the step whose members _steady_in_flight holds
        self._steady_allowed = self.capacity.holds_block_tables and not self._is_speculating

    def _plan_steady(self) -> tuple[dict[int, Sequence], dict[int, int]]:
        """The members this step decodes (by seq id), and the block each of those whose table grows gains."""
        steady = self._steady
        if not steady:
            return {}, {}
        if not self._steady_in_flight:  # no step of theirs in flight: planned whole again
            steady.clear()
            return {}, {}
        now, grown = dict(steady), {}
        for seq in [seq for seq in steady.values() if len(seq.output_token_ids) >= seq.steady_due]:
            table = seq.block_table
            total = seq.num_tokens + 1  # with the token in flight
            needs_block = total > len(table) * self.blocks.block_size
            if len(seq.output_token_ids) + 1 >= seq.stopping.max_tokens or (
                    needs_block and not self.blocks.can_grow(seq, total)):
                del steady[seq.seq_id], now[seq.seq_id]  # planned (or held back) like any sequence
                continue
            if needs_block:
                self.blocks.grow(seq, total)
                grown[seq.seq_id] = table[-1]
                seq.num_sent_blocks = len(table)
            self._set_steady_due(seq)
        return now, grown

    def _join_steady(self, entry: ScheduledSequence, now: dict[int, Sequence], grown: dict[int, int]) -> bool:
        """Make a decode planned ahead a steady one (in this step's `now`), if it may be."""
        seq = entry.seq
        if not self._steady_allowed or entry.extends_table is None or entry.draft_token_ids or seq.beam is not None \
                or seq.moves or seq.sampling.top_logprobs >= 0 \
                or (seq.stopping.thinking_budget is not None and not seq.is_thinking_done):
            return False
        self._steady[seq.seq_id] = now[seq.seq_id] = seq
        if entry.extends_table >= 0:
            grown[seq.seq_id] = entry.extends_table
        self._set_steady_due(seq)
        return True

    def _set_steady_due(self, seq: Sequence) -> None:
        room = len(seq.block_table) * self.blocks.block_size - seq.num_prompt_tokens
        seq.steady_due = min(room, seq.stopping.max_tokens - 1)

    def _steady_decodes(self, now: dict[int, Sequence], grown: dict[int, int], step_id: int) -> SteadyDecodes:
        """The planned step's columns; its members are the ones in flight from now."""
        if not now:
            return NO_STEADY_DECODES
        self._steady_in_flight, self._steady_step_id = now, step_id
        seq_ids = list(now)
        return SteadyDecodes(list(now.values()), seq_ids, [grown.get(i, -1) for i in seq_ids] if grown else
                             [-1] * len(seq_ids))

    def _leave_steady(self, seq: Sequence) -> None:
        """It finished or was preempted: a step in flight has its token dropped."""
        self._steady.pop(seq.seq_id, None)
        self._steady_in_flight.pop(seq.seq_id, None)

    def _steady_answered(self, step_id: int) -> None:
        if step_id == self._steady_step_id:
            self._steady_in_flight = {}

    def _forget_steady(self) -> None:
        self._steady.clear()
        self._steady_in_flight = {}
        self._steady_step_id = -1


def still_running(now: dict[int, Sequence]) -> dict[int, Sequence]:
    """`now` without the members a step's planning preempted after they were taken."""
    running = SequenceStatus.RUNNING
    return {seq_id: seq for seq_id, seq in now.items() if seq.status is running}
