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


# Two sequences: prefills packed together, a chunk over each one's cached blocks,
# decodes in either order, then one sequence alone (positions [a, b) per step).
TWO_SEQUENCE_SCHEDULE = [[(1, 0, 10), (2, 0, 12)], [(1, 10, 19), (2, 12, 13)], [(2, 13, 14), (1, 19, 20)],
                         [(1, 20, 21), (2, 14, 15)], [(1, 21, 23)]]


def assert_schedule_matches(runner: ModelRunner, expected: dict, tokens: dict[int, list[int]],
                            schedule=TWO_SEQUENCE_SCHEDULE) -> None:
    """Run `schedule` (per step: (seq, a, b) feeds tokens[seq][a:b]) and hold each
    row's logits to `expected[seq][b - 1]` (a reference's logits over the whole sequence)."""
    import torch

    greedy = SamplingParams(temperature=0.0)
    tables = BlockTables(runner)
    for step in schedule:
        logits = runner.forward([tables.feed(s, tokens[s][a:b], a, True, greedy if a == 0 else None)
                                 for s, a, b in step])
        for row, (s, _, b) in enumerate(step):
            torch.testing.assert_close(logits[row], expected[s][b - 1], atol=1e-4, rtol=1e-4)

