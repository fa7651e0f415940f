"""Batched sampling: greedy, filters, per-sequence seeds, logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from services.worker.penalties import apply_penalties
from services.worker.sampler import HEAD_CANDIDATES, MIN_LOGPROB, NUCLEUS_CANDIDATES, argmax_rows, sample
from services.worker.sequence import SamplingParams

VOCAB = 1000


def _logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    # Scaled so the distributions are neither flat nor one-hot.
    return torch.randn((num_rows, VOCAB), generator=torch.Generator().manual_seed(seed)) * 3


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _draws(logits_row: torch.Tensor, params: SamplingParams, num_draws: int) -> list[int]:
    generator = _generator(params.seed)
    return [sample(logits_row[None], [params], [generator]).token_ids[0] for _ in range(num_draws)]


def test_temperature_zero_is_argmax():
    logits = _logits(6)
    params = [SamplingParams(temperature=0.0)] * 6
    out = sample(logits, params, [None] * 6)
    assert out.token_ids == logits.argmax(dim=1).tolist()
    assert out.logprobs == [None] * 6


def test_top_k_one_and_tiny_top_p_are_argmax_even_when_hot():
    logits = _logits(8, seed=1)
    params = [SamplingParams(temperature=5.0, top_k=1, seed=i) for i in range(4)]
    params += [SamplingParams(temperature=5.0, top_p=1e-6, seed=i) for i in range(4)]
    out = sample(logits, params, [_generator(p.seed) for p in params])
    assert out.token_ids == logits.argmax(dim=1).tolist()


def test_top_k_keeps_only_the_k_best():
    logits = _logits(1, seed=2)
    allowed = set(torch.topk(logits[0], 5).indices.tolist())
    draws = _draws(logits[0], SamplingParams(temperature=10.0, top_k=5, seed=3), 200)
    assert set(draws) <= allowed
    assert len(set(draws)) > 1  # at temperature 10 it does not collapse to the argmax


def test_top_p_keeps_the_nucleus():
    logits = torch.full((1, VOCAB), -20.0)
    logits[0, :4] = torch.tensor([3.0, 2.5, 2.0, -1.0])  # the first three hold > 95% of the mass
    draws = _draws(logits[0], SamplingParams(temperature=1.0, top_p=0.9, seed=4), 300)
    assert set(draws) == {0, 1, 2}


def test_same_seed_same_tokens_alone_or_in_any_batch():
    logits = _logits(4, seed=5)
    target = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=1234)
    alone = _draws(logits[2], target, 20)

    others = [
        SamplingParams(temperature=0.7, seed=9),
        SamplingParams(temperature=0.0),
        target,
        SamplingParams(temperature=1.3, top_p=0.5, seed=77),
    ]
    generators = [_generator(p.seed) if p.temperature else None for p in others]
    batched = [sample(logits, others, generators).token_ids[2] for _ in range(20)]
    assert batched == alone
    assert len(set(alone)) > 1  # the test would be vacuous if the row were near-greedy


def test_different_seeds_differ():
    logits = _logits(1, seed=6)
    first = _draws(logits[0], SamplingParams(temperature=1.0, seed=1), 20)
    second = _draws(logits[0], SamplingParams(temperature=1.0, seed=2), 20)
    assert first != second


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1] + [0.0] * (VOCAB - 3)]))
    draws = _draws(logits[0], SamplingParams(temperature=1.0, seed=7), 2000)
    share = [draws.count(t) / len(draws) for t in range(3)]
    assert abs(share[0] - 0.6) < 0.05 and abs(share[1] - 0.3) < 0.05 and abs(share[2] - 0.1) < 0.03
    assert set(draws) <= {0, 1, 2}


def _model_like_logits(vocab: int, seed: int) -> torch.Tensor:
    """A few likely tokens scattered through a long tail, like a language model's."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, generator=generator) * 2
    logits[torch.randperm(vocab, generator=generator)[:8]] += 7
    return logits


def test_sampling_reaches_the_tail_in_proportion():
    """Beyond the head's best tokens the draw is a race; the shares stay exact."""
    vocab = 4096
    logits = _model_like_logits(vocab, seed=13)
    probs = logits.softmax(0)
    head = set(torch.topk(probs, HEAD_CANDIDATES).indices.tolist())
    tail_mass = 1 - probs[list(head)].sum().item()
    assert 0.2 < tail_mass < 0.8  # both ways of drawing get exercised
    draws = _draws(logits, SamplingParams(temperature=1.0, seed=14), 3000)
    tail_share = sum(t not in head for t in draws) / len(draws)
    assert abs(tail_share - tail_mass) < 4 * math.sqrt(tail_mass * (1 - tail_mass) / len(draws))
    best = int(probs.argmax())
    assert abs(draws.count(best) / len(draws) - probs[best].item()) < 0.03
    assert len({t for t in draws if t not in head}) > 100  # the race spreads over the tail


def test_a_rounding_change_in_the_logits_does_not_change_seeded_draws():
    """Another batch size can change logits in their last bits (another matmul
    kernel); a seeded draw must not move with them. A CDF in vocabulary order moves
    tens of these 1000 draws."""
    vocab = 49152
    logits = _model_like_logits(vocab, seed=15)[None]
    nudged = logits * (1 + 1e-6 * torch.randn(logits.shape, generator=torch.Generator().manual_seed(16)))
    params = SamplingParams(temperature=1.0)
    for seed in range(1000):
        first = sample(logits, [params], [_generator(seed)]).token_ids
        assert sample(nudged, [params], [_generator(seed)]).token_ids == first, seed


def test_logprobs_describe_the_sampled_distribution():
    logits = _logits(3, seed=8)
    params = [
        SamplingParams(temperature=0.0, top_logprobs=5),
        SamplingParams(temperature=0.5, top_k=3, seed=1, top_logprobs=4),
        SamplingParams(temperature=1.0, seed=2, top_logprobs=0),
    ]
    out = sample(logits, params, [None, _generator(1), _generator(2)])
    for row, p in enumerate(params):
        logprob = out.logprobs[row]
        assert logprob is not None and logprob <= 0
        assert len(out.top_logprobs[row]) == p.top_logprobs
        values = [alt.logprob for alt in out.top_logprobs[row]]
        assert values == sorted(values, reverse=True)
        assert all(MIN_LOGPROB <= v <= 0 for v in values)
    # Greedy: the chosen token is the best alternative, with the model's own logprob.
    assert out.top_logprobs[0][0].token_id == out.token_ids[0]
    assert math.isclose(out.logprobs[0], logits[0].log_softmax(0).max().item(), rel_tol=1e-5)
    # Top-k 3 at temperature 0.5: three alternatives share all the mass, the 4th has none.
    kept = [math.exp(alt.logprob) for alt in out.top_logprobs[1][:3]]
    assert math.isclose(sum(kept), 1.0, rel_tol=1e-4)
    assert out.top_logprobs[1][3].logprob == MIN_LOGPROB
    expected = (logits[1] / 0.5).topk(3).values.log_softmax(0)
    assert torch.allclose(torch.tensor([alt.logprob for alt in out.top_logprobs[1][:3]]), expected, atol=1e-5)


def test_penalties_push_seen_tokens_down_only_where_asked():
    logits = torch.zeros((2, 10))
    logits[:, 3] = 2.0
    logits[:, 4] = -2.0
    params = [
        SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(),
    ]
    out = apply_penalties(logits, params, [[4], [3, 4]], [[3, 3], [3]])
    # Row 0: token 3 generated twice: 2/2 - 0.5 - 2*0.25; token 4 in prompt: -2*2.
    assert out[0, 3].item() == 1.0 - 0.5 - 0.5
    assert out[0, 4].item() == -4.0
    assert out[0, 5].item() == 0.0
    assert torch.equal(out[1], logits[1])


def test_wide_nucleus_falls_back_to_a_full_sort():
    """A flat distribution's nucleus is wider than the candidate shortcut: still exact."""
    vocab = 5000
    logits = -torch.arange(vocab, dtype=torch.float32)[None] * 1e-4  # token i is the i-th best
    probs = logits[0].softmax(0)
    nucleus = int(((probs.cumsum(0) - probs) < 0.5).sum())  # tokens whose preceding mass < top_p
    assert nucleus > NUCLEUS_CANDIDATES
    draws = _draws(logits[0], SamplingParams(temperature=1.0, top_p=0.5, seed=11), 300)
    assert max(draws) < nucleus
    assert max(draws) > NUCLEUS_CANDIDATES


def test_rows_widened_for_a_flat_nucleus_do_not_disturb_the_others():
    vocab = 5000
    flat = -torch.arange(vocab, dtype=torch.float32) * 1e-4
    peaked = torch.randn(vocab, generator=torch.Generator().manual_seed(12)) * 4
    params = [
        SamplingParams(temperature=1.0, top_p=0.5, seed=21, top_logprobs=3),
        SamplingParams(temperature=1.0, top_p=0.9, seed=22, top_logprobs=3),
    ]
    generators = [_generator(21), _generator(22)]
    batched = [sample(torch.stack([flat, peaked]), params, generators) for _ in range(30)]
    for row, logits_row in enumerate((flat, peaked)):
        alone_generator = _generator(params[row].seed)
        alone = [sample(logits_row[None], [params[row]], [alone_generator]) for _ in range(30)]
        assert [b.token_ids[row] for b in batched] == [a.token_ids[0] for a in alone]
        assert [b.top_logprobs[row] for b in batched] == [a.top_logprobs[0] for a in alone]


@pytest.mark.parametrize("width", [7, 1024, 49152, 151936])
def test_argmax_rows_is_the_first_maximum_of_each_row(width):
    x = torch.randn(6, width)
    x[1, width - 1] = 50.0  # in the padded last block
    x[2, :] = 0.0  # every column ties: the first
    x[3, [3, width // 2, width - 2]] = 40.0  # ties across blocks: the first
    x[4, 0] = float("inf")
    torch.testing.assert_close(argmax_rows(x), x.argmax(dim=1))
    torch.testing.assert_close(argmax_rows(x.bfloat16()), x.bfloat16().argmax(dim=1))
