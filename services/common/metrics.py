"""Prometheus exposition shared by the services: vLLM's histogram boundaries and
a small HTTP server for a gRPC service's `/metrics`.

Every process has one registry of its own (no multiprocess mode: one process
per service), so no `pid` label and no multiprocess files to go stale. The
registry of a process in a serving group (a scheduler, its workers) adds the
group's name to every sample it exposes, as the `group` label: one value per
process, added at scrape time, so nothing is looked up when a series moves.

The bucket boundaries are vLLM's (vllm/v1/metrics/loggers.py), so that its
dashboards' `histogram_quantile` queries read ours unchanged."""
from __future__ import annotations

import asyncio
import logging

from collections.abc import Iterable
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
    start_http_server,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric

from services.common.config import require, setting

log = logging.getLogger(__name__)

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# vllm:inter_token_latency_seconds and vllm:request_time_per_output_token_seconds.
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                         10.0, 20.0, 40.0, 80.0)
# e2e, queue, prefill and decode time: up to 7680 s, so a long request never pins the p99 at 60 s.
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# vllm:iteration_tokens_total in vLLM v1 (older releases took the CUDA-graph capture sizes).
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to `max_value`."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


GROUP_LABEL = "group"
DEFAULT_GROUP = "0"  # one serving group: the chart's and `make run`'s name for it


def serving_group_setting() -> Any:
    """The `serving_group` setting of a process that belongs to a serving group."""
    return setting(DEFAULT_GROUP, "name of the serving group this process belongs to (a scheduler and its "
                                  "workers): the `group` label of every metric it exports; the chart and "
                                  "`make run` set each group's index")


def check_serving_group(group: str) -> None:
    require(bool(group.strip()), "serving_group must not be empty")


class GroupRegistry(CollectorRegistry):
    """A registry whose every sample carries `group="<group>"` beside its own labels
    (a collector's own `group` label wins). The label is added when the registry is
    collected (a scrape), so the metrics' children and their hot-path updates are
    those of a plain registry."""

    def __init__(self, group: str):
        super().__init__()
        self.group = group

    def collect(self) -> Iterable[Metric]:
        extra = {GROUP_LABEL: self.group}
        for family in super().collect():
            # A copy: a collector may hand out the same family object at every scrape.
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            labelled.samples = [s._replace(labels={**extra, **s.labels}) for s in family.samples]
            yield labelled


def process_registry(group: str | None = None) -> CollectorRegistry:
    """A registry of this process's own: CPU, memory, open files, GC (the `process_`
    and `python_` series every Prometheus client exports). With a `group` (a process of
    a serving group: a scheduler, a worker), every series it exposes carries it as
    the `group` label."""
    registry = CollectorRegistry() if group is None else GroupRegistry(group)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


async def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> asyncio.Server:
    """`GET /metrics` on the running event loop: collectors that read the
    service's state run on the loop that changes it, so they need no locks.
    One request per connection; anything else gets 404."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            method, _, rest = head.partition(b" ")
            path = rest.partition(b" ")[0].partition(b"?")[0]
            if method in (b"GET", b"HEAD") and path == b"/metrics":
                body = generate_latest(registry)
                status, content_type = b"200 OK", CONTENT_TYPE_LATEST.encode()
            else:
                body, status, content_type = b"not found\n", b"404 Not Found", b"text/plain"
            writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: " + content_type
                         + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n")
            if method != b"HEAD":
                writer.write(body)
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, host, port)
    log.info("metrics on http://%s:%d/metrics", host, port)
    return server


def serve_metrics_in_thread(registry: CollectorRegistry, host: str, port: int) -> None:
    """`/metrics` from a daemon thread, for a service whose event loop may be busy
    (the worker's forward passes) and whose collectors are thread-safe."""
    start_http_server(port, addr=host, registry=registry)
    log.info("metrics on http://%s:%d/metrics", host, port)
