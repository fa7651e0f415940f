"""The Grafana dashboard under deploy/ queries only series the services export."""
from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.http_edge.metrics import EdgeMetrics
from services.scheduler.metrics import SchedulerMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "stormserve-dashboard.json"


def exported_families() -> set[str]:
    """Family names (counters without `_total`), labelled ones included before their first series."""
    names = set()
    for registry in (SchedulerMetrics("m", 2560).registry, EdgeMetrics().registry):
        names |= {f.name for f in text_string_to_metric_families(generate_latest(registry).decode())}
    return names


def family_of(series: str) -> str:
    return re.sub(r"_(bucket|sum|count|total)$", "", series)


def test_every_queried_series_is_exported():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    queried = {family_of(name) for expr in exprs for name in re.findall(r"\b(?:vllm|stormserve):[a-z0-9_]+", expr)}
    assert len(queried) > 20, queried
    exported = exported_families()
    # Series read from the engines' state exist once an engine does; their names are fixed in metrics.py.
    scrape_time = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                   "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions",
                   "stormserve:kv_blocks_used", "stormserve:kv_blocks_free", "stormserve:worker_healthy"}
    source = (Path(__file__).resolve().parents[2] / "services" / "scheduler" / "metrics.py").read_text()
    for name in scrape_time:
        assert f'"{name}"' in source
    assert queried - exported <= scrape_time, queried - exported - scrape_time
