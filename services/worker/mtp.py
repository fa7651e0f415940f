"""Drafts from DeepSeek's multi-token prediction (MTP) module, for the
scheduler's speculative decoding (`STORMSERVE_SPECULATIVE_METHOD=mtp`).

The module predicts the token after next: at position q it reads the model's
final hidden state h_q (after the final norm, as vLLM and SGLang feed the
published checkpoints' module) and the embedding of the next token x_{q+1}, runs one
decoder layer of its own (with its own KV, in the pool's layer after the
model's, at the same slots as the sequence's), and its head gives the logits of
x_{q+2}. So once a step has sampled a sequence's next token y, the pair (h of
its last kept position, y) drafts the token after y, which the scheduler sends
as a one-token draft in the sequence's next step, where the model verifies it
losslessly (speculative.py): what is served never depends on the draft.

Each step runs the module over every pair it can complete, in position order,
so that its KV covers the sequence: for a sequence whose step fed positions
[c, c + n) and kept `kept` of them (all of a prompt chunk; the fed token and
the accepted drafts of a drafted decode), the pairs q = next .. c + kept - 1,
whose next tokens are the fed tokens after q and, for the last, the sampled
token (a chunk that samples nothing leaves its last position waiting for the
next chunk's first token, its hidden state kept until then). `next` is where
the sequence's pairs stopped: c, or c - 1 when that position waited. A
sequence whose first step starts on cached blocks starts its pairs there (the
module's KV of the cached positions came with the blocks).

Drafts are greedy (the module's argmax); only sequences that may draft
(no logprobs, penalties or grammar) get one."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker import attention
from services.worker.kv_cache import KVCachePool
from services.worker.sequence import SampledToken, SequenceInput


@dataclass
class _Pairs:
    """Where one sequence's MTP pairs stopped."""

    next_position: int
    waiting_hidden: torch.Tensor | None = None  # h of next_position, whose next token is not known yet


class MtpDrafter:
    def __init__(self, decoder, pool: KVCachePool, device: torch.device):
        self.decoder, self.pool, self.device = decoder, pool, device
        self._pairs: dict[int, _Pairs] = {}

    def release(self, seq_id: int) -> None:
        self._pairs.pop(seq_id, None)

    def draft(self, inputs: list[SequenceInput], hidden: torch.Tensor, tokens: list[SampledToken],
              drafting: set[int]) -> dict[int, int]:
        """After a step: run the module over every pair the step completes; the
        draft of each sequence of `drafting` (seq ids) that sampled, by seq id.
        `hidden` [T, hidden]: the step's final hidden states, rows as `inputs`
        lay them out; `tokens`: the step's samples."""
        sampled = {t.seq_id: t for t in tokens}
        rows, next_ids, slots_new, slots_done, tables, last_rows, drafted = [], [], [], [], [], [], []
        pending: list[torch.Tensor] = []  # waiting hidden states, rows after the step's own
        start = 0
        for s in inputs:
            token = sampled.get(s.seq_id)
            fed = s.token_ids
            kept = (1 + token.num_accepted_draft_tokens) if s.num_draft_tokens and token else len(fed)
            c = s.num_computed_tokens
            state = self._pairs.get(s.seq_id) or _Pairs(c)
            first = state.next_position
            last = c + kept - 1 if token is not None else c + kept - 2
            pair_rows: list[int] = []
            for q in range(first, last + 1):
                if q == c - 1:  # the position the last chunk left waiting: a row after the step's own
                    assert state.waiting_hidden is not None
                    pair_rows.append(hidden.shape[0] + len(pending))
                    pending.append(state.waiting_hidden)
                else:
                    pair_rows.append(start + q - c)
                next_ids.append(fed[q + 1 - c] if q + 1 < c + kept else token.token_id)
            if pair_rows:
                rows.extend(pair_rows)
                slots_new.append(len(pair_rows))
                slots_done.append(first)
                tables.append(s.block_table)
                if token is not None and s.seq_id in drafting:
                    last_rows.append(len(rows) - 1)
                    drafted.append(s.seq_id)
            waiting = None if token is not None else hidden[start + kept - 1]
            self._pairs[s.seq_id] = _Pairs(last + 1, waiting)
            start += len(fed)
        if not rows:
            return {}
        table = torch.cat([hidden, torch.stack(pending)]) if pending else hidden
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        step = attention.build_paged_step(self.pool, slots_new, slots_done, tables, self.device)
        logits = self.decoder.draft_logits(table.index_select(0, index),
                                           torch.tensor(next_ids, dtype=torch.long, device=self.device), step,
                                           torch.tensor(last_rows, dtype=torch.long, device=self.device))
        return dict(zip(drafted, logits.argmax(dim=-1).tolist()))


def check_mtp(config, lean: bool, tensor_parallel) -> None:
    """ValueError, at start, for a model or setup the MTP drafter cannot serve."""
    if not getattr(config, "num_nextn_predict_layers", 0):
        raise ValueError(f"speculative_method mtp needs a checkpoint with a multi-token prediction module "
                         f"(num_nextn_predict_layers); {getattr(config, 'model_type', None)!r} has none")
    if not lean:
        raise ValueError("speculative_method mtp runs on the lean path only (DeepSeek-V3/R1 checkpoints)")
    if tensor_parallel is not None:
        raise ValueError("speculative_method mtp is not supported with tensor parallelism yet")
