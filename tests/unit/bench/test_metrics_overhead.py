"""bench.metrics_overhead times the metrics' real calls: a decode step of every
sequence (no first tokens), a finished request at the scheduler and at the edge,
a scrape; and its share of a step adds them up as its doc says."""
from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from bench.metrics_overhead import MetricsPath, measure, share_of_step


def totals(registry, **labels: str) -> dict[str, float]:
    """Each sample name's value summed over the samples that carry `labels`."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            if labels.items() <= sample.labels.items():
                found[sample.name] = found.get(sample.name, 0.0) + sample.value
    return found


def test_the_timed_calls_are_the_metrics_path_of_steady_decoding():
    path = MetricsPath(sequences=4, prompt_len=16, output_len=8, step_ms=50.0)
    figures = measure(path, repetitions=10, rounds=3)
    assert set(figures) == {"step_us", "finished_request_us", "scrape_us"}
    assert all(v > 0 for v in figures.values())
    scheduler = totals(path.scheduler.registry)
    assert scheduler["vllm:generation_tokens_total"] == 4 * 10 * 3
    assert scheduler["vllm:inter_token_latency_seconds_count"] == 4 * 10 * 3
    assert scheduler["vllm:time_to_first_token_seconds_count"] == 0
    assert totals(path.scheduler.registry, kind="decode")["stormserve:step_duration_seconds_count"] == 10 * 3
    assert scheduler["stormserve:step_batch_size_sum"] == 4 * 10 * 3
    assert scheduler["vllm:request_success_total"] == 10 * 3
    assert scheduler["vllm:request_decode_time_seconds_count"] == 10 * 3
    assert totals(path.edge.registry)["stormserve:http_requests_total"] == 10 * 3


def test_the_share_of_a_step():
    figures = {"step_us": 100.0, "finished_request_us": 40.0, "scrape_us": 5000.0}
    # 100 + 32/128 * 40 + 5000 * (50 ms / 5 s) = 100 + 10 + 50 µs of a 50 ms step.
    assert abs(share_of_step(figures, sequences=32, output_len=128, step_ms=50.0, scrape_s=5.0) - 160 / 50_000) < 1e-12
