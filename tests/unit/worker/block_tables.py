"""Stands in for the scheduler, which owns KV block tables: hands each test
sequence private blocks of the runner's pool as it grows."""
from __future__ import annotations

from services.worker.model_runner import ModelRunner
from services.worker.sequence import SamplingParams, SequenceInput


class BlockTables:
    def __init__(self, runner: ModelRunner):
        self.block_size = runner.block_size
        self.num_blocks = runner.kv_pool.num_blocks
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._tables: dict[int, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def table(self, seq_id: int, num_tokens: int) -> list[int]:
        """The sequence's table, grown to hold `num_tokens`."""
        table = self._tables.setdefault(seq_id, [])
        while len(table) * self.block_size < num_tokens:
            table.append(self._free.pop())
        return list(table)

    def feed(self, seq_id: int, token_ids: list[int], num_computed: int, sample: bool,
             sampling: SamplingParams | None = None, num_prompt_tokens: int = 0) -> SequenceInput:
        table = self.table(seq_id, num_computed + len(token_ids))
        return SequenceInput(seq_id, token_ids, num_computed, sample, sampling, table, num_prompt_tokens)

    def release(self, seq_id: int) -> None:
        self._free.extend(reversed(self._tables.pop(seq_id, [])))
