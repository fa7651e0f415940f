"""Speculative decoding in the scheduler: which sequences draft, how many tokens,
and what their verification taught.

A drafting sequence's step feeds its last token and the draft as extra query
rows of the same forward; the worker samples at every drafted position and
keeps the drafts up to the first one its own sample disagrees with, then adds
the token it sampled there (or after the last draft). So the tokens are those
the sequence would have got one step at a time (see services/worker/speculative.py).

A draft needs the sequence's last token, so a sequence that drafts is not
planned ahead (policy.py's planning one step ahead): it waits for its step's
answer and drafts from it — only when its tokens so far already have a guess
(whose first token guesses the one in flight). A wait costs the overlap of
scheduler and worker that planning ahead buys, so the draft length adapts per
sequence:

- after a verification, the next draft is one token longer than what was
  accepted, or twice as long after a fully accepted one (a run of copied text
  reaches `max_draft_tokens`, the most, in a few steps); a sequence running
  alone drafts up to the most every time (where the continuation's estimated
  probability holds, drafting.py): beside one sequence's step a drafted row
  costs about a tenth of it, and a short draft gives up tokens that a long one
  would have kept;
- an average of the tokens accepted per wait (a wait that found no draft gains
  none) below PAUSE_BELOW pauses drafting for that sequence for a number of
  tokens that doubles with each pause (it plans ahead meanwhile), and a probe
  after the pause decides again. A sequence running alone pauses only below
  PAUSE_BELOW_ALONE: its wait costs one round trip (about a tenth of a step)
  and its drafted rows little, where with others a wait splits the batch;
- under load the step's drafted tokens are capped at `draft_token_budget`
  minus the decoding sequences (each drafted row costs compute once the batch
  is wide), down to none.

With `mtp` the draft is the worker's: a checkpoint's multi-token prediction
module guesses the token after each one the worker samples (services/worker/mtp.py),
and the sequence's next step carries that guess, verified as any draft is.

Off for a sequence (it decodes as without speculation): logprobs asked
(top_logprobs, best_of ranking, beam search), penalties, grammars, and a
thinking budget still open — each needs per-token state the worker would
have to roll back on a rejection.
"""
from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.drafting import (
    GlobalSuffixCounts,
    LatestOccurrence,
    SuffixCounts,
    most_frequent_path,
)
from services.scheduler.sequence import Sequence

METHODS = ("off", "prompt_lookup", "suffix", "mtp")
# Tokens accepted per wait (EMA) below which a sequence stops drafting for a while.
# 0.25 drafted more at 1 stream (random prompts 1.27x -> 1.49-1.58x the tokens/s
# without speculation) but cost 6-11 % at 8 streams, where each wait splits the
# batch (bench.speculative, paired rounds, 2026-11-26).
PAUSE_BELOW = 0.5
# Alone, a fruitless wait costs the round trip and a rejected row (about 2 ms of
# a 12 ms step on the bundled model) and a kept token saves a step: drafting pays
# down to about 0.2 tokens kept per wait.
PAUSE_BELOW_ALONE = 0.15
EMA_WEIGHT = 0.3
FIRST_PAUSE_TOKENS = 16
MAX_PAUSE_TOKENS = 1024


@dataclass(frozen=True)
class SpeculationConfig:
    method: str = "off"
    max_draft_tokens: int = 8
    # Drafted tokens a step may carry, less one per decoding sequence.
    draft_token_budget: int = 24


@dataclass
class DraftState:
    """One sequence's drafting history."""

    index: LatestOccurrence | SuffixCounts | None  # None: the worker drafts (mtp)
    draft_len: int
    gain: float = 1.0  # EMA of tokens accepted per wait
    paused_until: int = 0  # no drafts before the sequence has this many output tokens
    pause_tokens: int = FIRST_PAUSE_TOKENS
    has_waited: bool = False  # the sequence was not planned ahead, to draft


def is_eligible(seq: Sequence) -> bool:
    """Whether speculation keeps this sequence's outputs and everything reported with them exact."""
    sampling, budget = seq.sampling, seq.stopping.thinking_budget
    return (sampling.top_logprobs < 0 and not sampling.has_penalties and sampling.grammar is None
            and seq.beam is None and (budget is None or seq.is_thinking_done))


class Speculator:
    def __init__(self, config: SpeculationConfig):
        self.config = config
        self._states: dict[int, DraftState] = {}
        self._global = GlobalSuffixCounts() if config.method == "suffix" else None
        # Totals since start, for the metrics: steps that carried a draft, drafted and accepted tokens.
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_waits = 0  # times a sequence was not planned ahead, to draft
        self._load = 0  # the drafting load of the step planned last (draft_budget)

    @property
    def is_on(self) -> bool:
        return self.config.method != "off"

    def wants_draft(self, seq: Sequence, num_running: int) -> bool:
        """Whether `seq` should wait for its step in flight and draft from its result:
        drafting may pay, and its tokens so far have a guess (whose first token is a
        guess at the one in flight) — else it plans ahead as without speculation."""
        # With mtp the worker drafts from the token in flight: it will have a guess.
        if self.draft_budget(num_running) <= 0 or not self._may_draft(seq) or (
                self.config.method != "mtp" and not self._guess(seq, 1)):
            return False
        self._state(seq)
        state = self._states[seq.seq_id]
        self.num_waits += not state.has_waited
        state.has_waited = True
        return True

    def draft_budget(self, num_running: int) -> int:
        """Drafted tokens a step may carry with `num_running` sequences running."""
        if not self.is_on:
            return 0
        self._load = num_running
        return max(0, self.config.draft_token_budget - num_running)

    @property
    def _alone(self) -> bool:
        """Whether the step planned last drafts for one sequence alone (no batch to split)."""
        return self._load <= 1

    def _may_draft(self, seq: Sequence) -> bool:
        if not is_eligible(seq):
            return False
        state = self._states.get(seq.seq_id)
        return state is None or len(seq.output_token_ids) >= state.paused_until

    def propose(self, seq: Sequence, max_len: int) -> list[int]:
        """Up to `max_len` tokens guessed to follow `seq`'s tokens (none when it should not draft)."""
        if max_len <= 0 or not self.is_on or not self._may_draft(seq):
            return []
        draft = self._guess(seq, max_len)
        state = self._states[seq.seq_id]
        if not draft and state.has_waited:  # the token it waited for broke the guess
            self._learn(seq, state, 0)
        state.has_waited = False
        return draft

    def _state(self, seq: Sequence) -> DraftState:
        state = self._states.get(seq.seq_id)
        if state is None:
            method = self.config.method
            index = None if method == "mtp" else SuffixCounts() if method == "suffix" else LatestOccurrence()
            state = self._states[seq.seq_id] = DraftState(index, self.config.max_draft_tokens)
        return state

    def _guess(self, seq: Sequence, max_len: int) -> list[int]:
        state = self._state(seq)
        max_len = min(max_len, state.draft_len)
        if state.index is None:  # the worker's guess, if it was made after the sequence's last token
            return seq.worker_draft[:max_len] if seq.worker_draft_at == seq.num_tokens else []
        state.index.extend(seq.all_token_ids)
        if isinstance(state.index, SuffixCounts):
            assert self._global is not None
            return most_frequent_path(state.index.tokens, [state.index.own, self._global.counts], max_len)
        return state.index.propose(max_len)

    def on_verified(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        state = self._states.get(seq.seq_id)
        if state is None:
            return
        if self._alone:
            grown = self.config.max_draft_tokens
        else:
            grown = 2 * num_drafted if num_accepted == num_drafted else num_accepted + 1
        state.draft_len = max(1, min(self.config.max_draft_tokens, grown))
        self._learn(seq, state, num_accepted)

    def _learn(self, seq: Sequence, state: DraftState, num_accepted: int) -> None:
        state.gain = (1 - EMA_WEIGHT) * state.gain + EMA_WEIGHT * num_accepted
        if state.gain < (PAUSE_BELOW_ALONE if self._alone else PAUSE_BELOW):
            state.paused_until = len(seq.output_token_ids) + state.pause_tokens
            state.pause_tokens = min(MAX_PAUSE_TOKENS, state.pause_tokens * 2)
            state.gain = 1.0  # the probe after the pause starts afresh
        elif num_accepted > 0:
            state.pause_tokens = FIRST_PAUSE_TOKENS

    def on_finished(self, seq: Sequence) -> None:
        self._states.pop(seq.seq_id, None)
        if self._global is not None and seq.output_token_ids:
            self._global.add_output(seq.output_token_ids)
