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

Planning handles a member only when its output length reaches `steady_due`:
the length at which its table needs a block, its last full block is to go
into the prefix cache, or the token planned next could be its last
(max_tokens). Each member is filed under the step count at which it does (its
output grows by one with every step accounted), so a step looks at no other. A
member leaves the set when it finishes or is preempted (its full blocks then
go into the prefix cache), when the token planned next could be its last (it
is planned as any sequence, and its last token accounted as any), and when no
block is free for it (the ordinary planning then preempts, as for any
decode). The set dissolves when none of its steps is in flight (the engine
went idle): its members are planned whole again, and join again a step later.

So accounting a member's token (accounting.py, `_take_steady`) is an append
and two counters: it never reaches max_tokens, a stop token is looked for
once per step among every stop id a member ever had, and the tokens of the
members packed on one tokenizer stream go to it at once (`_steady_lanes`).

Invariant: every member is in every step planned while it is a member, so
when a step is planned its members' last step is the one in flight, and each
one's position is its accounted one plus the tokens in flight.

Several steps a message (`decode_steps`, StepRequest.decode_steps): where
every running sequence is a member and nothing waits (no request to admit,
no sibling to fork, none moving), a message runs the members up to
`decode_steps` steps, so planning, the message each way and the per-step
costs of accounting are paid once for them all; a request that comes in
meanwhile waits for the messages in flight (two at most). A message's
tokens are accounted at once, sharing its queue wait and latency evenly;
a member's tokens after its stop token are dropped (the worker computed
them in vain). Planning handles a member early enough for any message:
`steady_due` leaves room for the tokens of the message in flight and of
the one planned (at most `decode_steps` each), a member whose table would
fill within them gains its next block then (at most one a message: the
steps are at most a block), a message runs no further than the step before
the one that could give a member its last token (max_tokens), and a member
whose next token could be its last leaves (and the message runs one step:
the leaver is planned as any sequence)."""
from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from operator import itemgetter
from typing import Any

from services.common.multiplex import PackedCall, PackedEntries
from services.scheduler.block_manager import BlockManager
from services.scheduler.plan import NO_STEADY_DECODES, ScheduledSequence, SteadyDecodes, WorkerCapacity
from services.scheduler.sequence import Sequence, SequenceStatus


# A stream's share of a step's steady decodes: its entries, the calls' ids,
# what picks their tokens out of the step's, and their indices in the step.
Lane = tuple[PackedEntries, list[int], Callable[[list[int]], Iterable[int]], list[int]]


class SteadySteps:
    capacity: WorkerCapacity
    blocks: BlockManager
    running: list[Sequence]
    waiting: Collection[Sequence]
    num_moving: int
    _num_fork_pending: int
    _is_speculating: bool

    def _init_steady(self, decode_steps: int = 1) -> None:
        # Members, and those in the step in flight (at most one at planning: see policy.py).
        self._steady: dict[int, Sequence] = {}
        self._steady_in_flight: dict[int, Sequence] = {}
        self._steady_step_id = -1  # the step whose members _steady_in_flight holds
        self._steady_in_flight_steps = 1  # and how many steps it runs them
        self._steady_stops: set[int] = set()  # every member's stop ids, ever: a superset of the members'
        self._steady_leaves = 0  # members ended or preempted so far (SteadyDecodes.leaves)
        # _steady_lanes' last answer, and the members and sinks it was for.
        self._lanes: tuple[list[Lane], list[int]] = ([], [])
        self._lanes_for: tuple[list[Sequence], list[Any]] = ([], [])
        self._steady_allowed = self.capacity.holds_block_tables and not self._is_speculating
        # The most steps a message runs the members: at most a block, so that one gains one block at most.
        self._decode_steps = max(1, min(decode_steps, self.capacity.max_decode_steps, self.blocks.block_size))
        # What `steady_due` leaves for the tokens of the message in flight and the one planned, past the first's.
        self._steady_margin = 2 * (self._decode_steps - 1)
        # Steps accounted so far (postprocess counts them): a member's output grows by one
        # with each while it is one. Members by the count at which they reach `steady_due`,
        # and the count up to which those have been looked at.
        self._steady_clock = 0
        self._steady_due_at: dict[int, list[Sequence]] = {}
        self._steady_looked = 0

    def _plan_steady(self) -> tuple[dict[int, Sequence], dict[int, int], int]:
        """The members this step decodes (by seq id), the block each of those
        whose table grows gains, and how many steps the message runs them."""
        steady = self._steady
        if not steady:
            return {}, {}, 1
        if not self._steady_in_flight:  # no step of theirs in flight: planned whole again
            steady.clear()
            self._steady_due_at.clear()
            return {}, {}, 1
        steps = self._decode_steps if self._decode_steps > 1 and self._only_steady() else 1
        in_flight = self._steady_in_flight_steps
        now, grown = dict(steady), {}
        for seq in self._steady_reaching_due():
            self.blocks.commit(seq)  # its newly full blocks, if any
            # The steps it may run before the one whose token could be its last (max_tokens).
            room = seq.stopping.max_tokens - len(seq.output_token_ids) - in_flight - 1
            if 1 <= room < steps:
                steps = room  # the members handled before it have room for more: no matter
            table = seq.block_table
            total = seq.num_tokens + in_flight + steps - 1  # with the tokens in flight, through the last step
            needs_block = total > len(table) * self.blocks.block_size
            if room < 1 or (needs_block and not self.blocks.can_grow(seq, total)):
                del steady[seq.seq_id], now[seq.seq_id]  # planned (or held back) like any sequence
                continue
            if needs_block:
                self.blocks.grow(seq, total)
                grown[seq.seq_id] = table[-1]
                seq.num_sent_blocks = len(table)
            self._set_steady_due(seq)
        if steps > 1 and len(now) < len(self.running):
            steps = 1  # one left: it is planned as any sequence, in a step of one
        return now, grown, steps

    def _only_steady(self) -> bool:
        """Every running sequence is a member, and nothing waits to join the batch."""
        return len(self._steady) == len(self.running) and not (
            self.waiting or self._num_fork_pending or self.num_moving)

    def _join_steady(self, entry: ScheduledSequence, now: dict[int, Sequence], grown: dict[int, int]) -> bool:
        """Make a decode planned ahead a steady one (in this step's `now`), if it may be."""
        seq = entry.seq
        if not self._steady_allowed or entry.extends_table is None or entry.draft_token_ids or seq.beam is not None \
                or seq.moves or seq.sampling.top_logprobs >= 0 \
                or (seq.stopping.thinking_budget is not None and not seq.is_thinking_done):
            return False
        in_flight = self._steady_in_flight_steps if seq.seq_id in self._steady_in_flight else 1
        if len(seq.output_token_ids) + in_flight + 1 >= seq.stopping.max_tokens:  # the token planned could be its last
            return False
        self._steady[seq.seq_id] = now[seq.seq_id] = seq
        if entry.extends_table >= 0:
            grown[seq.seq_id] = entry.extends_table
        self._steady_stops |= seq.stop_ids
        self._set_steady_due(seq)
        return True

    def _set_steady_due(self, seq: Sequence) -> None:
        """The output length at which planning handles `seq` again: its table
        is full, its next block fills up (its computed tokens, one fewer than
        its tokens, reach the end of the block after its hashed ones), or the
        token then planned could be its last; and the step count at which its
        output has that length (a step later at the earliest: this one is planned)."""
        block_size, num_prompt = self.blocks.block_size, seq.num_prompt_tokens
        room = len(seq.block_table) * block_size - num_prompt
        fills = (len(seq.block_hashes) + 1) * block_size + 1 - num_prompt
        margin = self._steady_margin
        seq.steady_due = min(room - margin, fills, seq.stopping.max_tokens - 2 - margin)
        seq.steady_due_at = self._steady_clock + max(1, seq.steady_due - len(seq.output_token_ids))
        self._steady_due_at.setdefault(seq.steady_due_at, []).append(seq)

    def _steady_reaching_due(self) -> list[Sequence]:
        """The members whose output has reached `steady_due`: those filed under the
        step counts since the last look (a filing stands while it is the member's
        last and the sequence a member). Handling one early would change nothing
        but its filing: what planning does to it depends on its tokens and table."""
        clock, due_at, steady = self._steady_clock, self._steady_due_at, self._steady
        if self._steady_looked >= clock:
            return []
        looked, self._steady_looked = self._steady_looked, clock
        return [seq for at in range(looked + 1, clock + 1) for seq in due_at.pop(at, ())
                if seq.steady_due_at == at and steady.get(seq.seq_id) is seq]

    def _steady_decodes(self, now: dict[int, Sequence], grown: dict[int, int], step_id: int,
                        steps: int) -> SteadyDecodes:
        """The planned step's columns; its members are the ones in flight from now."""
        if not now:
            return NO_STEADY_DECODES
        self._steady_in_flight, self._steady_step_id, self._steady_in_flight_steps = now, step_id, steps
        seq_ids = list(now)
        return SteadyDecodes(list(now.values()), seq_ids, [grown.get(i, -1) for i in seq_ids] if grown else
                             [-1] * len(seq_ids), self._steady_leaves, steps)

    def _leave_steady(self, seq: Sequence) -> None:
        """It finishes or is preempted (before its blocks are freed): a step in
        flight has its token dropped, and its full blocks go into the prefix cache."""
        member = self._steady.pop(seq.seq_id, None)
        if self._steady_in_flight.pop(seq.seq_id, None) is None and member is None:
            return
        self._steady_leaves += 1
        self.blocks.commit(seq)

    def _steady_answered(self, step_id: int) -> None:
        if step_id == self._steady_step_id:
            self._steady_in_flight = {}

    def _steady_lanes(self, seqs: list[Sequence]) -> tuple[list[Lane], list[int]]:
        """The members whose requests are packed on one stream, per stream
        (Lane: its PackedEntries, their call ids, what picks their tokens out
        of the step's, their indices in `seqs`), and the indices of the others.
        Built again only when the members or their sinks changed since the last step."""
        sinks = [seq.sink for seq in seqs]
        if seqs == self._lanes_for[0] and sinks == self._lanes_for[1]:
            return self._lanes
        by_stream: dict[PackedEntries, tuple[list[int], list[int]]] = {}
        rest = []
        for index, sink in enumerate(sinks):
            if type(sink) is PackedCall:
                members, call_ids = by_stream.setdefault(sink.entries, ([], []))
                members.append(index)
                call_ids.append(sink.call_id)
            else:
                rest.append(index)
        lanes = [(entries, call_ids, _taker(members, len(seqs)), members)
                 for entries, (members, call_ids) in by_stream.items()]
        self._lanes, self._lanes_for = (lanes, rest), (seqs, sinks)
        return self._lanes

    def _forget_steady(self) -> None:
        self._steady.clear()
        self._steady_due_at.clear()
        self._steady_in_flight = {}
        self._steady_step_id = -1


def _taker(members: list[int], num_seqs: int) -> Callable[[list[int]], Iterable[int]]:
    """What picks `members`' tokens (by index) out of a step's, in order."""
    if len(members) == num_seqs:
        return lambda tokens: tokens  # all of them, in order (members ascend)
    if len(members) == 1:
        index = members[0]
        return lambda tokens: (tokens[index],)
    return itemgetter(*members)


def still_running(now: dict[int, Sequence]) -> dict[int, Sequence]:
    """`now` without the members a step's planning preempted after they were taken."""
    running = SequenceStatus.RUNNING
    return {seq_id: seq for seq_id, seq in now.items() if seq.status is running}
