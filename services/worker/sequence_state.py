"""What a worker keeps about each live sequence between steps, and how a step
samples from it (ModelRunner inherits this): the seeded generator (past the
draws of outputs recomputed after a preemption), penalty history, the grammar
state (replayed over recomputed outputs), and a draft's verification.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from services.worker import sampler, speculative
from services.worker.guided import GrammarError, GuidedDecoding
from services.worker.penalties import apply_penalties
from services.worker.sequence import SampledToken, SamplingParams, SequenceInput, SequenceRefused
from services.worker.vision import SequenceImages

log = logging.getLogger(__name__)


@dataclass
class SequenceState:
    """What the worker keeps about a live sequence between steps."""

    sampling: SamplingParams
    generator: torch.Generator | None  # None for greedy sequences
    num_cached_tokens: int = 0
    # Tokens before this position are prompt; None until known (the first sample
    # fixes it when the scheduler did not say). Tokens after it are outputs.
    num_prompt_tokens: int | None = None
    # Outputs drawn from `generator` so far: a sequence recomputed after a
    # preemption skips the draws of its earlier outputs, so a seed gives the same text.
    num_draws: int = 0
    # Token history, kept only for sequences with penalties.
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    # Constrained decoding: the grammar state and how many outputs it has consumed.
    matcher: object | None = None
    num_grammar_tokens: int = 0
    # The token sampled last, until the sequence is next fed: a step that feeds
    # it without knowing it (feed_last_sampled) takes it from here.
    last_sampled: int | None = None
    # A vision-language model's images of the sequence; None without.
    images: SequenceImages | None = None
    # The block table of its last step, which a decode of StepRequest.decode_seq_ids extends.
    block_table: list[int] = field(default_factory=list)


class SequenceSampling:
    """Each sequence's state and the step's sampling over it."""

    sequences: dict[int, SequenceState]
    model_dir: Path
    vocab_size: int
    _guided: GuidedDecoding | None
    describe: Callable[[], Any]  # its eos_token_ids end a grammar's output

    def _new_state(self, s: SequenceInput) -> SequenceState:
        sampling = s.sampling
        assert sampling is not None  # checked by _check
        generator = None
        if not sampling.is_greedy:
            # Seeded once: the sequence's draws depend on its seed alone, not on the batch.
            generator = torch.Generator()  # CPU: the sampler draws one scalar per token
            generator.manual_seed(sampling.seed)
        state = SequenceState(sampling=sampling, generator=generator, num_prompt_tokens=s.num_prompt_tokens or None,
                              images=SequenceImages(list(s.images)) if s.images else None)
        if sampling.grammar is not None:
            guided = self.guided
            try:
                state.matcher = guided.compile(sampling.grammar)
            except GrammarError as exc:
                raise SequenceRefused(str(exc)) from exc
            except ValueError as exc:  # llguidance's own, e.g. a schema that is not an object
                raise SequenceRefused(f"cannot compile the grammar: {exc}") from exc
            except Exception as exc:  # noqa: BLE001 - the request's grammar, not the worker, is at fault
                log.exception("seq %d: compiling its grammar failed", s.seq_id)
                raise SequenceRefused("cannot compile the grammar") from exc
        return state

    @property
    def guided(self) -> GuidedDecoding:
        if self._guided is None:
            tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            self._guided = GuidedDecoding(tokenizer, self.vocab_size, self.describe().eos_token_ids)
        return self._guided

    def _replay_grammar(self, state: SequenceState, s: SequenceInput) -> None:
        # Outputs fed back after a preemption re-enter the grammar; the last sample
        # coming back as the next input was consumed when it was sampled.
        num_prompt = state.num_prompt_tokens or s.num_prompt_tokens
        if not num_prompt:
            return
        for position, token in enumerate(s.token_ids, start=s.num_computed_tokens):
            if position - num_prompt == state.num_grammar_tokens:
                self.guided.advance(state.matcher, token)
                state.num_grammar_tokens += 1

    def _record_fed_tokens(self, state: SequenceState, s: SequenceInput) -> None:
        # A fed token at a position the worker already sampled is that sample coming back;
        # tokens past the prompt fed on a first step are outputs being recomputed.
        known = len(state.prompt_token_ids) + len(state.output_token_ids)
        for position, token in enumerate(s.token_ids, start=s.num_computed_tokens):
            if position < known:
                continue
            if state.num_prompt_tokens is None or position < state.num_prompt_tokens:
                state.prompt_token_ids.append(token)
            else:
                state.output_token_ids.append(token)

    def _sample(self, logits: torch.Tensor, inputs: list[SequenceInput]) -> list[SampledToken]:
        """One token per input, from its logit rows (several for a draft: speculative.py)."""
        for s in inputs:
            self._skip_recomputed_draws(self.sequences[s.seq_id])
        # Row order: each input's rows in turn; a drafting sequence's generator is
        # listed once per row, so its numbers are drawn in position order.
        states = [self.sequences[s.seq_id] for s in inputs for _ in range(speculative.num_rows(s))]
        rewind_to = {s.seq_id: self.sequences[s.seq_id].generator.get_state() for s in inputs
                     if s.num_draft_tokens and self.sequences[s.seq_id].generator is not None}
        params = [st.sampling for st in states]
        if any(p.has_penalties for p in params):
            logits = apply_penalties(
                logits.float(),
                params,
                [st.prompt_token_ids for st in states],
                [st.output_token_ids for st in states],
            )
        matchers = [st.matcher for st in states]
        if any(m is not None for m in matchers):
            self.guided.mask_logits(logits, matchers)
        out = sampler.sample(logits, params, [st.generator for st in states])
        tokens, row = [], 0
        for s in inputs:
            state = self.sequences[s.seq_id]
            kept = speculative.num_accepted(s.token_ids[len(s.token_ids) - s.num_draft_tokens:],
                                            out.token_ids[row:row + s.num_draft_tokens])
            if s.num_draft_tokens:
                speculative.rewind(state.generator, rewind_to.get(s.seq_id), kept + 1)
                state.num_cached_tokens += kept
                state.num_draws += kept
            i = row + kept
            row += speculative.num_rows(s)
            if state.sampling.has_penalties:
                state.output_token_ids.append(out.token_ids[i])
            if state.matcher is not None:
                self.guided.advance(state.matcher, out.token_ids[i])
                state.num_grammar_tokens += 1
            state.last_sampled = out.token_ids[i]
            tokens.append(SampledToken(s.seq_id, out.token_ids[i], out.logprobs[i], out.top_logprobs[i], kept))
        return tokens

    @staticmethod
    def _skip_recomputed_draws(state: SequenceState) -> None:
        """Advance the generator past outputs sampled before a preemption (the
        sampler takes one number per token of a non-greedy sequence)."""
        if state.num_prompt_tokens is None:
            state.num_prompt_tokens = state.num_cached_tokens
        num_outputs_before = state.num_cached_tokens - state.num_prompt_tokens
        if state.generator is not None:
            for _ in range(num_outputs_before - state.num_draws):
                sampler.draw_uniform(state.generator)
        state.num_draws = num_outputs_before + 1
