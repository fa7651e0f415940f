"""torch.npu's graph capture and replay (torch_npu/npu/graphs.py) on CPU:
NPUGraph, the `graph` context manager, graph_pool_handle, and the update of
captured attention ops' host-side arguments.

What it keeps of the real semantics, so that a wrong runner fails here:
- Capture records every aten op that runs between capture_begin and
  capture_end (a TorchDispatchMode), its tensor arguments by identity and its
  outputs. Replay runs the recorded ops again in order and writes each result
  into the tensors the capture returned: a value read from a tensor is the
  tensor's value at replay; a host value (an int, a list, a shape) is the one
  baked in at capture, whatever the Python objects hold later.
- Reading a tensor's value on the host (item(), int(t), torch.equal) during
  capture raises, as the device refuses a synchronisation while its stream
  captures. (tolist() on a CPU tensor reads memory without an op, so the
  fake cannot see it.)
- npu_fused_infer_attention_score (and _v2) under `graph(...,
  auto_dispatch_capture=True)` is one recorded task whose keyword arguments
  `update(cpu_update_input=[...])` replaces: one dict per task in capture
  order, or a single dict for every task; only keys the task was called
  with are replaced (torch_npu's _GraphDispatchMode.update_capture_record).
  An update lasts until the next one. Without one, a replay runs with the
  host values of the capture. update() on a graph captured without
  auto_dispatch_capture raises, as the real one does.
- A graph holds what its capture allocated (its outputs and intermediates)
  for as long as it lives; memory_allocated / memory_reserved report those
  bytes (the fake tracks no other allocation; graphs sharing a pool are
  summed, where the device would reuse the pool's memory).

Not modelled: streams (the `stream` argument is taken and ignored), the
ExternalEvent each updatable task waits on at replay (recorded by the
update), capture_error_mode, and what happens when a captured input
tensor is freed (the fake keeps every tensor it recorded alive).
"""
from __future__ import annotations

import itertools
import weakref

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

# Ops whose host arguments the real update refreshes (torch_npu's IFA v1 / v2 graph handlers).
UPDATABLE_OPS = ("npu_fused_infer_attention_score", "npu_fused_infer_attention_score_v2")
# Ops that read a tensor's value on the host: a synchronisation the device refuses during capture.
HOST_READS = ("item", "_local_scalar_dense", "equal", "is_nonzero")

_pool_ids = itertools.count(1)
_live_graphs: weakref.WeakSet[NPUGraph] = weakref.WeakSet()


def graph_pool_handle():
    """An opaque token naming a memory pool graphs may share."""
    return (0, next(_pool_ids))


class _Task:
    """One recorded op: what it was called with and the tensors it returned."""

    def __init__(self, func, args, kwargs, outputs):
        self.func = func
        # Containers rebuilt: a list the caller mutates after capture does not reach the task.
        self.args, self.kwargs = pytree.tree_map(lambda leaf: leaf, (args, kwargs))
        self.outputs = outputs

    def run(self) -> None:
        fresh = self.func(*self.args, **self.kwargs)
        for static, new in zip(pytree.tree_leaves(self.outputs), pytree.tree_leaves(fresh)):
            if isinstance(static, torch.Tensor) and not _same_memory(static, new):
                static.copy_(new)  # views and in-place results already are the tensor itself


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: NPUGraph):
        super().__init__()
        self._graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        if name in HOST_READS:
            raise RuntimeError(f"torch.npu graph capture: {func.__name__} reads a device value on the host, "
                               "which the device refuses while its stream captures")
        outputs = func(*args, **kwargs)
        task = _Task(func, args, kwargs, outputs)
        self._graph._tasks.append(task)
        if self._graph.auto_dispatch_capture and name in UPDATABLE_OPS:
            self._graph._updatable.append(task)
        inputs = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        for out in pytree.tree_leaves(outputs):
            if isinstance(out, torch.Tensor) and not any(_same_memory(out, a) for a in inputs):
                self._graph._allocated[out.untyped_storage().data_ptr()] = out.untyped_storage().nbytes()
        return outputs


class NPUGraph:
    """A captured sequence of device work; replay() runs it again."""

    def __init__(self):
        self.auto_dispatch_capture = False
        self._tasks: list[_Task] = []
        self._updatable: list[_Task] = []
        self._allocated: dict[int, int] = {}  # storage -> bytes, what the capture allocated
        self._recorder: _Recorder | None = None
        self._captured = False
        self._pool = None

    def capture_begin(self, pool=None, capture_error_mode="global"):
        if self._captured or self._recorder is not None:
            raise RuntimeError("torch.npu graph: this NPUGraph already holds a capture (reset() it first)")
        self._pool = graph_pool_handle() if pool is None else pool
        self._recorder = _Recorder(self)
        self._recorder.__enter__()

    def capture_end(self):
        if self._recorder is None:
            raise RuntimeError("torch.npu graph: capture_end without capture_begin")
        self._recorder.__exit__(None, None, None)
        self._recorder = None
        self._captured = True
        _live_graphs.add(self)

    def replay(self):
        if not self._captured:
            raise RuntimeError("torch.npu graph: replay before a capture")
        with torch.inference_mode():  # the recorded results may be inference tensors, updated in place
            for task in self._tasks:
                task.run()

    def update(self, cpu_update_input):
        if not self.auto_dispatch_capture:
            raise RuntimeError("The current graph configuration does not support update, try to capture by setting "
                               "auto_dispatch_capture=True during capture")
        if len(cpu_update_input) == 1:
            cpu_update_input = [dict(cpu_update_input[0]) for _ in self._updatable]
        if len(cpu_update_input) != len(self._updatable):
            raise RuntimeError(f"Currently, there are {len(self._updatable)} operators that need to be updated by "
                               f"capture, and there are only {len(cpu_update_input)} elements in the incoming "
                               "cpu_update_input list")
        for task, update in zip(self._updatable, cpu_update_input):
            for key, value in update.items():
                if key in task.kwargs:
                    task.kwargs[key] = pytree.tree_map(lambda leaf: leaf, value)

    def reset(self):
        self._tasks, self._updatable, self._allocated = [], [], {}
        self._captured = False
        _live_graphs.discard(self)

    def pool(self):
        return self._pool


class graph:
    """Captures the work of its body into `npu_graph`, as torch.npu.graph does."""

    def __init__(self, npu_graph: NPUGraph, pool=None, stream=None, auto_dispatch_capture=False,
                 capture_error_mode: str = "global"):
        self.npu_graph = npu_graph
        self.pool = () if pool is None else (pool,)
        self.capture_error_mode = capture_error_mode
        npu_graph.auto_dispatch_capture = auto_dispatch_capture

    def __enter__(self):
        self.npu_graph.capture_begin(*self.pool, capture_error_mode=self.capture_error_mode)

    def __exit__(self, exc_type, exc_value, traceback):
        self.npu_graph.capture_end()


def memory_allocated(device=None) -> int:
    """Bytes the live graphs' captures allocated (the only allocations the fake tracks)."""
    return sum(sum(g._allocated.values()) for g in _live_graphs)


def memory_reserved(device=None) -> int:
    return memory_allocated(device)
