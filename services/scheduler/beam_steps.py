"""The batching policy's beam-search steps (BatchPolicy inherits them).

Beam search (beam.py): its live beams are greedy sequences that offer candidates
instead of taking a token. Once all have offered, the selected continuations
extend their parents; a parent chosen more than once forks a new beam that
shares its full blocks by reference count and gets a copy of its partial last
block (copy-on-write, done by the worker before the next step's forward), and
beams not chosen end. Nothing is recomputed.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable

from services.scheduler.beam import BeamSearch, Continuation
from services.scheduler.block_manager import BlockManager
from services.scheduler.sequence import FinishReason, Sequence, SequenceStatus, TokenEvent


class BeamSteps:
    """Selecting, forking and ending beams on the policy's blocks and queues."""

    blocks: BlockManager
    waiting: deque[Sequence]
    running: list[Sequence]
    _copies: dict[int, tuple[int, int]]
    finish: Callable[[Sequence, FinishReason], None]
    preempt: Callable[[Sequence], None]

    def _advance_beams(self, search: BeamSearch) -> list[tuple[Sequence, TokenEvent]]:
        """Every live beam has offered: select, extend and fork the next beams, and
        end the search with its results when it is done."""
        chosen = search.select()
        parents = {id(c.parent) for c in chosen}
        for beam in list(search.beams):
            if id(beam) not in parents:  # not chosen: its blocks go before forks take any
                self.finish(beam, FinishReason.ABORT)
        firsts: dict[int, Continuation] = {}
        for c in chosen:
            firsts.setdefault(c.parent.seq_id, c)
        # Forks copy their parent as it was, so they are made before parents extend.
        beams = [c.parent if firsts[c.parent.seq_id] is c else self._fork_beam(search, c) for c in chosen]
        for c in firsts.values():
            c.parent.output_token_ids.append(c.token_id)
            c.parent.cumulative_logprob += c.event.logprob or 0.0
            search.history[c.parent.seq_id].append(c.event)
        search.beams = beams
        if not search.is_done(search.results[0].stopping.max_tokens):
            return []
        hypotheses = search.finalize()
        for beam in list(search.beams):
            self.finish(beam, FinishReason.LENGTH)
        events = []
        for result, hypothesis in zip(search.results, hypotheses):
            result.output_token_ids = hypothesis.token_ids
            result.cumulative_logprob = hypothesis.cumulative_logprob
            result.ended_by_stop_token = hypothesis.ended_by_eos
            result.num_cached_tokens = search.num_cached_tokens
            result.status = SequenceStatus.FINISHED
            result.finish_reason = FinishReason.STOP if hypothesis.ended_by_eos else FinishReason.LENGTH
            events += [(result, event) for event in hypothesis.events]
        # Fewer hypotheses than choices (every candidate ended early) leaves empty ones.
        self._end_beam_search(search, FinishReason.STOP)
        return events

    def _fork_beam(self, search: BeamSearch, c: Continuation) -> Sequence:
        """A new beam: `c.parent` as it is now, extended by `c.token_id`."""
        parent = c.parent
        child = Sequence(
            seq_id=search.next_seq_id(),
            request_id=parent.request_id,
            prompt_token_ids=parent.prompt_token_ids,
            images=parent.images,
            sampling=parent.sampling,
            stopping=parent.stopping,
            arrival_us=parent.arrival_us,
            traceparent=parent.traceparent,
            output_token_ids=parent.output_token_ids + [c.token_id],
            status=SequenceStatus.RUNNING,
            last_event_us=parent.last_event_us,
            num_cached_tokens=parent.num_cached_tokens,
            cumulative_logprob=parent.cumulative_logprob + (c.event.logprob or 0.0),
            beam=search,
        )
        search.history[child.seq_id] = search.history[parent.seq_id] + [c.event]
        computed = parent.num_computed_tokens
        num_full = computed // self.blocks.block_size
        self.blocks.fork(parent, child, num_full)
        while not self.blocks.can_grow(child, computed):
            # The search fits the pool alone (add_group): others make room.
            victim = next((s for s in reversed(self.running) if s.beam is not search), None)
            if victim is None:
                break
            self.preempt(victim)
        if self.blocks.can_grow(child, computed):
            self.blocks.grow(child, computed)
            child.num_computed_tokens = computed
            if len(child.block_table) > num_full:  # the partial block, copied on write
                self._copies[child.seq_id] = (parent.block_table[num_full], child.block_table[num_full])
            self.running.append(child)
        else:  # not reachable while add_group's check holds; recomputing is still correct
            self.blocks.free(child)
            child.status = SequenceStatus.WAITING
            self.waiting.appendleft(child)
        return child

    def _unblock_beam_search(self) -> None:
        """Nothing can run: every running sequence is a beam waiting for the others of
        its search, which are queued without room (several searches share the pool).
        The oldest queued search goes first: others' sequences make room (preempted,
        newest first) and its beams move to the head of the queue. It fits the pool
        alone (add_group), so it advances."""
        queued = [seq for seq in self.waiting if seq.beam is not None]
        if not queued:
            return
        search = min(queued, key=lambda seq: seq.arrival_us).beam
        needed = sum(self.blocks.blocks_for(seq.num_tokens) for seq in queued if seq.beam is search)
        while self.blocks.num_free_blocks < needed:
            victim = next((seq for seq in reversed(self.running) if seq.beam is not search), None)
            if victim is None:
                break
            self.preempt(victim)
        mine = [seq for seq in self.waiting if seq.beam is search]
        rest = [seq for seq in self.waiting if seq.beam is not search]
        self.waiting = deque(mine + rest)

    def _end_beam_search(self, search: BeamSearch, reason: FinishReason) -> None:
        """End the search's live beams; results not yet filled end empty with `reason`."""
        for beam in list(search.beams):
            self.finish(beam, reason)
        for result in search.results:
            if not result.is_finished:
                result.status, result.finish_reason = SequenceStatus.FINISHED, reason
