"""Verifying drafts on the real model: the tokens are those of plain decoding
(greedy, and seeded sampling), rejected drafts leave nothing behind, and the
kept-or-resampled token follows the target distribution."""
from __future__ import annotations

import dataclasses
import math

import pytest

from services.worker.model_runner import ModelRunner
from services.worker.sequence import SampledToken, SamplingParams
from tests.unit.worker.block_tables import BlockTables

PROMPT = [504, 3458, 282, 4649, 314, 3575, 30, 378, 3458, 282, 4649, 314]  # ordinary text tokens


def plain_decode(runner: ModelRunner, tables: BlockTables, seq_id: int, sampling: SamplingParams,
                 num_tokens: int) -> list[SampledToken]:
    """PROMPT decoded one token a step: each step's sampled token (logprobs as `sampling` asks)."""
    outputs: list[SampledToken] = []
    feed, computed = list(PROMPT), 0
    for _ in range(num_tokens):
        token = runner.step([tables.feed(seq_id, feed, computed, True, sampling if computed == 0 else None)]).tokens[0]
        computed += len(feed)
        outputs.append(token)
        feed = [token.token_id]
    runner.release(seq_id)
    tables.release(seq_id)
    return outputs


def draft_decode(runner: ModelRunner, tables: BlockTables, seq_id: int, sampling: SamplingParams,
                 num_tokens: int, guess) -> tuple[list[int], list[int]]:
    """Decode with a draft from `guess(outputs so far)` on every step; returns the
    outputs and the number of drafts kept per step."""
    outputs: list[int] = []
    kept_per_step = []
    feed, computed = list(PROMPT), 0
    while len(outputs) < num_tokens:
        draft = guess(outputs)
        s = tables.feed(seq_id, feed + draft, computed, True, sampling if computed == 0 else None)
        token = runner.step([dataclasses.replace(s, num_draft_tokens=len(draft))]).tokens[0]
        kept = token.num_accepted_draft_tokens
        kept_per_step.append(kept)
        computed += len(feed) + kept
        outputs += draft[:kept] + [token.token_id]
        assert runner.sequences[seq_id].num_cached_tokens == computed
        feed = [token.token_id]
    runner.release(seq_id)
    tables.release(seq_id)
    return outputs[:num_tokens], kept_per_step


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=7),
                                      SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=3)])
def test_drafted_decoding_gives_the_tokens_of_plain_decoding(runner, tables, sampling):
    expected = [token.token_id for token in plain_decode(runner, tables, 1, sampling, 24)]

    def guess(outputs):  # right for three tokens, then wrong: partly kept drafts
        n = len(outputs)
        return expected[n:n + 3] + [(t + 1) % 49152 for t in expected[n + 3:n + 5]]

    got, kept = draft_decode(runner, tables, 2, sampling, 24, guess)
    assert got == expected
    assert 3 in kept
    # Fully kept drafts (a bonus token after them), and wholly wrong ones.
    got, kept = draft_decode(runner, tables, 3, sampling, 24, lambda o: expected[len(o):len(o) + 4])
    assert got == expected and 4 in kept
    got, kept = draft_decode(runner, tables, 4, sampling, 24, lambda o: [(expected[len(o)] + 1) % 49152] * 2)
    assert got == expected and set(kept) == {0}


def test_a_draft_with_logprobs_or_penalties_is_refused(runner, tables):
    for sampling in (SamplingParams(temperature=0.0, top_logprobs=0), SamplingParams(repetition_penalty=1.2)):
        s = tables.feed(9, PROMPT + [5, 6], 0, True, sampling)
        result = runner.step([dataclasses.replace(s, num_draft_tokens=2)])
        assert result.tokens == [] and [r.seq_id for r in result.refused] == [9]
        assert "no draft" in result.refused[0].message
        assert 9 not in runner.sequences
    tables.release(9)


def test_kept_or_resampled_token_follows_the_target_distribution(runner, tables):
    """For many seeds, one step feeding the prompt and a draft of two tokens: the
    token at the first drafted position (the draft when kept, else the resampled
    one) must be distributed as the target p, and the draft kept with p(draft)."""
    sampling = SamplingParams(temperature=1.0, top_k=4)
    prompt = PROMPT[:3]  # short: 480 one-step sequences
    probe = runner.step([tables.feed(50, prompt, 0, True, dataclasses.replace(sampling, top_logprobs=4))]).tokens[0]
    runner.release(50)
    tables.release(50)
    target = {alt.token_id: math.exp(alt.logprob) for alt in probe.top_logprobs}
    draft_token = sorted(target, key=target.get)[-2]  # the second most likely: kept sometimes, not always
    draft = [draft_token, 17]
    num_samples, batch = 480, 16
    counts: dict[int, int] = {}
    num_kept = 0
    for first in range(0, num_samples, batch):
        inputs = []
        for seq_id in range(100 + first, 100 + first + batch):
            s = tables.feed(seq_id, prompt + draft, 0, True, dataclasses.replace(sampling, seed=seq_id))
            inputs.append(dataclasses.replace(s, num_draft_tokens=2))
        for token in runner.step(inputs).tokens:
            first_token = draft[0] if token.num_accepted_draft_tokens else token.token_id
            counts[first_token] = counts.get(first_token, 0) + 1
            num_kept += token.num_accepted_draft_tokens > 0
            runner.release(token.seq_id)
            tables.release(token.seq_id)
    assert set(counts) <= set(target)
    for token, p in target.items():
        sigma = math.sqrt(p * (1 - p) / num_samples)
        assert abs(counts.get(token, 0) / num_samples - p) < 4.5 * sigma + 1e-3, (token, counts, target)
    p_draft = target[draft_token]
    assert abs(num_kept / num_samples - p_draft) < 4.5 * math.sqrt(p_draft * (1 - p_draft) / num_samples)
