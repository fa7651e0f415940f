"""The device seam: which accelerator the worker runs on, and the few calls
that differ between them. Nothing else in the worker names cuda or npu.

Only the pure-torch paged attention path exists today (attention.py); it runs on
every device because it is plain torch + SDPA. Fused Ascend / CUDA paged kernels
would plug in here. CPU is the only device exercised in this repo's tests.
"""
from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


def _npu_available() -> bool:
    # torch_npu registers the "npu" device on import; it only exists on Ascend hosts.
    try:
        importlib.import_module("torch_npu")
    except ImportError:
        return False
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


@dataclass(frozen=True)
class Backend:
    """The chosen device and its device-specific operations."""

    name: str  # cpu, cuda or npu
    device: torch.device

    def synchronize(self) -> None:
        """Wait for queued device work, so step timings measure the work itself."""
        if self.name == "cuda":
            torch.cuda.synchronize(self.device)
        elif self.name == "npu":
            torch.npu.synchronize(self.device)  # type: ignore[attr-defined]

    def set_num_threads(self, num_threads: int) -> None:
        if num_threads > 0:
            torch.set_num_threads(num_threads)


def select_backend(requested: str) -> Backend:
    """`auto` prefers cuda, then npu, then cpu; an explicit device must exist."""
    if requested == "auto":
        if torch.cuda.is_available():
            requested = "cuda"
        elif _npu_available():
            requested = "npu"
        else:
            requested = "cpu"
    elif requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda requested but CUDA is not available")
    elif requested == "npu" and not _npu_available():
        raise RuntimeError("device=npu requested but torch_npu / an Ascend NPU is not available")
    if requested not in ("cpu", "cuda", "npu"):
        raise ValueError(f"unknown device {requested!r}")
    backend = Backend(name=requested, device=torch.device(requested))
    log.info("device %s", backend.device)
    return backend


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; one of {sorted(DTYPES)}") from None
