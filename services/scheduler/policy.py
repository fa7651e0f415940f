"""Continuous batching for one worker: which sequences run in the next step.

Each step (SplitFuse) first decodes every running sequence that has finished
its prompt, then fills the rest of the batch with prefill chunks — running
sequences part-way through their prompt first, then waiting ones first come,
first served — under the prefill-token budget and the batch limit. A long
prompt thus runs as several chunks while decodes keep flowing.

KV blocks are taken on demand (BlockManager), with prefix-cache hits at
admission. When a decode cannot get a block, the newest running sequence is
preempted: its blocks are freed and it goes back to the head of the waiting
queue, to be recomputed (prompt and outputs so far) when room returns.

Several sequences per request (n, best_of): the siblings of one request do not
each prefill the prompt. The first one queues alone; the step that completes its
prompt forks the others from it, sharing its full prompt blocks by reference
count, and each computes only the prompt's tail (the last, partial block) itself.
A preempted sibling is recomputed like any sequence (MindIE aborts such requests).

Planning ahead: `schedule` may run once more while the step it planned last
is still on the worker (the engine sends step N+1 before step N answers, so the
worker never waits). A sequence in that step then continues from where the step
leaves it: a prefill chunk goes on with the next chunk, and a sampling sequence
decodes the token the worker is sampling now (`feeds_last_sampled`) — unless
that token could end it (max_tokens reached) or the scheduler must see it
first (beam selection, a thinking budget), in which case it waits a step. A
sequence that finishes on the token it was waiting for has one wasted step,
whose result is dropped; a preemption makes any planned step's result stale
(`epoch`).

Accounting for an answered step (tokens appended, sequences finished) is in
accounting.py; beam search (select, fork and end beams on these blocks and
queues) in beam_steps.py; a prefill worker's sequences that move to a decode worker,
and a decode worker's that come from one, in transfer_steps.py.

Speculative decoding (speculation.py): a decoding sequence whose last token is
known may carry a draft after it; its step then yields up to 1 + the draft's
length tokens, the blocks it took for rejected drafts go back, and it is not
planned ahead while it drafts.
"""
from __future__ import annotations

import time
from collections import deque

from services.common.media_parts import MAX_STEP_IMAGE_BYTES
from services.scheduler.accounting import Accounting
from services.scheduler.beam_steps import BeamSteps
from services.scheduler.block_manager import BlockManager
from services.scheduler.plan import (  # noqa: F401 - re-exported: the policy's vocabulary
    CapacityError,
    SampledToken,
    ScheduledSequence,
    StepPlan,
    WorkerCapacity,
)
from services.scheduler.sequence import FinishReason, Sequence, SequenceStatus
from services.scheduler.speculation import SpeculationConfig, Speculator
from services.scheduler.steady import SteadySteps, still_running
from services.scheduler.transfer_steps import TransferSteps

# ScheduledSequence's fields in order, without the generated __new__'s frame (one per sequence per step).
_new_entry = tuple.__new__


class BatchPolicy(Accounting, BeamSteps, TransferSteps, SteadySteps):
    def __init__(self, capacity: WorkerCapacity, max_batch_size: int, max_prefill_tokens: int,
                 speculator: Speculator | None = None, decode_steps: int = 1):
        self.capacity = capacity
        self.speculator = speculator or Speculator(SpeculationConfig())
        self._is_speculating = self.speculator.is_on
        self.max_batch_size = min(max_batch_size, capacity.max_batch_size)
        self.max_prefill_tokens = max_prefill_tokens
        self.blocks = BlockManager(capacity.num_kv_blocks, capacity.block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last is the newest
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # prefix-cache hits, in tokens, over all admissions
        self.num_queried_tokens = 0  # tokens looked up in the prefix cache, over all admissions
        self._num_fork_pending = 0  # siblings waiting for their leader's prompt (the leaders' `forks`)
        self._to_release: list[int] = []
        # Block copies for the next step, by the seq id of the beam whose block is written.
        self._copies: dict[int, tuple[int, int]] = {}
        # Planned steps not yet postprocessed (at most one at planning time) with
        # their number of sequences, and each sequence's part of the latest of them.
        self._outstanding: dict[int, int] = {}
        self._planned: dict[int, ScheduledSequence] = {}
        self._next_step_id = 0
        self.packed_stats: dict[tuple[int, int, float], int] = {}
        self._init_transfers(capacity.role == "prefill")
        self._init_steady(decode_steps)

    # -- admission ---------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.add_group([seq])

    def add_group(self, seqs: list[Sequence]) -> None:
        """Queue one request's sibling sequences (one for n = best_of = 1).

        The first (leader) queues; the others wait outside the queue until its
        prompt KV is computed, then fork from it (see _fork) instead of each
        prefilling the prompt. Penalties need every prompt token fed to the worker
        (its penalty history), so such siblings queue and prefill on their own.

        Beam search: `seqs` are the request's result placeholders; the search's
        first beam queues."""
        search = seqs[0].beam
        if search is not None:
            # Every beam may grow to full length at once: the search must fit whole.
            self._check_fits(search.beams[0], search.width)
            if not search.beams[0].stopping.ignore_eos:
                search.eos_token_ids = self.capacity.eos_token_ids
            self.waiting.append(search.beams[0])
            return
        eos = self.capacity.eos_token_ids
        for seq in seqs:
            self._check_fits(seq, 1)
            stopping = seq.stopping
            seq.stop_ids = stopping.stop_token_ids if stopping.ignore_eos else stopping.stop_token_ids | eos
        leader, *siblings = seqs
        if siblings and not leader.sampling.has_penalties:
            leader.forks = siblings
            self._num_fork_pending += len(siblings)
            for sibling in siblings:
                sibling.status, sibling.fork_of = SequenceStatus.FORK_PENDING, leader
            self.waiting.append(leader)
        else:
            self.waiting.extend(seqs)

    def _check_fits(self, seq: Sequence, copies: int) -> None:
        needed = copies * self.blocks.blocks_for(seq.num_prompt_tokens + seq.stopping.max_tokens)
        if needed > self.capacity.num_kv_blocks:
            what = f"{copies} beams x (" if copies > 1 else "("
            raise CapacityError(
                f"{what}prompt ({seq.num_prompt_tokens} tokens) + max_tokens ({seq.stopping.max_tokens})) "
                f"exceeds the KV cache ({self.capacity.num_kv_blocks * self.capacity.block_size} tokens)"
            )

    def num_cached_prefix_tokens(self, seq: Sequence) -> int:
        """Prompt tokens `seq` would reuse here (for placement across workers)."""
        if seq.sampling.needs_full_history:
            return 0
        return self.blocks.num_cached_tokens(seq.prompt_cache_keys)

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free_blocks

    @property
    def num_unfinished(self) -> int:
        """len(unfinished_sequences()), counted without building it: every placement
        and every new request reads it for every worker."""
        return len(self.running) + len(self.waiting) + self._num_fork_pending + self.num_moving

    def unfinished_sequences(self) -> list[Sequence]:
        """Running, waiting and fork-pending sequences."""
        seqs = list(self.running) + list(self.waiting)
        return seqs + [fork for seq in seqs for fork in seq.forks]

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._to_release or self._copies or self.num_moving)

    # -- the three verbs -----------------------------------------------------
    def schedule(self) -> StepPlan | None:
        """Plan the next step: decodes first, then prefill chunks while budget and blocks allow.

        May be called once while the last planned step runs (see the module doc)."""
        assert len(self._outstanding) <= 1, "plan at most one step ahead of the worker"
        batch: list[ScheduledSequence] = []
        steady, grown, steps = self._plan_steady()
        has_preempted, prefilling, num_decodes = self._schedule_decodes(batch, steady, grown)
        if has_preempted and steady:
            steady = still_running(steady)
        num_decode_entries = len(batch)
        budget = self.max_prefill_tokens
        for seq in prefilling:  # prompts part-way done continue first
            position = self._position(seq)
            if seq.status is not SequenceStatus.RUNNING or position is None or position[1] - position[0] <= 1:
                continue  # preempted while decodes took blocks
            if budget == 0 or len(batch) + len(steady) >= self.max_batch_size:
                break
            chunk = self._grow_chunk(seq, budget)
            while chunk == 0 and not batch and not steady and not self._is_computing \
                    and self.running[-1] is not seq:
                # Partial prompts hold every block and nothing decodes: no step would
                # ever free one, so make room as a decode would.
                self.preempt(self.running[-1])
                has_preempted = True
                chunk = self._grow_chunk(seq, budget)
            if chunk == 0:
                break
            batch.append(self._schedule_entry(seq, position[0], chunk))
            budget -= chunk
        if not batch and not steady and not self._is_computing and self.running and self.waiting:
            self._unblock_beam_search()
        # No admissions in a step that preempted: the room is for those already running.
        image_bytes = 0  # what the admitted sequences' images add to the step's message
        while self.waiting and not has_preempted and budget > 0 and len(batch) + len(steady) < self.max_batch_size:
            seq = self.waiting[0]
            seq_image_bytes = sum(image.num_bytes for image in seq.images)
            if image_bytes and image_bytes + seq_image_bytes > MAX_STEP_IMAGE_BYTES:
                break  # its images ride the next step
            if not self._admit(seq, budget, batch):
                break  # first come, first served: never skip the head
            budget -= batch[-1].num_new_tokens
            image_bytes += seq_image_bytes
        if not batch and not steady and not self._to_release and not self._copies:
            return None
        for entry in batch[num_decode_entries:]:  # a recomputed sequence's last token is a decode too
            if entry.num_new_tokens == 1 and entry.num_computed_tokens >= len(entry.seq.prompt_token_ids):
                num_decodes += 1
        step_id = self._next_step_id
        plan = StepPlan(step_id, batch, self._to_release, list(self._copies.values()), num_decodes + len(steady),
                        self._steady_decodes(steady, grown, step_id, steps))
        self._next_step_id += 1
        self._to_release, self._copies = [], {}
        self._outstanding[step_id] = plan.batch_size
        for entry in batch:
            self._planned[entry.seq.seq_id] = entry
        return plan

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence (abort or error): it leaves the queue or batch and its blocks are freed."""
        if seq.is_finished:
            return
        if seq.beam is not None and seq.beam.is_result(seq):
            self._end_beam_search(seq.beam, reason)
            return
        if seq.beam is not None:
            seq.beam.drop(seq)
        self._copies.pop(seq.seq_id, None)
        self._planned.pop(seq.seq_id, None)
        self._leave_steady(seq)
        self.speculator.on_finished(seq)
        if seq.forks:
            self._orphan_forks(seq)
        if self._finish_moving(seq):
            pass  # out of the batch, between two workers
        elif seq.status is SequenceStatus.FORK_PENDING:
            assert seq.fork_of is not None
            seq.fork_of.forks.remove(seq)
            seq.fork_of = None
            self._num_fork_pending -= 1
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
            # Freed now, though a step may still be writing them: the next plan —
            # the first that could hand them out again — comes after that step.
            self.blocks.free(seq)
            # Released even if its first step is still in flight: releasing an
            # id the worker does not hold is a no-op, a missed release a leak.
            self._to_release.append(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks; it waits at the head of the queue to be recomputed."""
        self._leave_steady(seq)  # with its blocks: its full ones go into the prefix cache
        self.running.remove(seq)
        self.blocks.free(seq)
        self._copies.pop(seq.seq_id, None)
        self._planned.pop(seq.seq_id, None)
        seq.epoch += 1
        if seq.beam is not None:
            seq.beam.withdraw(seq)
        seq.num_computed_tokens = 0
        seq.is_sent_to_worker = False  # the worker releases its state and needs sampling again
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self._to_release.append(seq.seq_id)
        self.num_preemptions += 1

    def forget_worker_state(self) -> None:
        """The worker restarted or died: nothing it held needs releasing any more,
        and no planned step will answer."""
        self._to_release = []
        self._outstanding.clear()
        self._planned.clear()
        self._forget_steady()

    # -- siblings ----------------------------------------------------------
    def _fork(self, leader: Sequence) -> None:
        """Start the leader's pending siblings on its computed prompt blocks.

        Only full blocks before the last prompt token are shared: each sibling feeds
        the prompt's tail itself (at most one block), since the step that feeds the
        last prompt token is the one that yields its logits to sample from — and
        the worker must never write into a shared block."""
        num_shared = (leader.num_prompt_tokens - 1) // self.blocks.block_size
        for sibling in leader.forks:
            self.blocks.fork(leader, sibling, num_shared)
            sibling.num_computed_tokens = sibling.num_cached_tokens = num_shared * self.blocks.block_size
            self.num_cached_tokens += sibling.num_cached_tokens
            self.num_queried_tokens += sibling.num_tokens
            sibling.first_scheduled_us = sibling.first_scheduled_us or time.time_ns() // 1000
            sibling.status, sibling.fork_of = SequenceStatus.RUNNING, None
            self.running.append(sibling)
        self._num_fork_pending -= len(leader.forks)
        leader.forks = []

    def _orphan_forks(self, leader: Sequence) -> None:
        """The leader ends before its prompt is computed (abort, worker lost): its
        first pending sibling takes over as the leader at the head of the queue."""
        heir, *rest = leader.forks
        leader.forks = []
        self._num_fork_pending -= 1  # the heir queues
        heir.status, heir.fork_of, heir.forks = SequenceStatus.WAITING, None, rest
        for sibling in rest:
            sibling.fork_of = heir
        self.waiting.appendleft(heir)

    # -- helpers -----------------------------------------------------------
    @property
    def _is_computing(self) -> bool:
        """A planned step computes sequences: its results may let others go on."""
        return any(self._outstanding.values())

    def _position(self, seq: Sequence) -> tuple[int, int] | None:
        """(tokens computed, tokens known) once the steps planned so far have run;
        None while its next input is a token in flight that the scheduler must see first."""
        entry = self._planned.get(seq.seq_id)
        num_tokens = len(seq.prompt_token_ids) + len(seq.output_token_ids)
        in_flight = 1  # tokens the step in flight samples for it
        if entry is not None:
            computed = entry.num_computed_tokens + entry.num_new_tokens
            if not entry.is_sampling:
                return computed, num_tokens
        elif seq.seq_id in self._steady_in_flight:  # steady decodes of a token a step, without drafts
            in_flight = self._steady_in_flight_steps
            computed = seq.num_computed_tokens + in_flight
        else:
            return seq.num_computed_tokens, num_tokens
        if seq.beam is not None or seq.moves or (entry is not None and entry.draft_token_ids) \
                or len(seq.output_token_ids) + in_flight >= seq.stopping.max_tokens \
                or (seq.stopping.thinking_budget is not None and not seq.is_thinking_done) \
                or (self._is_speculating and self.speculator.wants_draft(seq, self._num_drafting_load)):
            return None
        return computed, num_tokens + in_flight  # with the tokens in flight

    def _schedule_entry(self, seq: Sequence, computed: int, num_new: int,
                        draft: tuple[int, ...] = ()) -> ScheduledSequence:
        in_flight = self._planned.get(seq.seq_id)
        feeds_last_sampled = in_flight.is_sampling if in_flight is not None else seq.seq_id in self._steady_in_flight
        table, extends_table = seq.block_table, None
        if feeds_last_sampled and not draft and seq.sent_table is table and len(table) - seq.num_sent_blocks <= 1 \
                and self.capacity.holds_block_tables:
            extends_table = table[-1] if len(table) > seq.num_sent_blocks else -1
        seq.sent_table, seq.num_sent_blocks = table, len(table)
        entry = _new_entry(ScheduledSequence, (
            seq, computed, num_new, feeds_last_sampled,
            feeds_last_sampled
            or computed + num_new - len(draft) == len(seq.prompt_token_ids) + len(seq.output_token_ids),
            not seq.is_sent_to_worker, seq.epoch, draft, extends_table,
        ))
        seq.is_sent_to_worker = True
        return entry

    def _schedule_decodes(self, batch: list[ScheduledSequence], steady: dict[int, Sequence],
                          grown: dict[int, int]) -> tuple[bool, list[Sequence], int]:
        """Add a one-token step for every decoding sequence not in `steady` (this
        step's steady decodes, which a decode may join); returns whether any was
        preempted, the running sequences part-way through their prompt (in
        admission order, up to where the batch filled: past it none would fit),
        and how many of the entries are decodes (past the prompt, StepPlan.num_decodes)."""
        if len(steady) == len(self.running):  # every running sequence is a steady decode
            return False, [], 0
        has_preempted = False
        num_decodes = 0
        prefilling: list[Sequence] = []
        draft_budget = self.speculator.draft_budget(self._num_drafting_load)
        block_size, max_batch_size, running_status = self.blocks.block_size, self.max_batch_size, SequenceStatus.RUNNING
        position_of, entry_for, join = self._position, self._schedule_entry, self._join_steady
        for seq in list(self.running):
            if seq.status is not running_status or seq.seq_id in steady:
                continue
            position = position_of(seq)
            if position is None:
                continue
            computed, total = position
            if total - computed != 1:
                if total - computed > 1:
                    prefilling.append(seq)
                continue
            if len(batch) + len(steady) >= max_batch_size:
                break
            if total > len(seq.block_table) * block_size:  # else its last block has room: nothing to take
                while not self.blocks.can_grow(seq, total):
                    victim = self.running[-1]  # the newest: it has the least work to lose
                    self.preempt(victim)
                    has_preempted = True
                    if victim is seq:
                        break
                if seq.status is not running_status:
                    continue
                self.blocks.grow(seq, total)
            if draft_budget > 0 and (draft := self._draft(seq, total, draft_budget)):
                draft_budget -= len(draft)
                self.blocks.grow(seq, total + len(draft))
                entry = entry_for(seq, computed, 1 + len(draft), draft)
            else:
                entry = entry_for(seq, computed, 1)
                if join(entry, steady, grown):
                    continue  # counted with the steady decodes
            if computed >= len(seq.prompt_token_ids):
                num_decodes += 1
            batch.append(entry)
        return has_preempted, prefilling, num_decodes

    @property
    def _num_drafting_load(self) -> int:
        """What the step's draft budget is measured against: the running sequences,
        or the whole budget while requests wait for admission (the batch is
        filling up: its steps are better spent admitting them)."""
        return len(self.running) + (self.speculator.config.draft_token_budget if self.waiting else 0)

    def _draft(self, seq: Sequence, total: int, budget: int) -> tuple[int, ...]:
        """A draft for a decoding sequence whose last token is known: within the step's
        budget, max_tokens, and blocks that leave one for every running sequence."""
        if budget <= 0 or seq.seq_id in self._planned:
            return ()
        spare_blocks = max(0, self.blocks.num_free_blocks - len(self.running))
        room = (len(seq.block_table) + spare_blocks) * self.blocks.block_size - total
        max_len = min(budget, room, seq.stopping.max_tokens - len(seq.output_token_ids) - 1)
        return tuple(self.speculator.propose(seq, max_len))

    def _grow_chunk(self, seq: Sequence, budget: int) -> int:
        """Take blocks for the next prefill chunk of `seq`, as long as budget and blocks allow."""
        position = self._position(seq)
        assert position is not None
        computed, total = position
        end = min(total, computed + budget, self.blocks.max_tokens_for(seq))
        if end <= computed:
            return 0
        self.blocks.grow(seq, end)
        return end - computed

    def _admit(self, seq: Sequence, budget: int, batch: list[ScheduledSequence]) -> bool:
        # Penalties need the whole history on the worker, so those sequences skip the cache.
        cached = self.blocks.allocate_prefix(seq, use_cache=not seq.sampling.needs_full_history)
        seq.num_computed_tokens = cached
        chunk = self._grow_chunk(seq, budget)
        if chunk == 0:
            self.blocks.free(seq)
            seq.num_computed_tokens = 0
            return False
        if not seq.output_token_ids:  # reported with the first token; a re-admission keeps it
            seq.num_cached_tokens = cached
        self.num_cached_tokens += cached
        if not seq.sampling.needs_full_history:
            self.num_queried_tokens += seq.num_tokens
        seq.first_scheduled_us = seq.first_scheduled_us or time.time_ns() // 1000
        self.waiting.popleft()
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        batch.append(self._schedule_entry(seq, cached, chunk))
        return True
