"""Beam search for one request (use_beam_search): the search state and the
selection of each step's beams. The batching policy owns the sequences' blocks
and runs the search through `offer`, `select` and `finalize`.

Every live beam is an ordinary greedy sequence whose worker returns its 2 x width
best next tokens with their log-probabilities. Once every live beam has offered
its candidates (beams advance in lockstep, though not necessarily in one step),
the `width` best continuations by cumulative log-probability become the next
beams. A continuation that ends the text (EOS, unless ignore_eos) and ranks
within the first `width` becomes a finished hypothesis instead. The search ends
when every beam reached max_tokens, or when `width` hypotheses have finished and
no live beam scores better than the worst of them (the usual early stop, as in
HF transformers with early_stopping=False). The n best hypotheses by
length-normalised score (cumulative log-probability / generated tokens) are the
request's choices.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from services.scheduler.sequence import Sequence, TokenEvent

# Score = cumulative logprob / generated_tokens ** LENGTH_PENALTY (vLLM's and HF's default).
LENGTH_PENALTY = 1.0
# The reference refuses beam search whose effective max_tokens is above this.
MAX_BEAM_TOKENS = 128


def beam_score(cumulative_logprob: float, num_tokens: int) -> float:
    return cumulative_logprob / max(num_tokens, 1) ** LENGTH_PENALTY


@dataclass
class Hypothesis:
    """A finished (or, at the end, still live) beam: what its choice reports."""

    token_ids: list[int]
    events: list[TokenEvent]
    cumulative_logprob: float
    ended_by_eos: bool

    @property
    def score(self) -> float:
        return beam_score(self.cumulative_logprob, len(self.token_ids))


@dataclass(frozen=True)
class Continuation:
    """One selected next beam: `parent` extended by `token_id`."""

    parent: Sequence
    token_id: int
    event: TokenEvent


@dataclass
class _Offer:
    """A live beam's candidates for its next token, with that step's statistics."""

    candidates: list[tuple[int, float]]  # (token id, logprob), best first
    event: TokenEvent  # statistics of the step that computed them; token_id unset


@dataclass(eq=False)
class BeamSearch:
    width: int
    # The request's choices: placeholders filled (and finished) when the search ends.
    results: list[Sequence]
    next_seq_id: Callable[[], int]
    # Alternatives the caller asked per token (-1: no logprobs reported).
    top_logprobs: int = -1
    # Tokens that end a hypothesis; set by the policy from the worker (empty with ignore_eos).
    eos_token_ids: frozenset[int] = frozenset()
    beams: list[Sequence] = field(default_factory=list)
    finished: list[Hypothesis] = field(default_factory=list)
    # Per live beam (seq id): the events of its tokens so far, and its pending offer.
    history: dict[int, list[TokenEvent]] = field(default_factory=dict)
    # Prompt tokens the first beam found in the prefix cache (every choice reports it).
    num_cached_tokens: int = 0
    _offers: dict[int, _Offer] = field(default_factory=dict)

    @property
    def is_ready(self) -> bool:
        """Every live beam has offered its candidates: the next beams can be chosen."""
        return bool(self.beams) and all(b.seq_id in self._offers for b in self.beams)

    def is_result(self, seq: Sequence) -> bool:
        return any(seq is r for r in self.results)

    def offer(self, beam: Sequence, candidates: list[tuple[int, float]], event: TokenEvent) -> None:
        if not beam.output_token_ids:  # the first beam's first offer
            self.num_cached_tokens = beam.num_cached_tokens
            self.history.setdefault(beam.seq_id, [])
        self._offers[beam.seq_id] = _Offer(candidates, event)

    def withdraw(self, beam: Sequence) -> None:
        """The beam's KV is gone (preempted): it offers again once recomputed."""
        self._offers.pop(beam.seq_id, None)

    def drop(self, beam: Sequence) -> None:
        """The beam ended (not selected, or aborted)."""
        self.withdraw(beam)
        self.beams = [b for b in self.beams if b is not beam]
        self.history.pop(beam.seq_id, None)

    def select(self) -> list[Continuation]:
        """Choose the next beams from every live beam's offer, best first; finished
        hypotheses are recorded. Beam sequences are left for the caller to extend."""
        ranked = []
        for order, beam in enumerate(self.beams):
            offer = self._offers.pop(beam.seq_id)
            for rank, (token_id, logprob) in enumerate(offer.candidates):
                ranked.append((beam.cumulative_logprob + logprob, order, rank, beam, token_id, logprob, offer))
        ranked.sort(key=lambda c: (-c[0], c[1], c[2]))  # ties: beam order, then candidate rank
        chosen: list[Continuation] = []
        for position, (total, _, _, beam, token_id, logprob, offer) in enumerate(ranked):
            if len(chosen) == self.width:
                break
            event = self._event(offer, token_id, logprob)
            if token_id in self.eos_token_ids:
                if position < self.width:  # only ends ranked among the first `width` count
                    self._add_finished(Hypothesis(
                        beam.output_token_ids + [token_id], self.history[beam.seq_id] + [event], total, True))
                continue
            chosen.append(Continuation(beam, token_id, event))
        return chosen

    def is_done(self, max_tokens: int) -> bool:
        """After the beams were extended: whether the search ends here."""
        if not self.beams or len(self.beams[0].output_token_ids) >= max_tokens:
            return True
        if len(self.finished) < self.width:
            return False
        best_live = max(beam_score(b.cumulative_logprob, len(b.output_token_ids)) for b in self.beams)
        return best_live <= min(h.score for h in self.finished)

    def finalize(self) -> list[Hypothesis]:
        """The hypotheses the request's choices report, best first (at most len(results))."""
        live = [Hypothesis(list(b.output_token_ids), list(self.history[b.seq_id]), b.cumulative_logprob, False)
                for b in self.beams]
        # Stable: on equal scores, finished hypotheses rank before live ones.
        return sorted(self.finished + live, key=lambda h: -h.score)[: len(self.results)]

    def _add_finished(self, hypothesis: Hypothesis) -> None:
        self.finished.append(hypothesis)
        self.finished.sort(key=lambda h: -h.score)
        del self.finished[self.width :]

    def _event(self, offer: _Offer, token_id: int, logprob: float) -> TokenEvent:
        alternatives = offer.candidates[: max(self.top_logprobs, 0)]
        e = offer.event
        return TokenEvent(token_id, e.batch_size, e.queue_wait_us, e.latency_ms, logprob, list(alternatives))
