"""The batching policy's accounting for an answered step (BatchPolicy inherits
it): computed KV committed, each sampled token appended with its statistics
(or a speculative step's verified tokens), thinking budgets spent, and the
sequences that stop or reach max_tokens finished."""
from __future__ import annotations

from collections.abc import Callable
from itertools import chain

from services.scheduler.beam import BeamSearch
from services.scheduler.block_manager import BlockManager
from services.scheduler.plan import SampledToken, ScheduledSequence, StepPlan, WorkerCapacity
from services.scheduler.sequence import FinishReason, Sequence, SequenceStatus, TokenEvent
from services.scheduler.speculation import Speculator


class Accounting:
    capacity: WorkerCapacity
    blocks: BlockManager
    speculator: Speculator
    prefill_only: bool
    _outstanding: dict[int, int]
    _planned: dict[int, ScheduledSequence]
    _prefilled: list[Sequence]
    # How many tokens the last postprocess gave to sinks, by (batch size, queue wait µs, latency ms).
    packed_stats: dict[tuple[int, int, float], int]
    finish: Callable[[Sequence, FinishReason], None]
    _fork: Callable[[Sequence], None]
    _advance_beams: Callable[[BeamSearch], list[tuple[Sequence, TokenEvent]]]
    _steady_answered: Callable[[int], None]
    _steady_clock: int

    def postprocess(self, plan: StepPlan, sampled: dict[int, SampledToken | int], started_us: int,
                    finished_us: int, steady_tokens: list[int] | None = None) -> list[tuple[Sequence, TokenEvent]]:
        """Commit computed KV, append each sampled token with its statistics, finish what is done.

        `sampled` holds a SampledToken per sampling sequence, or the token id alone
        where there is nothing else (no log-probabilities, no drafts); the steady
        decodes' tokens may instead be `steady_tokens`, in their order. Returns the
        tokens to deliver; a token its sequence's `sink` took (a middle token of a
        one-choice request) is not among them, but counted in `packed_stats`."""
        events: list[tuple[Sequence, TokenEvent]] = []
        searches: list[BeamSearch] = []  # beam searches whose every beam has offered
        self._steady_clock += plan.steady.steps  # every steady member's output grows by as much here (steady.py)
        self._outstanding.pop(plan.step_id, None)
        planned, batch_size, block_size = self._planned, plan.batch_size, self.blocks.block_size
        finished = SequenceStatus.FINISHED
        packed_stats = self.packed_stats = {}
        if plan.steady.seqs:
            self._take_steady(plan, sampled, steady_tokens, started_us, finished_us, events)
        for entry in plan.scheduled:
            seq, computed, num_new, _, is_sampling, _, epoch, drafts, _ = entry
            seq_id = seq.seq_id
            if planned.get(seq_id) is entry:
                del planned[seq_id]
            if seq.status is finished or epoch != seq.epoch:  # ended or preempted after planning
                continue
            if drafts:
                token = sampled[seq_id]  # none kept, none proposed: an id alone
                token = SampledToken(seq_id, token) if type(token) is int else token
                events += self._take_verified(entry, token, plan, started_us, finished_us)
                continue
            seq.num_computed_tokens = computed = computed + num_new
            if computed // block_size > len(seq.block_hashes):  # a block filled up: into the prefix cache
                self.blocks.commit(seq)
            if not is_sampling:
                continue
            if seq.forks:  # its prompt KV is complete: the siblings start from it
                self._fork(seq)
            token = sampled[seq_id]
            if type(token) is int:
                token_id, logprob, top, drafted = token, None, (), ()
            else:
                token_id, logprob, top, drafted = (token.token_id, token.logprob, token.top_logprobs,
                                                   token.draft_token_ids)
            last_event_us = seq.last_event_us
            queue_wait_us = started_us - last_event_us if started_us > last_event_us else 0
            latency_ms = (finished_us - last_event_us if finished_us > last_event_us else 0) / 1000.0
            seq.last_event_us = finished_us
            if seq.beam is not None:
                event = TokenEvent(token_id, batch_size, queue_wait_us, latency_ms, logprob, top)
                seq.beam.offer(seq, list(top), event)
                if seq.beam.is_ready and seq.beam not in searches:
                    searches.append(seq.beam)
                continue
            seq.output_token_ids.append(token_id)
            if drafted or seq.worker_draft:
                seq.worker_draft, seq.worker_draft_at = drafted, seq.num_tokens
            if logprob is not None:
                seq.cumulative_logprob += logprob
            self._check_finished(seq, token_id)
            if seq.moves and self.prefill_only:
                self._prefilled.append(seq)
            if (sink := seq.sink) is not None and seq.status is not finished \
                    and sink(token_id, shared := (batch_size, queue_wait_us, latency_ms)):
                packed_stats[shared] = packed_stats.get(shared, 0) + 1
                continue
            events.append((seq, TokenEvent(token_id, batch_size, queue_wait_us, latency_ms, logprob, top)))
            if seq.stopping.thinking_budget is not None and seq.status is not finished:
                for forced in self._spend_thinking_budget(seq):
                    # Appended, not sampled: computed with the next step like a prompt chunk.
                    events.append((seq, TokenEvent(forced, batch_size, 0, 0.0)))
        for search in searches:
            if search.is_ready:  # a beam may have been preempted to make room for another search's fork
                events += self._advance_beams(search)
        return events

    def _take_steady(self, plan: StepPlan, sampled: dict[int, SampledToken | int], tokens: list[int] | None,
                     started_us: int, finished_us: int, events: list[tuple[Sequence, TokenEvent]]) -> None:
        """The steady decodes' tokens (steady.py): each a plain one (nothing asked
        but the id), appended with its statistics, given to its sink or delivered,
        as postprocess takes any sampled token; but none reaches max_tokens, a
        full block goes into the prefix cache when planning or leaving sees it,
        the stop ids are looked for once (`_steady_stops`), and the tokens of
        the members whose requests are packed on one stream go to it at once
        (`_steady_lanes`). Every member's last token came from the step before
        (steady.py), so all share one queue wait and latency; a message of
        several steps (`tokens` step after step) shares them evenly among its
        tokens, and a member's tokens after its stop token are dropped."""
        self._steady_answered(plan.step_id)
        steady = plan.steady
        seqs, steps = steady.seqs, steady.steps
        if steady.leaves != self._steady_leaves:
            # Some ended, or were preempted, since planning: their tokens, if any (a
            # refused sequence has none), are dropped. A preempted sequence runs again
            # only from a step planned after this one is accounted.
            running = SequenceStatus.RUNNING
            kept = [i for i, seq in enumerate(seqs) if seq.status is running]
            if not kept:
                return
            if tokens is not None:
                n = len(seqs)
                tokens = [tokens[step * n + i] for step in range(steps) for i in kept]
            seqs = [seqs[i] for i in kept]
        if tokens is None:  # by id (one step: see step_answer)
            tokens = [sampled[seq.seq_id] for seq in seqs]
            if len(set(map(type, tokens))) > 1 or type(tokens[0]) is not int:  # more than the id came
                tokens = [t if type(t) is int else t.token_id for t in tokens]
        n = len(seqs)
        last_event_us = seqs[0].last_event_us
        if steps == 1:
            per_seq = tokens
            for seq, token_id in zip(seqs, tokens):
                seq.output_token_ids.append(token_id)
                seq.num_computed_tokens += 1
                seq.last_event_us = finished_us
        else:
            per_seq = [tokens[i::n] for i in range(n)]
            for seq, taken in zip(seqs, per_seq):
                seq.output_token_ids += taken
                seq.num_computed_tokens += steps
                seq.last_event_us = finished_us
        shared = (plan.batch_size, (started_us - last_event_us if started_us > last_event_us else 0) // steps,
                  (finished_us - last_event_us if finished_us > last_event_us else 0) / 1000.0 / steps)
        stops = self._steady_stops.intersection(tokens) if self._steady_stops else ()
        num_packed, rest = 0, range(n)
        if not stops:  # else each member's tokens are taken alone, its own stop ids looked at
            lanes, rest = self._steady_lanes(seqs)
            for entries, call_ids, take, members in lanes:
                if steps == 1:
                    added = entries.add_many(call_ids, take(tokens), shared)
                else:  # a step's tokens after the other's
                    added = entries.add_many(call_ids * steps, chain.from_iterable(
                        take(tokens[step * n:(step + 1) * n]) for step in range(steps)), shared)
                if added:
                    num_packed += len(call_ids) * steps
                else:  # one of those calls has an event in the stream's message: each goes alone
                    rest = sorted(rest + members)
        for i in rest:
            seq = seqs[i]
            sink, taken = seq.sink, (per_seq[i],) if steps == 1 else per_seq[i]
            for k, token_id in enumerate(taken):
                if token_id in stops and token_id in seq.stop_ids:
                    if k + 1 < len(taken):  # the worker went on past it in vain
                        del seq.output_token_ids[k + 1 - len(taken):]
                    self._check_finished(seq, token_id)
                    events.append((seq, TokenEvent(token_id, *shared)))
                    break
                if sink is not None and sink(token_id, shared):
                    num_packed += 1
                    continue
                events.append((seq, TokenEvent(token_id, *shared)))
                sink = None  # its later tokens follow this one in the same way
        if num_packed:
            self.packed_stats[shared] = self.packed_stats.get(shared, 0) + num_packed

    def _take_verified(self, entry: ScheduledSequence, token: SampledToken, plan: StepPlan, started_us: int,
                       finished_us: int) -> list[tuple[Sequence, TokenEvent]]:
        """Append the drafts the worker kept and the token it sampled after them (up to
        a stop token or max_tokens); give back the blocks taken for the rejected ones.
        The tokens share the step's batch size, and its queue wait and latency evenly."""
        seq, kept = entry.seq, token.num_accepted_draft_tokens
        self.speculator.on_verified(seq, len(entry.draft_token_ids), kept)
        new_tokens = list(entry.draft_token_ids[:kept]) + [token.token_id]
        for n, token_id in enumerate(new_tokens):
            if token_id in seq.stop_ids or len(seq.output_token_ids) + n + 1 >= seq.stopping.max_tokens:
                new_tokens = new_tokens[: n + 1]
                break
        seq.output_token_ids.extend(new_tokens)
        seq.num_computed_tokens = min(entry.num_computed_tokens + 1 + kept, seq.num_tokens - 1)
        self.blocks.commit(seq)
        self.blocks.shrink(seq, seq.num_tokens)
        share = len(new_tokens)
        queue_wait_us = max(0, started_us - seq.last_event_us) // share
        latency_ms = max(0, finished_us - seq.last_event_us) / 1000.0 / share
        seq.last_event_us = finished_us
        seq.worker_draft, seq.worker_draft_at = token.draft_token_ids, seq.num_tokens
        self._check_finished(seq, new_tokens[-1])
        return [(seq, TokenEvent(t, plan.batch_size, queue_wait_us, latency_ms)) for t in new_tokens]

    def _spend_thinking_budget(self, seq: Sequence) -> list[int]:
        """Once the budget is spent inside the think block, append the early-stop
        tokens (as many as max_tokens leaves room for); returns what was appended."""
        budget = seq.stopping.thinking_budget
        if budget is None or seq.is_thinking_done:
            return []
        outputs = seq.output_token_ids
        end = list(budget.end_token_ids)
        if outputs[-len(end):] == end:
            seq.is_thinking_done = True
            return []
        if len(outputs) < budget.max_tokens:
            return []
        seq.is_thinking_done = True
        forced = list(budget.early_stop_token_ids)[: seq.stopping.max_tokens - len(outputs)]
        outputs.extend(forced)
        if len(outputs) >= seq.stopping.max_tokens:
            self.finish(seq, FinishReason.LENGTH)
        return forced

    def _check_finished(self, seq: Sequence, token_id: int) -> None:
        if token_id in seq.stop_ids:
            seq.ended_by_stop_token = True
            self.finish(seq, FinishReason.STOP)
        elif len(seq.output_token_ids) >= seq.stopping.max_tokens:
            self.finish(seq, FinishReason.LENGTH)
