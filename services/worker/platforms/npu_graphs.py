"""Decode steps replayed from Ascend graphs (graphs.py's DeviceGraph on
torch.npu.NPUGraph), as SGLang's NPUGraphRunner captures and replays them.

- Capture: the step runs eagerly twice first (SGLang's warm-up count; a first
  run's lazy initialisation stays out of the graph), then once inside
  torch.npu.graph(graph, pool=<the capture's pool>, auto_dispatch_capture=True).
  With auto_dispatch_capture, torch_npu records each fused attention op
  (npu_fused_infer_attention_score, and _v2) as a task group whose keyword
  arguments can be replaced after capture (torch_npu/npu/graphs.py,
  _GraphDispatchMode).
- Replay: the op's context lengths (actual_seq_lengths_kv) are host-side
  arguments, baked in at capture, so before each replay
  graph.update(cpu_update_input=[{"actual_seq_lengths_kv": seq_lens}])
  re-records them. torch_npu matches the list to the recorded ops in capture
  order, one dict each, or spreads a single dict over all of them (what
  SGLang passes, and what this does: every attention layer of a decode step
  has the same lengths); it replaces only keys the op was called with.
  torch_npu captures a wait on an event before each such op, and the update
  records that event, so an update goes with every replay (SGLang runs it in
  a thread beside the replay; here it runs first, the simpler order).

A windowed layer's decode attends through SDPA over device tensors in a
captured step (NpuStepInputs.window_decode), which holds no host lengths: it
records no task and needs no update. MLA models step eagerly (the runner
captures none): NpuMlaOps reads its context lengths on the host.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

# Eager runs before the capture, as SGLang's NPUGraphRunner makes them.
NUM_WARMUPS = 2


class NpuGraph:
    """graphs.DeviceGraph on one torch.npu.NPUGraph."""

    def __init__(self, pool: Any):
        self._graph = torch.npu.NPUGraph()  # type: ignore[attr-defined]
        self._pool = pool

    def capture(self, run: Callable[[], Any]) -> Any:
        for _ in range(NUM_WARMUPS):
            torch.npu.synchronize()  # type: ignore[attr-defined]
            run()
        torch.npu.synchronize()  # type: ignore[attr-defined]
        with torch.npu.graph(self._graph, pool=self._pool, auto_dispatch_capture=True):  # type: ignore[attr-defined]
            outputs = run()
        return outputs

    def replay(self, seq_lens: list[int]) -> None:
        self._graph.update(cpu_update_input=[{"actual_seq_lengths_kv": list(seq_lens)}])
        self._graph.replay()


class NpuGraphCapture:
    """graphs.GraphCapture: graphs made here share one memory pool."""

    name = "npugraph"

    def __init__(self, device: torch.device):
        self._device = device
        self._pool = torch.npu.graph_pool_handle()  # type: ignore[attr-defined]

    def new_graph(self) -> NpuGraph:
        return NpuGraph(self._pool)

    def memory_in_use(self) -> int:
        """What the caching allocator reserves: the graphs' pool keeps the
        blocks its captures freed, which memory_allocated would not count
        (torch.npu.graph empties the allocator's cache before each capture)."""
        return torch.npu.memory_reserved(self._device)  # type: ignore[attr-defined]

    def empty_cache(self) -> None:
        torch.npu.synchronize(self._device)  # type: ignore[attr-defined]
        torch.npu.empty_cache()  # type: ignore[attr-defined]
