"""Verifying a draft (speculative decoding): which drafted tokens a sequence keeps.

A drafting sequence feeds its last token and k drafted tokens in one forward,
and gets logits at each of those k + 1 positions. The worker samples a token at
every position exactly as it would one step at a time — the same filters, and
the same one uniform number per output token from the sequence's generator, in
order — and keeps the drafts up to the first whose position sampled another
token; that sampled token (or the one after the last draft, when all are kept)
comes after them.

That is the rejection rule for a deterministic draft: draft token d is kept
with probability p(d) (the sample is d), and on a rejection the token is drawn
from p with d removed and renormalised (the sample given that it is not d). So
the output keeps the target distribution; and since sample i takes the number
that the i-th output token takes without speculation, a greedy sequence gets
exactly its tokens and a seeded one exactly its text. The numbers drawn for
positions after the first rejection are given back (the generator is rewound),
so the next step's draws line up again.

Logprobs, penalties and grammars are refused with a draft: each would need its
per-token state rolled back on a rejection; the scheduler does not draft for them.
"""
from __future__ import annotations

import torch

from services.worker import sampler
from services.worker.sequence import SamplingParams, SequenceInput, SequenceRefused


def validate_draft(s: SequenceInput, sampling: SamplingParams) -> None:
    """SequenceRefused for a draft the worker cannot verify: the sequence alone is left out."""
    if not s.num_draft_tokens:
        return
    if s.num_draft_tokens < 0 or s.num_draft_tokens >= len(s.token_ids) or not s.sample or s.feed_last_sampled:
        raise SequenceRefused("a draft needs sampling, explicit token ids and at least one token before it")
    if not can_draft(sampling):
        raise SequenceRefused("no draft with logprobs, penalties or a grammar")


def can_draft(sampling: SamplingParams) -> bool:
    """Whether a draft can be verified for a sequence of these settings."""
    return sampling.top_logprobs < 0 and not sampling.has_penalties and sampling.grammar is None


def num_rows(s: SequenceInput) -> int:
    """Logit rows a sampling input needs: its last token's and one per drafted token."""
    return 1 + s.num_draft_tokens


def num_accepted(draft: list[int], sampled: list[int]) -> int:
    """Drafts kept: those before the first position whose sample differs."""
    kept = 0
    while kept < len(draft) and sampled[kept] == draft[kept]:
        kept += 1
    return kept


def rewind(generator: torch.Generator | None, state: torch.Tensor | None, num_draws: int) -> None:
    """Put `generator` back at `state` and take the `num_draws` numbers the kept tokens used."""
    if generator is None or state is None:
        return
    generator.set_state(state)
    for _ in range(num_draws):
        sampler.draw_uniform(generator)
