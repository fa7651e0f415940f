"""The `group` label: every series of a scheduler's or worker's /metrics carries its
serving group's name, scrape-time ones and process ones included; the processes in
front of the groups (edge, tokenizer) export none."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.common.config import load_config
from services.common.metrics import process_registry
from services.scheduler.config import SchedulerConfig
from services.scheduler.engine import EngineLoop
from services.scheduler.metrics import SchedulerMetrics
from services.worker.config import WorkerConfig
from tests.unit.scheduler.test_policy import make_policy


def samples(registry) -> list:
    return [s for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples]


def test_every_scheduler_series_carries_the_group():
    engine = EngineLoop(SimpleNamespace(address="w0"), 8, 1000)
    engine.policy = make_policy(num_blocks=10)
    engine._ready.set()
    metrics = SchedulerMetrics("m", 100, [engine], group="1")
    engine.metrics = metrics.engine()
    found = samples(metrics.registry)
    names = {s.name for s in found}
    # Children bound at start, scrape-time gauges, process series: all of them.
    assert {"vllm:generation_tokens_total", "vllm:num_requests_running", "stormserve:worker_healthy",
            "vllm:cache_config_info", "process_cpu_seconds_total"} <= names
    assert {s.labels.get("group") for s in found} == {"1"}
    running = next(s for s in found if s.name == "vllm:num_requests_running")
    assert running.labels == {"model_name": "m", "engine": "0", "group": "1"}


def test_a_registry_without_a_group_adds_no_label():
    assert all("group" not in s.labels for s in samples(process_registry()))
    assert {s.labels["group"] for s in samples(process_registry("g2"))} == {"g2"}


@pytest.mark.parametrize("config", [SchedulerConfig, WorkerConfig])
def test_the_group_is_a_setting_of_its_own_with_one_default(config):
    assert load_config(config, [], {}).serving_group == "0"
    assert load_config(config, ["--serving-group", "east"], {}).serving_group == "east"
    assert load_config(config, [], {"STORMSERVE_SERVING_GROUP": "3"}).serving_group == "3"
    with pytest.raises(SystemExit):
        load_config(config, ["--serving-group", " "], {})
