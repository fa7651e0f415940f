"""Which sequences of a step the worker runs: the checks made before a step
changes anything (ModelRunner inherits them).

Two kinds of refusal (worker.proto, StepResponse.refused):
- A sequence the worker cannot serve, for what its request asks (sampling
  settings out of range or not finite, a grammar that does not compile, images
  that do not fit the model, a token id outside the vocabulary, a context
  longer than the model's, a draft it cannot verify), is refused alone
  (SequenceRefused): the step runs its batch-mates without it, and the worker
  keeps nothing of it. A step planned before the scheduler saw that answer may
  name it again: unknown here, it is refused alone again.
- A step that contradicts what the worker holds or can hold (a sequence twice,
  more sequences than max_batch_size, a block table that cannot hold its tokens
  or names blocks outside the pool, num_computed_tokens other than the
  worker's, feed_last_sampled with no token to feed) is the scheduler's bug: it
  is refused whole with INVALID_ARGUMENT, before any change.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from services.common.errors import invalid_argument
from services.worker import speculative
from services.worker.kv_cache import KVCachePool
from services.worker.sequence import Refusal, SequenceInput, SequenceRefused
from services.worker.vision import VisionLanguageDecoder, images_refusal

if TYPE_CHECKING:
    from services.worker.sequence_state import SequenceState

# The refusal of a sequence the worker does not hold and is not told how to start:
# in practice, one whose first step it refused, in the step planned after that one.
UNKNOWN_SEQUENCE = "the worker holds no state for this sequence (its first step was refused)"


class StepAdmission:
    """The checks of a step; `_check` changes nothing."""

    sequences: dict[int, SequenceState]
    vocab_size: int
    max_batch_size: int
    max_position_embeddings: int
    block_size: int
    kv_pool: KVCachePool
    decoder: object

    def _check(self, inputs: list[SequenceInput]) -> tuple[list[SequenceInput], list[Refusal]]:
        """The step's sequences to run (feed_last_sampled resolved), in order, and
        those refused alone; raises INVALID_ARGUMENT to refuse the whole step."""
        if len(inputs) > self.max_batch_size:
            raise invalid_argument(
                f"step has {len(inputs)} sequences; max_batch_size is {self.max_batch_size}"
            )
        admitted: list[SequenceInput] = []
        refused: list[Refusal] = []
        seen: set[int] = set()
        for s in inputs:
            if s.seq_id in seen:
                raise invalid_argument(f"seq {s.seq_id} appears twice in one step")
            seen.add(s.seq_id)
            try:
                admitted.append(self._check_sequence(s))
            except SequenceRefused as exc:
                refused.append(Refusal(s.seq_id, exc.message))
        return admitted, refused

    def _check_sequence(self, s: SequenceInput) -> SequenceInput:
        """`s` ready to run; SequenceRefused for what its request asks, INVALID_ARGUMENT
        (the whole step) for what contradicts the worker's state."""
        state = self.sequences.get(s.seq_id)
        if state is None:
            if s.refusal:
                raise SequenceRefused(s.refusal)
            if s.sampling is None or s.feed_last_sampled:
                raise SequenceRefused(UNKNOWN_SEQUENCE)
        elif s.feed_last_sampled:
            if s.token_ids or not s.sample or state.last_sampled is None:
                raise invalid_argument(
                    f"seq {s.seq_id}: feed_last_sampled needs empty token_ids, sample, and a token sampled "
                    "for the sequence in the step before"
                )
            # Built, not dataclasses.replace'd: that costs ~3 µs a sequence, every decode step.
            if s.extends_table:  # the worker's own table and tokens (StepRequest.decode_seq_ids)
                s = SequenceInput(s.seq_id, [state.last_sampled], state.num_cached_tokens, True,
                                  block_table=state.block_table + s.block_table if s.block_table else state.block_table)
            else:
                s = SequenceInput(s.seq_id, [state.last_sampled], s.num_computed_tokens, s.sample, s.sampling,
                                  s.block_table, s.num_prompt_tokens, images=s.images,
                                  num_draft_tokens=s.num_draft_tokens)
        if not s.token_ids:
            raise invalid_argument(f"seq {s.seq_id}: token_ids is empty")
        if state is None:
            if s.num_computed_tokens < 0 or s.num_prompt_tokens < 0:
                raise invalid_argument(f"seq {s.seq_id}: negative num_computed_tokens or num_prompt_tokens")
        elif s.num_computed_tokens != state.num_cached_tokens:
            raise invalid_argument(
                f"seq {s.seq_id}: num_computed_tokens {s.num_computed_tokens} but the worker "
                f"holds {state.num_cached_tokens} tokens"
            )
        context = s.num_computed_tokens + len(s.token_ids)
        self._validate_block_table(s, context)
        # From here on, what the request asks: the sequence alone is refused.
        if min(s.token_ids) < 0 or max(s.token_ids) >= self.vocab_size:
            bad = next(t for t in s.token_ids if not 0 <= t < self.vocab_size)
            raise SequenceRefused(f"token id {bad} is outside the model's vocabulary [0, {self.vocab_size})")
        if state is None:
            assert s.sampling is not None
            s.sampling.validate()
            speculative.validate_draft(s, s.sampling)
            if s.images:
                self._check_new_images(s)
        else:
            speculative.validate_draft(s, state.sampling)
            if state.images is not None:
                self._check_images_reached(state.images.images, state.images.embeddings, s)
        if self.max_position_embeddings and context > self.max_position_embeddings:
            raise SequenceRefused(
                f"the prompt and output reach {context} tokens, more than the model's context length "
                f"({self.max_position_embeddings})"
            )
        return s

    def _check_new_images(self, s: SequenceInput) -> None:
        if not isinstance(self.decoder, VisionLanguageDecoder):
            raise SequenceRefused("this model takes no images")
        reason = images_refusal(s.images)
        for image in s.images:
            reason = reason or self.decoder.image_refusal(image)
        if reason:
            raise SequenceRefused(reason)
        self._check_images_reached(s.images, (), s)

    def _check_images_reached(self, images, embedded, s: SequenceInput) -> None:
        assert isinstance(self.decoder, VisionLanguageDecoder)
        reason = self.decoder.step_refusal(images, embedded, s.token_ids, s.num_computed_tokens)
        if reason:
            raise SequenceRefused(reason)

    def _validate_copies(self, copies: Sequence[tuple[int, int]]) -> None:
        num_blocks = self.kv_pool.num_blocks
        if any(not (0 <= b < num_blocks) for pair in copies for b in pair):
            raise invalid_argument(f"block copy: block id outside [0, {num_blocks})")
        if len({dst for _, dst in copies}) != len(copies):
            raise invalid_argument("block copy: a destination block appears twice")

    def _validate_block_table(self, s: SequenceInput, context: int) -> None:
        # Out-of-range ids would index past the pool; a short table would map
        # positions onto padding. Both are scheduler bugs: refuse the step.
        if len(s.block_table) * self.block_size < context:
            raise invalid_argument(
                f"seq {s.seq_id}: block table of {len(s.block_table)} blocks x {self.block_size} "
                f"tokens cannot hold {context} tokens"
            )
        if s.block_table and (min(s.block_table) < 0 or max(s.block_table) >= self.kv_pool.num_blocks):
            raise invalid_argument(f"seq {s.seq_id}: block id outside [0, {self.kv_pool.num_blocks})")
