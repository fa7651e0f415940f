"""WorkerConfig: defaults, MindIE aliases, validation."""
from __future__ import annotations

import pytest

from services.common.config import load_config
from services.worker.config import WorkerConfig


def test_defaults():
    config = load_config(WorkerConfig, [], {})
    assert (config.port, config.dtype) == (50053, "auto")
    assert (config.cache_block_size, config.max_batch_size, config.kv_cache_mib) == (16, 64, 0)
    assert config.max_seq_len == 2560


def test_aliases_flags_and_environment():
    config = load_config(
        WorkerConfig,
        ["--cacheBlockSize", "32", "--maxBatchSize", "8", "--port", "0"],
        {"STORMSERVE_DTYPE": "float32", "STORMSERVE_MAX_BATCH_SIZE": "99"},
    )
    assert config.cache_block_size == 32 and config.max_batch_size == 8  # flag beats env
    assert config.dtype == "float32" and config.port == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"cache_block_size": 0},
        {"cache_block_size": 513},
        {"tensor_parallel_size": 0},
        {"dtype": "int8"},
        {"device": "tpu"},
        {"kv_cache_mib": -1},
        {"max_seq_len": 1},
        {"max_batch_size": 0},
    ],
)
def test_invalid_values_are_rejected(kwargs):
    with pytest.raises(ValueError):
        WorkerConfig(**kwargs)
