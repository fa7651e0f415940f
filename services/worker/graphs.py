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

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch


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
        """Bytes the device's allocator holds now (what the graphs' pool is measured by)."""


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


def _copy_into(static: Any, fresh: Any) -> None:
    if isinstance(static, torch.Tensor):
        static.copy_(fresh)
    else:
        for s, f in zip(static, fresh):
            _copy_into(s, f)
