"""One request's choices on its Generate stream: which sibling's tokens go out
when, and under which index.

best_of == n: every sibling is a choice (index = sibling number) and streams as
it is generated. best_of > n: tokens are held until every sibling has ended, then
the n siblings with the highest cumulative logprob go out best first, renumbered
0..n-1 — the ranking needs every sibling's last token, so nothing can stream.
Beam search: the sequences are the search's result placeholders, all filled and
finished at once when it ends (beam.py); each goes out whole under its index.
"""
from __future__ import annotations

from typing import NamedTuple

from services.common.errors import invalid_argument
from services.scheduler.sequence import Sequence, TokenEvent

_MASK64 = (1 << 64) - 1


def sibling_seed(seed: int, index: int) -> int:
    """The seed of sibling `index` of a request seeded `seed` (both < 2**63).

    Sibling 0 keeps the request's seed, so n = 1 is unchanged; the others get a
    splitmix64 mix of (seed, index), folded to 63 bits: distinct generator streams,
    and the same ones for the same seed, so a seeded request is reproducible."""
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class ChoiceUpdate(NamedTuple):
    """One message's worth of one choice: its new tokens, and whether it ends here
    (a tuple: one is built per request per step)."""

    index: int
    seq: Sequence
    events: list[TokenEvent]
    is_first: bool
    is_last: bool


class Choices:
    def __init__(self, seqs: list[Sequence], n: int, report_logprobs: bool):
        assert 1 <= n <= len(seqs)
        self.seqs = seqs
        self.n = n
        # The caller asked for per-token logprobs; otherwise they are internal only.
        self.report_logprobs = report_logprobs
        # Every token carries a logprob, so the choice's sum is meaningful to report.
        self.has_logprobs = report_logprobs or len(seqs) > 1
        self._pending: dict[int, list[TokenEvent]] = {s.seq_id: [] for s in seqs}
        self._started: set[int] = set()  # seq ids with a message sent
        self._ended: set[int] = set()  # seq ids whose last message was sent (or dropped)
        # One choice whose tokens need nothing but themselves: its middle ones may go packed.
        self._plain = len(seqs) == 1 and not self.has_logprobs

    def packable(self) -> Sequence | None:
        """The sequence whose coming tokens may go packed (PackedTokens) instead of
        through `accept`, one by one and each but its last: that of a one-choice
        request without log-probabilities or a thinking budget, once its first
        message is out. None otherwise."""
        if not self._plain or not self._started or self._ended:
            return None
        seq = self.seqs[0]
        return seq if seq.beam is None and seq.stopping.thinking_budget is None and not seq.is_finished else None

    @property
    def is_selecting(self) -> bool:
        return len(self.seqs) > self.n

    @property
    def is_done(self) -> bool:
        """Every choice has sent its last message: the stream may end."""
        return len(self._ended) == len(self.seqs)

    @property
    def unfinished(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished]

    def sibling_of(self, index: int) -> int:
        """The sibling number behind choice `index` while the request streams."""
        if self.is_selecting:
            raise invalid_argument("a single choice cannot be aborted when best_of > n")
        if self.seqs[0].beam is not None:
            raise invalid_argument("a single choice cannot be aborted with use_beam_search")
        if not 0 <= index < self.n:
            raise invalid_argument(f"choice index {index} is not in [0, {self.n})")
        return index

    def accept(self, items: list[tuple[Sequence, TokenEvent]]) -> list[ChoiceUpdate]:
        """Take delivered tokens; return the messages to send now, at most one per choice.

        Call with no items after sequences ended without a token (abort): their
        choices then end too."""
        if len(self.seqs) == 1:  # most requests: one choice, whatever the items hold (nothing pends)
            seq = self.seqs[0]
            is_last = seq.is_finished
            if (not items and not is_last) or self._ended:
                return []
            is_first = not self._started
            if is_first:
                self._started.add(seq.seq_id)
            if is_last:
                self._ended.add(seq.seq_id)
            return [ChoiceUpdate(seq.index, seq, [event for _, event in items], is_first, is_last)]
        for seq, event in items:
            self._pending[seq.seq_id].append(event)
        if self.is_selecting:
            return self._select() if all(s.is_finished for s in self.seqs) and not self._ended else []
        # First appearance order, then choices that ended without a new token.
        order = list(dict.fromkeys(seq for seq, _ in items))
        order += [s for s in self.seqs if s.is_finished and s not in order]
        return [update for seq in order if (update := self._take(seq, seq.index)) is not None]

    def _select(self) -> list[ChoiceUpdate]:
        # Sorted is stable: equal sums keep sibling order, so the result is reproducible.
        ranked = sorted(self.seqs, key=lambda s: -s.cumulative_logprob)
        for dropped in ranked[self.n :]:
            self._pending[dropped.seq_id].clear()
            self._ended.add(dropped.seq_id)
        return [update for rank, seq in enumerate(ranked[: self.n]) if (update := self._take(seq, rank)) is not None]

    def _take(self, seq: Sequence, index: int) -> ChoiceUpdate | None:
        if seq.seq_id in self._ended:
            return None
        events, self._pending[seq.seq_id] = self._pending[seq.seq_id], []
        is_last = seq.is_finished
        if not events and not is_last:
            return None
        is_first = seq.seq_id not in self._started
        self._started.add(seq.seq_id)
        if is_last:
            self._ended.add(seq.seq_id)
        return ChoiceUpdate(index, seq, events, is_first, is_last)
