"""Batched sampling on the device: one [B, vocab] logits tensor, per-row params.

Pipeline per row: (penalties, applied by the caller via penalties.py) ->
temperature -> top-k -> top-p -> draw. A row with temperature 0 is greedy: it
takes the best token, and its filters apply at temperature 1 so that its
logprobs describe the same distribution.

Reproducibility: each sequence owns a CPU torch.Generator seeded once, and a
draw takes one uniform number from it; the token is where that number falls in
the CDF of the row's candidates, best first (inverse-CDF sampling). So a seed
gives the same tokens whatever else shares the batch (and on any device: the
generator is on the CPU, one [B] tensor is copied over). One scalar per row is
also far cheaper than a vocab-wide noise vector per row on CPU (~1 ms per row).

Best first matters: another batch size can change the logits in their last bits
(a different matmul kernel), and a CDF in vocabulary order interleaves the
likely tokens with thousands of unlikely ones whose boundaries those bits move,
so a draw would change token every few dozen steps. Best first, the boundaries
that move are few and far apart. A row over the whole vocabulary takes its
number through the CDF of its HEAD_CANDIDATES best tokens; only when the number
falls beyond them (in the long tail) does it draw the tail token by an
exponential race (argmax p / E, E ~ Exp(1) seeded from that number), which tiny
changes in p do not move either.

Top-k / top-p only look at each row's best candidates (one batched topk), not a
full-vocab sort (a 49k-entry sort costs ~8 ms per row on CPU); a top-p row
whose nucleus is wider than its candidates (a flat distribution) is redone
alone with 8x more, up to the whole vocabulary.

On an accelerator, where a vocabulary-wide sort is cheap and every host sync
stalls the device's queue, there are no such second passes: every random row
draws from its whole vocabulary sorted best first (the head's CDF, then the
tail's, rather than the exponential race), and top-p rows start from all
their tokens. The step's results then come back in one copy to pinned host
memory, the one sync of sampling.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.worker.sequence import SamplingParams, TokenLogprob

# Logprob reported for tokens the filters removed (-inf does not survive JSON);
# OpenAI reports the same value for such tokens.
MIN_LOGPROB = -9999.0
# First candidate count for a top-p row without top-k; grown 8x while too small.
NUCLEUS_CANDIDATES = 1024
# Best tokens of a full-vocabulary row whose CDF the uniform number goes through.
HEAD_CANDIDATES = 64
# Width of the blocks argmax_rows reduces first.
ARGMAX_BLOCK = 1024


@dataclass(frozen=True)
class SampleOutput:
    """Per row: the token, and its logprob / alternatives when the row asked."""

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[TokenLogprob]]


@dataclass(frozen=True)
class _Distribution:
    """Rows of normalised log-probs over candidates; `ids` None means the whole vocab
    (column = token id), else the candidates sorted best first."""

    logprobs: torch.Tensor  # [R, K]
    ids: torch.Tensor | None  # [R, K]


def _filtered(scaled: torch.Tensor, params: list[SamplingParams]) -> _Distribution:
    """Top-k then top-p over each row's best candidates (all of them on an accelerator)."""
    vocab_size = scaled.shape[1]
    if scaled.device.type != "cpu":
        return _filtered_top(scaled, params, vocab_size)
    wants = [p.top_k if 0 < p.top_k < vocab_size else NUCLEUS_CANDIDATES for p in params]
    wants.append(max(p.top_logprobs for p in params))  # alternatives come from the candidates
    return _filtered_top(scaled, params, min(vocab_size, max(wants)))


def _filtered_top(scaled: torch.Tensor, params: list[SamplingParams], num_candidates: int) -> _Distribution:
    device = scaled.device
    vocab_size = scaled.shape[1]
    has_k = torch.tensor([0 < p.top_k < vocab_size for p in params], device=device)
    values, ids = torch.topk(scaled, num_candidates, dim=1)  # sorted, best first
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params], device=device)
    beyond_k = torch.arange(num_candidates, device=device)[None, :] >= top_k[:, None]
    values = values.masked_fill(beyond_k, float("-inf"))
    # A top-k row's candidates hold its whole distribution; any other row is
    # normalised over the full vocab, since its candidates are only the head.
    normaliser = torch.where(has_k, values.logsumexp(dim=1), scaled.logsumexp(dim=1))
    logprobs = values - normaliser[:, None]
    # top_p 2.0 = disabled: the mass before a token never reaches it.
    top_p = torch.tensor([p.top_p if p.top_p < 1.0 else 2.0 for p in params], device=device)
    probs = logprobs.exp()
    mass_before = probs.cumsum(dim=1) - probs
    # Drop a token once the mass before it reaches top_p: the best token always stays.
    logprobs = logprobs.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    dist = _Distribution(logprobs.log_softmax(dim=1), ids)
    if num_candidates == vocab_size:
        return dist
    # A nucleus wider than the candidates (a flat distribution): redo those rows with 8x more.
    short = ((~has_k) & (probs.sum(dim=1) < top_p)).nonzero().flatten().tolist()
    if not short:
        return dist
    wider = _filtered_top(scaled[short], [params[i] for i in short], min(vocab_size, num_candidates * 8))
    width = wider.ids.shape[1]
    logprobs = F.pad(dist.logprobs, (0, width - num_candidates), value=float("-inf"))
    ids = F.pad(ids, (0, width - num_candidates), value=0)  # padding is -inf: never drawn
    logprobs[short], ids[short] = wider.logprobs, wider.ids
    return _Distribution(logprobs, ids)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=1), the first maximum of each row. On CPU torch's argmax over a
    vocabulary-wide row is not vectorised (about 2 ms for 32 x 49k); the max of each
    block of a row is, so this finds the best block, then the best column in it."""
    rows, width = x.shape
    if width <= ARGMAX_BLOCK:
        return x.argmax(dim=1)
    pad = -width % ARGMAX_BLOCK
    if pad:
        x = F.pad(x, (0, pad), value=float("-inf"))
    blocks = x.view(rows, -1, ARGMAX_BLOCK)
    best_block = blocks.amax(dim=2).argmax(dim=1)
    inner = blocks[torch.arange(rows, device=x.device), best_block].argmax(dim=1)
    return best_block * ARGMAX_BLOCK + inner


def _draw_sorted(logprobs: torch.Tensor, uniforms: list[float]) -> torch.Tensor:
    """Column per row where its number falls in the CDF of columns sorted best first."""
    cdf = logprobs.exp().cumsum(dim=1)
    targets = torch.tensor(uniforms, device=cdf.device) * cdf[:, -1]  # scaled by the total: immune to rounding
    return torch.searchsorted(cdf, targets[:, None], right=True)[:, 0].clamp(max=cdf.shape[1] - 1)


def _draw_from_vocab(logprobs: torch.Tensor, uniforms: list[float]) -> torch.Tensor:
    """Column (= token id) per row of full-vocabulary log-probs: the head's CDF best
    first, or an exponential race over the rest when the number falls beyond it.
    The race's noise is seeded from the number itself, so a draw still takes one
    number from the sequence's generator (a recomputed sequence skips draws by count)."""
    vocab_size = logprobs.shape[1]
    head_logprobs, head_ids = torch.topk(logprobs, min(HEAD_CANDIDATES, vocab_size), dim=1)
    cdf = head_logprobs.exp().cumsum(dim=1)
    drawn = torch.searchsorted(cdf, torch.tensor(uniforms, device=cdf.device)[:, None], right=True)[:, 0]
    columns = head_ids.gather(1, drawn.clamp(max=cdf.shape[1] - 1)[:, None])[:, 0]
    if cdf.shape[1] == vocab_size:
        return columns
    for row in (drawn >= cdf.shape[1]).nonzero().flatten().tolist():
        noise_source = torch.Generator().manual_seed(int(uniforms[row] * 2**53))
        noise = torch.empty(vocab_size).exponential_(generator=noise_source)
        scores = logprobs[row] - noise.log().to(logprobs.device)
        scores[head_ids[row]] = float("-inf")
        best = argmax_rows(scores[None])[0]
        if scores[best] > float("-inf"):  # else the tail holds no mass: keep the head's last
            columns[row] = best
    return columns


def _choose(
    dist: _Distribution, params: list[SamplingParams], uniforms: list[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Column of the chosen token per row: argmax for greedy rows, a seeded draw otherwise."""
    choice = argmax_rows(dist.logprobs)
    random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if random_rows:
        draw = _draw_from_vocab if dist.ids is None else _draw_sorted  # candidates: sorted already
        choice[random_rows] = draw(dist.logprobs[random_rows], [uniforms[i] for i in random_rows])
    chosen_logprobs = dist.logprobs.gather(1, choice[:, None])[:, 0]
    tokens = choice if dist.ids is None else dist.ids.gather(1, choice[:, None])[:, 0]
    return tokens, chosen_logprobs


def _alternatives(dist: _Distribution, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    if dist.ids is None:
        top = torch.topk(dist.logprobs, count, dim=1)
        return top.indices, top.values
    return dist.ids[:, :count], dist.logprobs[:, :count]


def _sample_group(
    scaled: torch.Tensor, params: list[SamplingParams], uniforms: list[float], is_filtered: bool
) -> tuple[list[int], list[float | None], list[list[TokenLogprob]]]:
    """Tokens, logprobs and alternatives for rows that share a path (plain or filtered)."""
    num_rows = len(params)
    if not is_filtered and all(p.is_greedy and p.top_logprobs < 0 for p in params):
        return _to_host(argmax_rows(scaled))[0], [None] * num_rows, [[] for _ in range(num_rows)]
    dist = _filtered(scaled, params) if is_filtered else _Distribution(scaled.log_softmax(dim=1), None)
    tokens, chosen = _choose(dist, params, uniforms)
    num_alternatives = min(max(p.top_logprobs for p in params), scaled.shape[1])
    alt_ids, alt_values = _alternatives(dist, max(num_alternatives, 0))
    token_list, chosen_list, alt_ids, alt_values = _to_host(tokens, chosen.clamp(min=MIN_LOGPROB), alt_ids,
                                                            alt_values)
    logprobs = [chosen_list[n] if p.top_logprobs >= 0 else None for n, p in enumerate(params)]
    alternatives: list[list[TokenLogprob]] = [[] for _ in range(num_rows)]
    if num_alternatives > 0:
        for n, p in enumerate(params):
            wanted = max(p.top_logprobs, 0)
            alternatives[n] = [
                TokenLogprob(t, max(v, MIN_LOGPROB))
                for t, v in zip(alt_ids[n][:wanted], alt_values[n][:wanted])
            ]
    return token_list, logprobs, alternatives


def _to_host(*tensors: torch.Tensor) -> list[list]:
    """The tensors' values as lists: from an accelerator in one copy to pinned
    memory (one sync), integer tensors exact (as float64, below 2**53)."""
    if tensors[0].device.type == "cpu":
        return [t.tolist() for t in tensors]
    flat = torch.cat([t.flatten().to(torch.float64) for t in tensors])
    host = torch.empty(flat.shape, dtype=torch.float64, pin_memory=True)
    host.copy_(flat, non_blocking=True)
    torch.accelerator.synchronize(flat.device)
    values, out, start = host.tolist(), [], 0
    for t in tensors:
        part = values[start: start + t.numel()]
        start += t.numel()
        if not t.is_floating_point():
            part = [int(v) for v in part]
        if t.dim() == 2:
            width = t.shape[1]
            part = [part[i * width: (i + 1) * width] for i in range(t.shape[0])]
        out.append(part)
    return out


def draw_uniform(generator: torch.Generator | None) -> float:
    """The one number a draw takes from a sequence's generator, in [0, 1)."""
    return float(torch.rand((), dtype=torch.float64, generator=generator))


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> SampleOutput:
    """Sample one token per row. `generators[i]` (CPU) may be None only for greedy rows."""
    num_rows, vocab_size = logits.shape
    device = logits.device
    scaled = logits.float()
    if any(not p.is_greedy and p.temperature != 1.0 for p in params):
        scaled = scaled / torch.tensor([1.0 if p.is_greedy else p.temperature for p in params], device=device)[:, None]
    uniforms = [0.0 if p.is_greedy else draw_uniform(g) for p, g in zip(params, generators)]
    token_ids = [0] * num_rows
    logprobs: list[float | None] = [None] * num_rows
    alternatives: list[list[TokenLogprob]] = [[] for _ in range(num_rows)]
    # On an accelerator every random row draws from its sorted candidates (module docstring).
    sorts_all = device.type != "cpu"
    is_filtered = [0 < p.top_k < vocab_size or p.top_p < 1.0 or (sorts_all and not p.is_greedy) for p in params]
    for path in (False, True):
        rows = [i for i in range(num_rows) if is_filtered[i] == path]
        if not rows:
            continue
        if len(rows) == num_rows:  # one path for all: no copy of the logits
            group = _sample_group(scaled, params, uniforms, path)
        else:
            group = _sample_group(scaled[rows], [params[i] for i in rows], [uniforms[i] for i in rows], path)
        for n, row in enumerate(rows):
            token_ids[row], logprobs[row], alternatives[row] = group[0][n], group[1][n], group[2][n]
    return SampleOutput(token_ids, logprobs, alternatives)
