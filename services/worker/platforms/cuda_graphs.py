"""CUDA graphs for graphs.py: torch.cuda.CUDAGraph, every graph of a worker in
one memory pool (graph_pool_handle), captured on a side stream after a warm-up
run there (cuBLAS handles, Triton's compiled kernels and the allocator's
blocks are made outside the capture, as torch.cuda.make_graphed_callables
does). Nothing host-side is baked into the kernels (the Triton attention
reads its lengths from device buffers), so a replay needs no update. Never
run on a GPU in this repository's tests (graphs.EagerCapture stands in)."""
from __future__ import annotations

from typing import Any, Callable

import torch


class CudaGraph:
    def __init__(self, owner: CudaGraphCapture):
        self._owner = owner
        self._graph = torch.cuda.CUDAGraph()

    def capture(self, run: Callable[[], Any]) -> Any:
        stream = self._owner.stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()  # warm-up, outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(self._graph, pool=self._owner.pool, stream=stream):
            outputs = run()
        return outputs

    def replay(self, seq_lens: list[int]) -> None:
        self._graph.replay()


class CudaGraphCapture:
    name = "CUDA"

    def __init__(self, device: torch.device):
        self._device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)

    def new_graph(self) -> CudaGraph:
        return CudaGraph(self)

    def memory_in_use(self) -> int:
        return torch.cuda.memory_reserved(self._device)

    def empty_cache(self) -> None:
        torch.cuda.synchronize(self._device)
        torch.cuda.empty_cache()
