"""Repetition, presence and frequency penalties, batched on the device.

Semantics follow vLLM / OpenAI: presence and frequency penalties count the
tokens this sequence has generated; the repetition penalty (the CTRL / HF one)
covers prompt and generated tokens, dividing positive logits and multiplying
negative ones. Only rows that ask for a penalty are touched.
"""
from __future__ import annotations

import torch

from services.worker.sequence import SamplingParams


def _token_counts(histories: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[R, vocab] counts of each token in each history, in one scatter_add."""
    longest = max((len(h) for h in histories), default=0)
    # Padding points at an extra column that is dropped afterwards.
    index = torch.full((len(histories), max(longest, 1)), vocab_size, dtype=torch.long)
    for row, history in enumerate(histories):
        if history:
            index[row, : len(history)] = torch.tensor(history, dtype=torch.long)
    index = index.to(device)
    counts = torch.zeros((len(histories), vocab_size + 1), dtype=torch.float32, device=device)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompt_histories: list[list[int]],
    output_histories: list[list[int]],
) -> torch.Tensor:
    """Return `logits` [B, vocab] (float32) with each row's penalties applied."""
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return logits
    device = logits.device
    vocab_size = logits.shape[1]
    sub = logits[rows]
    selected = [params[i] for i in rows]
    output_counts = _token_counts([output_histories[i] for i in rows], vocab_size, device)

    repetition = torch.tensor([p.repetition_penalty for p in selected], device=device)[:, None]
    if any(p.repetition_penalty != 1.0 for p in selected):
        prompt_counts = _token_counts([prompt_histories[i] for i in rows], vocab_size, device)
        seen = (prompt_counts + output_counts) > 0
        penalized = torch.where(sub > 0, sub / repetition, sub * repetition)
        sub = torch.where(seen, penalized, sub)
    frequency = torch.tensor([p.frequency_penalty for p in selected], device=device)[:, None]
    presence = torch.tensor([p.presence_penalty for p in selected], device=device)[:, None]
    sub = sub - frequency * output_counts - presence * (output_counts > 0).float()

    logits = logits.clone()
    logits[rows] = sub
    return logits
