"""Platforms: one object per device kind (base.py says what each owns).

`select_platform` picks one: cuda (cuda.py), npu (npu.py, torch_npu) or cpu
(cpu.py). CPU is the only device this repository's tests run on; the NPU
path also runs there on a reference torch_npu (tests/fake_npu)."""
from __future__ import annotations

import logging

import torch

from services.worker.platforms.base import DTYPES, LayerOps, Linear, Platform, TorchLayerOps, torch_dtype
from services.worker.platforms.cpu import CpuPlatform

__all__ = ["DTYPES", "LayerOps", "Linear", "Platform", "TorchLayerOps", "select_platform", "torch_dtype"]

log = logging.getLogger(__name__)


def select_platform(requested: str, local_rank: int = 0) -> Platform:
    """`auto` prefers cuda, then npu, then cpu; an explicit device must exist.
    `local_rank`: which device of the host a tensor-parallel rank runs on."""
    from services.worker.platforms import npu  # imports torch_npu only when asked

    if requested == "auto":
        if torch.cuda.is_available():
            requested = "cuda"
        elif npu.npu_available():
            requested = "npu"
        else:
            requested = "cpu"
    elif requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda requested but CUDA is not available")
    elif requested == "npu" and not npu.npu_available():
        raise RuntimeError("device=npu requested but torch_npu / an Ascend NPU is not available")
    if requested == "cpu":
        platform: Platform = CpuPlatform(torch.device("cpu"))
    elif requested == "cuda":
        from services.worker.platforms.cuda import CudaPlatform

        platform = CudaPlatform(torch.device("cuda", local_rank))
    elif requested == "npu":
        platform = npu.NpuPlatform(torch.device("npu", local_rank))
    else:
        raise ValueError(f"unknown device {requested!r}")
    platform.set_device(local_rank)
    log.info("device %s", platform.device)
    return platform
