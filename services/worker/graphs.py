"""Decode steps replayed from device graphs (CUDA graphs, Ascend's NPUGraph).

A decode step of a small model is a thousand small kernels launched from
Python: on an accelerator the launches, not the GPU work, set its time. A
graph captured once replays them all in one call. As vLLM and SGLang do it:

- Only decode-only steps replay (every sequence feeds the same number of rows:
  one, or one plus its drafted tokens), at padded batch sizes captured at
  start: 1, 2, 4, then steps of 8 up to the worker's batch limit, largest
  first, into one memory pool the graphs share. Prefills and mixed steps run
  eagerly.
- A graph reads its step from persistent buffers (`GraphBuffers`): token ids,
  positions, KV slots, block tables, context lengths, query starts. Before a
  replay the step's values are copied in; the rows past the batch are padding
  that writes its K/V into the pool's null block (one block past the
  scheduler's, never handed out) and attends to that slot alone.
- The graph ends at the logits; sampling runs after it on the device.

The platform captures (`Platform.graph_capture`): torch.cuda.CUDAGraph on
CUDA, torch.npu.NPUGraph on Ascend, where the fused attention op's host-side
context lengths are refreshed before each replay. `EagerCapture` is the
stand-in the tests run on CPU: a replay runs the captured function again over
the same buffers, so padding, null block and buffer handling are held to the
eager step without a device.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np
import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GraphBuffers:
    """One captured batch size's view of the persistent step inputs (device
    tensors shared by every graph: a smaller batch's are prefixes)."""

    num_seqs: int  # sequences, padding included
    rows_per_seq: int  # new tokens of each sequence: 1, or 1 + drafted tokens
    input_ids: torch.Tensor  # [num_seqs * rows_per_seq] int64
    positions: torch.Tensor  # [num_seqs * rows_per_seq] int64
    slot_mapping: torch.Tensor  # [num_seqs * rows_per_seq] int64
    block_table: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32: each context, new tokens included
    query_start: torch.Tensor  # [num_seqs + 1] int32: each sequence's first row, then the total

    @property
    def num_rows(self) -> int:
        return self.num_seqs * self.rows_per_seq


class DeviceGraph(Protocol):
    def capture(self, run: Callable[[], Any]) -> Any:
        """Capture `run` (warmed up first where the device needs it); returns its
        outputs, the tensors every replay rewrites."""

    def replay(self, seq_lens: list[int]) -> None:
        """Run the captured work again; `seq_lens` are the step's context lengths
        (padding included) for ops whose lengths are host-side arguments."""


class GraphCapture(Protocol):
    """A platform's graph maker: graphs made by one capture share its memory pool."""

    name: str

    def new_graph(self) -> DeviceGraph: ...

    def memory_in_use(self) -> int:
        """Bytes the device's allocator holds now, cached blocks included (a
        graph's private pool is held that way): what graphs are measured by."""

    def empty_cache(self) -> None:
        """Hand the allocator's cached, unused blocks back to the device."""


class EagerGraph:
    """Capture runs the function; replay runs it again and writes the results
    into the tensors the capture returned, as a replayed graph would."""

    def __init__(self):
        self._run: Callable[[], Any] | None = None
        self._outputs: Any = None

    def capture(self, run: Callable[[], Any]) -> Any:
        self._run, self._outputs = run, run()
        return self._outputs

    def replay(self, seq_lens: list[int]) -> None:
        assert self._run is not None, "replay before capture"
        _copy_into(self._outputs, self._run())


class EagerCapture:
    name = "eager"

    def new_graph(self) -> EagerGraph:
        return EagerGraph()

    def memory_in_use(self) -> int:
        return 0

    def empty_cache(self) -> None:
        pass


def _copy_into(static: Any, fresh: Any) -> None:
    if isinstance(static, torch.Tensor):
        static.copy_(fresh)
    else:
        for s, f in zip(static, fresh):
            _copy_into(s, f)


def capture_sizes(max_batch_size: int) -> list[int]:
    """The padded batch sizes graphs are captured for, as vLLM picks them: 1, 2,
    4, then steps of 8, and the batch limit itself."""
    sizes = {s for s in (1, 2, 4) if s < max_batch_size} | set(range(8, max_batch_size, 8))
    return sorted(sizes | {max_batch_size})


class StepGraphs:
    """The decode-step graphs of one model runner and the buffers they read.

    `forward(input_ids, step, logit_rows) -> logits` is the model's packed
    forward (decoder.LeanDecoder). The pool must hold one reserved block past
    the scheduler's (KVCachePool's `reserved_blocks`): the null block padding
    writes to. Graphs for one row per sequence are captured by `capture_all`;
    a drafted shape (each sequence the same 1 + k rows) is captured the first
    time a step of it comes, while its rows fit the buffers.
    """

    def __init__(self, capture: GraphCapture, forward: Callable[..., torch.Tensor], pool, kernel,
                 max_batch_size: int, max_blocks_per_seq: int, device: torch.device):
        from services.worker.attention import PagedStep  # attention.py imports GraphBuffers from here

        self._paged_step = PagedStep
        self._capture, self._forward, self._pool, self._kernel = capture, forward, pool, kernel
        self.sizes = capture_sizes(max_batch_size)
        self.max_rows = max_batch_size
        self.max_blocks = max_blocks_per_seq
        self.null_block = pool.num_blocks
        self._device = device
        rows, seqs = self.max_rows, max_batch_size
        # The device buffers, and their host mirrors the steps are written into
        # (numpy views: a few microseconds a step where torch ops would take a
        # millisecond), pinned where the device copies from pinned memory.
        # Rows: token ids, positions, slots. A block table row's entries past
        # its sequence's blocks are left from earlier steps: nothing reads them.
        self._rows = torch.zeros(3, rows, dtype=torch.long, device=device)
        self._block_table = torch.full((seqs, max_blocks_per_seq), self.null_block, dtype=torch.int32,
                                       device=device)
        self._seq_lens = torch.zeros(seqs, dtype=torch.int32, device=device)
        pin = device.type == "cuda"
        self._host_rows_t = torch.zeros(3, rows, dtype=torch.long, pin_memory=pin)
        self._host_tables_t = torch.full((seqs, max_blocks_per_seq), self.null_block, dtype=torch.int32,
                                         pin_memory=pin)
        self._host_lens_t = torch.zeros(seqs, dtype=torch.int32, pin_memory=pin)
        self._host_rows, self._host_tables = self._host_rows_t.numpy(), self._host_tables_t.numpy()
        self._host_lens = self._host_lens_t.numpy()
        self._query_starts: dict[int, torch.Tensor] = {}  # per rows_per_seq: constant, arange * rows
        # (rows_per_seq, num_seqs) -> the graph and the logits it writes
        self._graphs: dict[tuple[int, int], tuple[DeviceGraph, torch.Tensor]] = {}
        self._refused: set[int] = set()  # drafted shapes whose capture failed: eager from then on

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def measure(self) -> int:
        """Bytes the largest graph takes (captured, then dropped): what the KV
        budget leaves for all of them, as they share its memory."""
        before = self._capture.memory_in_use()
        self._capture_one(1, self.sizes[-1])
        taken = self._capture.memory_in_use() - before
        self._graphs.clear()
        self._capture.empty_cache()
        return taken

    def capture_all(self) -> None:
        """One graph per padded batch size of plain decode steps, largest first
        (the smaller ones reuse its memory in the shared pool)."""
        for size in reversed(self.sizes):
            self._capture_one(1, size)

    def padded_size(self, num_seqs: int, rows_per_seq: int) -> int | None:
        """The captured size a step of `num_seqs` sequences of `rows_per_seq` rows
        pads to; None when no graph can take it."""
        if rows_per_seq in self._refused or num_seqs * rows_per_seq > self.max_rows:
            return None
        return next((s for s in self.sizes if s >= num_seqs and s * rows_per_seq <= self.max_rows), None)

    def run(self, token_ids: list[list[int]], num_computed: list[int],
            block_tables: list[list[int]]) -> torch.Tensor | None:
        """The logits [rows, vocab] of a decode-only step (every sequence
        `len(token_ids[0])` rows, every row sampled), replayed; None when no
        graph takes the step (the caller runs it eagerly)."""
        num_seqs, rows_per_seq = len(token_ids), len(token_ids[0])
        size = self.padded_size(num_seqs, rows_per_seq)
        if size is None or any(len(t) > self.max_blocks for t in block_tables):
            return None
        graph = self._graphs.get((rows_per_seq, size))
        if graph is None:
            if rows_per_seq == 1:
                return None  # not captured (capture_all not run)
            try:
                graph = self._capture_one(rows_per_seq, size)
            except Exception as exc:  # noqa: BLE001 - the step still runs, eagerly
                self._refused.add(rows_per_seq)
                log.warning("decode steps of %d rows per sequence run eagerly: capturing %d sequences failed: %s",
                            rows_per_seq, size, exc)
                return None
        seq_lens = self._fill(token_ids, num_computed, block_tables, size)
        graph[0].replay(seq_lens)
        return graph[1][: num_seqs * rows_per_seq]

    def _buffers(self, rows_per_seq: int, num_seqs: int) -> GraphBuffers:
        rows = num_seqs * rows_per_seq
        query_start = self._query_starts.get(rows_per_seq)
        if query_start is None:
            query_start = torch.arange(self.max_rows + 1, dtype=torch.int32, device=self._device) * rows_per_seq
            self._query_starts[rows_per_seq] = query_start
        return GraphBuffers(num_seqs, rows_per_seq, self._rows[0, :rows], self._rows[1, :rows],
                            self._rows[2, :rows], self._block_table[:num_seqs], self._seq_lens[:num_seqs],
                            query_start[: num_seqs + 1])

    def _capture_one(self, rows_per_seq: int, num_seqs: int) -> tuple[DeviceGraph, torch.Tensor]:
        buffers = self._buffers(rows_per_seq, num_seqs)
        self._fill([], [], [], num_seqs, rows_per_seq)  # every sequence padding: valid values to warm up on
        step = self._paged_step(self._pool, buffers.positions, buffers.slot_mapping, self._kernel,
                                self._kernel.graph_inputs(buffers), (), None)
        logit_rows = torch.arange(buffers.num_rows, device=self._device)
        graph = self._capture.new_graph()
        logits = graph.capture(lambda: self._forward(buffers.input_ids, step, logit_rows))
        self._graphs[(rows_per_seq, num_seqs)] = graph, logits
        return graph, logits

    def _fill(self, token_ids: list[list[int]], num_computed: list[int], block_tables: list[list[int]],
              size: int, rows_per_seq: int | None = None) -> list[int]:
        """Copy a step into the buffers, padded to `size` sequences of the null
        block (positions 0 to q - 1 each); returns the context lengths, padding
        included, on the host."""
        q = rows_per_seq or len(token_ids[0])
        num_seqs, block_size, null = len(token_ids), self._pool.spec.block_size, self.null_block
        real, rows = num_seqs * q, size * q
        ids, positions, slots = self._host_rows[:, :rows]
        tables, lens = self._host_tables, self._host_lens
        if num_seqs:
            for row, table in enumerate(block_tables):
                tables[row, : len(table)] = table
            ids[:real] = [t for ts in token_ids for t in ts]
            computed = np.asarray(num_computed, dtype=np.int64)
            positions[:real] = (computed[:, None] + np.arange(q)).ravel()
            blocks = tables[np.arange(num_seqs).repeat(q), positions[:real] // block_size]
            slots[:real] = blocks * block_size + positions[:real] % block_size
            lens[:num_seqs] = computed + q
        tables[num_seqs:size, : -(-q // block_size)] = null
        ids[real:] = 0
        positions[real:] = np.tile(np.arange(q), size - num_seqs)
        slots[real:] = null * block_size + positions[real:]
        lens[num_seqs:size] = q
        self._rows.copy_(self._host_rows_t, non_blocking=True)  # whole: contiguous, and a few kB
        self._block_table[:size].copy_(self._host_tables_t[:size], non_blocking=True)
        self._seq_lens[:size].copy_(self._host_lens_t[:size], non_blocking=True)
        return lens[:size].tolist()
