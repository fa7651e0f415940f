"""Batched sampling on the device: one [B, vocab] logits tensor, per-row params.

Pipeline per row: (penalties, applied by the caller via penalties.py) ->
temperature -> top-k -> top-p -> draw. A row with temperature 0 is greedy: the
argmax, with the filters applied at temperature 1 so that its logprobs describe
the same filtered distribution.

Reproducibility: each sequence owns a torch.Generator seeded once. Drawing a
token consumes exactly one [vocab] vector of Exp(1) noise from that row's own
generator, and the token is argmax(logits - log(noise)) (the exponential race,
i.e. the Gumbel-max trick). So a seed gives the same tokens whatever else shares
the batch, and no softmax-normalised multinomial is needed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.sequence import SamplingParams, TokenLogprob

# Logprob reported for tokens the filters removed (-inf does not survive JSON);
# OpenAI reports the same value for such tokens.
MIN_LOGPROB = -9999.0


@dataclass(frozen=True)
class SampleOutput:
    """Per row: the token, and its logprob / alternatives when the row asked."""

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[TokenLogprob]]


def _apply_top_k(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    vocab_size = logits.shape[1]
    ks = [k if 0 < k < vocab_size else 0 for k in top_ks]
    if not any(ks):
        return logits
    # One top-k over the largest k; each row's threshold is its own k-th value.
    values = torch.topk(logits, max(ks), dim=1).values
    k_index = torch.tensor([max(k, 1) - 1 for k in ks], device=logits.device)
    thresholds = values.gather(1, k_index[:, None])
    enabled = torch.tensor([k > 0 for k in ks], device=logits.device)[:, None]
    return logits.masked_fill(enabled & (logits < thresholds), float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    rows = [i for i, p in enumerate(top_ps) if p < 1.0]
    if not rows:
        return logits
    # Only rows that use nucleus sampling pay for a full-vocab sort.
    sub = logits[rows]
    sorted_logits, order = torch.sort(sub, dim=1, descending=True)
    probs = sorted_logits.softmax(dim=1)
    mass_before = probs.cumsum(dim=1) - probs
    top_p = torch.tensor([top_ps[i] for i in rows], device=logits.device)[:, None]
    # Drop a token once the mass before it already reaches top_p: the best token always stays.
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))
    logits = logits.clone()
    logits[rows] = torch.empty_like(sub).scatter_(1, order, sorted_logits)
    return logits


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> SampleOutput:
    """Sample one token per row. `generators[i]` may be None only for greedy rows."""
    num_rows, vocab_size = logits.shape
    device = logits.device
    logits = logits.float()
    temperatures = torch.tensor(
        [p.temperature if not p.is_greedy else 1.0 for p in params], device=device
    )
    logits = logits / temperatures[:, None]
    logits = _apply_top_k(logits, [p.top_k for p in params])
    logits = _apply_top_p(logits, [p.top_p for p in params])

    token_ids = logits.argmax(dim=1)
    random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if random_rows:
        noise = torch.empty((len(random_rows), vocab_size), device=device)
        for n, row in enumerate(random_rows):
            noise[n].exponential_(generator=generators[row])
        raced = logits[random_rows] - noise.log()
        token_ids[random_rows] = raced.argmax(dim=1)

    logprobs: list[float | None] = [None] * num_rows
    alternatives: list[list[TokenLogprob]] = [[] for _ in range(num_rows)]
    logprob_rows = [i for i, p in enumerate(params) if p.top_logprobs >= 0]
    if logprob_rows:
        log_dist = logits[logprob_rows].log_softmax(dim=1).clamp(min=MIN_LOGPROB)
        chosen = log_dist.gather(1, token_ids[logprob_rows][:, None])[:, 0].tolist()
        num_alternatives = max(params[i].top_logprobs for i in logprob_rows)
        top_values, top_ids = (None, None)
        if num_alternatives > 0:
            top = torch.topk(log_dist, min(num_alternatives, vocab_size), dim=1)
            top_values, top_ids = top.values.tolist(), top.indices.tolist()
        for n, row in enumerate(logprob_rows):
            logprobs[row] = chosen[n]
            wanted = params[row].top_logprobs
            if top_values is not None and wanted > 0:
                alternatives[row] = [
                    TokenLogprob(t, v) for t, v in zip(top_ids[n][:wanted], top_values[n][:wanted])
                ]
    return SampleOutput(token_ids.tolist(), logprobs, alternatives)
