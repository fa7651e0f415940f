from dataclasses import dataclass

import pytest

from services.common.config import load_config, require, setting


@dataclass(frozen=True)
class DemoConfig:
    port: int = setting(1, "port")
    max_seq_len: int = setting(2560, "cap", alias="maxSeqLen")
    addresses: tuple[str, ...] = setting(("a:1",), "list")
    enabled: bool = setting(False, "flag")

    def __post_init__(self):
        require(self.port > 0, "port must be > 0")


def test_defaults():
    assert load_config(DemoConfig, [], {}) == DemoConfig()


def test_env_then_flags_with_reference_alias():
    env = {"STORMSERVE_MAX_SEQ_LEN": "100", "STORMSERVE_ENABLED": "true", "STORMSERVE_ADDRESSES": "x:1, y:2"}
    cfg = load_config(DemoConfig, [], env)
    assert (cfg.max_seq_len, cfg.enabled, cfg.addresses) == (100, True, ("x:1", "y:2"))
    assert load_config(DemoConfig, ["--maxSeqLen", "7"], env).max_seq_len == 7
    assert load_config(DemoConfig, ["--max-seq-len", "8"], env).max_seq_len == 8


def test_invalid_values_exit_with_a_message(capsys):
    with pytest.raises(SystemExit):
        load_config(DemoConfig, ["--port", "0"], {})
    assert "port must be > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        load_config(DemoConfig, ["--enabled", "maybe"], {})


def test_one_drain_timeout_for_every_service():
    """The chart sizes terminationGracePeriodSeconds from this one variable."""
    from services.http_edge.config import EdgeConfig
    from services.scheduler.config import SchedulerConfig
    from services.tokenizer.config import TokenizerConfig
    from services.worker.config import WorkerConfig

    for cls in (EdgeConfig, TokenizerConfig, SchedulerConfig, WorkerConfig):
        assert cls().drain_timeout_s == 30.0
        assert load_config(cls, [], {"STORMSERVE_DRAIN_TIMEOUT_S": "7.5"}).drain_timeout_s == 7.5
        assert load_config(cls, ["--drain-timeout-s", "0"], {}).drain_timeout_s == 0.0
