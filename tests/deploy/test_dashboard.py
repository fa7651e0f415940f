"""The Grafana dashboard under deploy/ queries only series the services export,
and every query of a serving group's series follows the `group` variable."""
from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.http_edge.metrics import EdgeMetrics
from services.scheduler.metrics import SchedulerMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "stormserve-dashboard.json"
SERIES = r"\b((?:vllm|stormserve):[a-z0-9_]+)(\{[^}]*\})?"
GROUP_FILTER = 'group=~"$group"'


def families_of(registry) -> set[str]:
    """Family names (counters without `_total`), labelled ones included before their first series."""
    return {f.name for f in text_string_to_metric_families(generate_latest(registry).decode())}


def exported_families() -> set[str]:
    return families_of(SchedulerMetrics("m", 2560).registry) | families_of(EdgeMetrics().registry)


def family_of(series: str) -> str:
    return re.sub(r"_(bucket|sum|count|total)$", "", series)


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def exprs() -> list[str]:
    return [t["expr"] for panel in dashboard()["panels"] for t in panel["targets"]]


def test_every_queried_series_is_exported():
    queried = {family_of(name) for expr in exprs() for name, _ in re.findall(SERIES, expr)}
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


def test_the_group_variable_picks_serving_groups():
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    group = variables["group"]
    assert group["type"] == "query" and group["multi"] is True and group["includeAll"] is True
    assert group["allValue"] == ".*"  # All also keeps series scraped before the label existed
    assert re.fullmatch(r"label_values\(vllm:[a-z_]+\{[^}]*\}, group\)", group["query"]["query"])
    assert group["definition"] == group["query"]["query"]


def test_every_query_of_a_groups_series_filters_by_group():
    """A scheduler's series (and its workers') carry `group`; the edge's, in front of
    every group, carry none: those are left unfiltered, or asked for with group=""."""
    edge = families_of(EdgeMetrics().registry)
    grouped = SchedulerMetrics("m", 2560, group="0").registry
    assert all(s.labels.get("group") == "0"
               for f in text_string_to_metric_families(generate_latest(grouped).decode()) for s in f.samples)
    for expr in exprs():
        for name, selector in re.findall(SERIES, expr):
            family = family_of(name)
            if GROUP_FILTER in selector:
                continue
            assert family in edge, f"{expr}: {name} is not filtered by group"
            assert 'group=""' in selector or "group" not in selector, expr


def test_groups_and_workers_have_panels_of_their_own():
    panels = {p["title"]: [t["expr"] for t in p["targets"]] for p in dashboard()["panels"]}
    by_group = [title for title, queries in panels.items() if all("by (group" in q for q in queries)]
    assert len(by_group) >= 5, by_group
    balance = " ".join(panels["Group load balance"])
    assert "vllm:num_requests_running" in balance and "scalar(avg(" in balance
    assert any("stormserve:worker_healthy" in q for q in panels["Workers ready by group"])
    steps = panels["Engine steps and messages per second by worker"]
    assert any("by (group, engine)" in q and "step_duration_seconds_count" in q for q in steps)
    assert any("by (group, engine)" in q and "step_messages_total" in q for q in steps)
    ids = [p["id"] for p in dashboard()["panels"]]
    assert len(ids) == len(set(ids))
    # No two panels on the same cells of the 24-column grid.
    cells = [(p["gridPos"]["x"] + dx, p["gridPos"]["y"] + dy) for p in dashboard()["panels"]
             for dx in range(p["gridPos"]["w"]) for dy in range(p["gridPos"]["h"])]
    assert len(cells) == len(set(cells)) and all(x < 24 for x, _ in cells)
