"""The batching policy's steps for prefill/decode disaggregation (BatchPolicy
inherits them; handoff.py drives them across two workers).

On a prefill worker's policy (`prefill_only`) a sequence placed to move
(`Sequence.moves`) is planned until its first token is sampled, never ahead
into a decode; the step that samples it leaves it `sending`: out of the batch,
its blocks held (never preempted) until its KV has been sent, then released.

On a decode worker's policy a moving sequence is first `receiving`: its table
starts with the decode pool's own prefix-cache hit, and blocks are reserved for
the rest of its prompt and its first token, which the prefill worker's blocks
are written into. Once they are, it joins the batch with its prompt computed
and the first token to feed (its sampling state goes with that step); if the
transfer failed, it joins with only the hit computed and prefills the rest into
the same blocks (a timed-out transfer's late bytes land only there).
"""
from __future__ import annotations

from collections.abc import Callable

from services.scheduler.block_manager import BlockManager
from services.scheduler.sequence import FinishReason, Sequence


class TransferSteps:
    blocks: BlockManager
    running: list[Sequence]
    _to_release: list[int]
    finish: Callable[[Sequence, FinishReason], None]

    def _init_transfers(self, prefill_only: bool) -> None:
        self.prefill_only = prefill_only
        self._prefilled: list[Sequence] = []  # sampled their first token in the last postprocess
        # Seq id -> its table, block hashes and computed tokens here, while its KV is sent.
        self._sending: dict[int, tuple[list[int], list[int], int]] = {}
        self._receiving: dict[int, Sequence] = {}

    @property
    def num_moving(self) -> int:
        return len(self._sending) + len(self._receiving)

    def take_prefilled(self) -> list[Sequence]:
        """The sequences to send since the last call: each is `sending` now."""
        prefilled, self._prefilled = self._prefilled, []
        moving = [seq for seq in prefilled if not seq.is_finished]
        for seq in moving:
            self.running.remove(seq)
            self._sending[seq.seq_id] = seq.block_table, seq.block_hashes, seq.num_computed_tokens
            seq.block_table, seq.block_hashes = [], []
        return moving

    def sending_table(self, seq: Sequence) -> list[int]:
        return self._sending[seq.seq_id][0]

    def sent(self, seq: Sequence) -> bool:
        """Its KV is on the decode worker (or will be recomputed there): free it
        here. False if it was not being sent from here."""
        held = self._sending.pop(seq.seq_id, None)
        if held is not None:
            self.blocks.release(held[0])
            self._to_release.append(seq.seq_id)
        return held is not None

    def keep(self, seq: Sequence) -> None:
        """No decode worker can take it: it decodes here after all."""
        seq.block_table, seq.block_hashes, seq.num_computed_tokens = self._sending.pop(seq.seq_id)
        seq.moves = False
        self.running.append(seq)

    def receive(self, seq: Sequence) -> tuple[int, int] | None:
        """Reserve blocks for `seq`'s prompt and first token; returns the range
        of its table (block indexes) the prefill worker must write, or None
        while there is no room."""
        if self.blocks.blocks_for(seq.num_tokens) > self.blocks.num_free_blocks:
            return None
        cached = self.blocks.allocate_prefix(seq)
        self.blocks.grow(seq, seq.num_tokens)
        seq.num_computed_tokens = cached
        self.num_cached_tokens += cached
        self.num_queried_tokens += seq.num_prompt_tokens
        self._receiving[seq.seq_id] = seq
        # The first token's KV is computed by its first step here.
        return cached // self.blocks.block_size, self.blocks.blocks_for(seq.num_prompt_tokens)

    def received(self, seq: Sequence, transferred: bool) -> None:
        """Into the batch: from its prompt computed (`transferred`) or from its prefix hit."""
        self._receiving.pop(seq.seq_id)
        seq.moves = False  # here to stay: planned ahead as any decode
        if transferred:
            seq.num_computed_tokens = seq.num_prompt_tokens
            self.blocks.commit(seq)
        seq.is_sent_to_worker = False
        self.running.append(seq)

    def drop_received(self, seq: Sequence) -> bool:
        """It ended while its KV was sent here: the blocks reserved for it go.
        False if it was not being received here."""
        received = self._receiving.pop(seq.seq_id, None) is not None
        if received:
            self.blocks.free(seq)
        return received

    def _finish_moving(self, seq: Sequence) -> bool:
        """Finish a sequence being sent or received (abort): its blocks go."""
        return self.sent(seq) or self.drop_received(seq)
