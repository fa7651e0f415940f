"""Shared fixtures: the real bundled model in float32 (loads in well under a second)."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.common.model_files import default_model_path, resolve_model
from services.worker.platforms import select_platform
from services.worker.model_runner import ModelRunner
from tests.unit.worker.block_tables import BlockTables

# tests/fake_npu: a torch_npu of reference ops, put on the path by `npu_platform`.
FAKE_NPU = Path(__file__).resolve().parents[2] / "fake_npu"
# Small blocks so short test sequences still cross several block boundaries.
TEST_BLOCK_SIZE = 4


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return resolve_model(default_model_path())


@pytest.fixture(scope="session")
def runner(model_dir: Path) -> ModelRunner:
    return ModelRunner(
        model_dir,
        select_platform("cpu"),
        dtype="float32",
        block_size=TEST_BLOCK_SIZE,
        kv_cache_bytes=64 * 2**20,
        max_batch_size=16,
    )


@pytest.fixture(scope="session")
def reference_model(model_dir: Path):
    """The plain HF model (stock sdpa attention, no paging) as the ground truth."""
    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()


@pytest.fixture(scope="session")
def tables(runner: ModelRunner) -> BlockTables:
    return BlockTables(runner)


@pytest.fixture(scope="module")
def npu_platform():
    """The NPU platform on the fake torch_npu, its tensors on the CPU. The fake
    stays imported after (its ops stay registered with torch's dispatcher), but
    torch.npu goes, so npu_available() is False again; it is set here each
    time, since importing the fake sets it once per process."""
    sys.path.insert(0, str(FAKE_NPU))
    try:
        torch.npu = importlib.import_module("torch_npu").npu
        from services.worker.platforms.npu import NpuPlatform

        yield NpuPlatform(torch.device("cpu"))
    finally:
        sys.path.remove(str(FAKE_NPU))
        del torch.npu
