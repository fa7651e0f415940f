"""The scheduler's metrics on the batching policy and a fake worker: counters
move by exactly the tokens delivered, histograms get one observation where
vLLM's do, with vLLM's boundaries, and the scrape-time gauges follow the state."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.common.errors import ServiceError
from services.common.metrics import build_1_2_5_buckets
from services.scheduler.config import SchedulerConfig
from services.scheduler.discovery import WorkerPool, merge_slices
from services.scheduler.engine import EngineLoop
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.router import Router
from services.scheduler.sequence import FinishReason
from services.scheduler.server import SchedulerServicer
from services.scheduler.speculation import SpeculationConfig
from stormserve.scheduler.v1 import scheduler_pb2
from tests.unit.scheduler.test_discovery import FakeWorkerClient, ep, slices
from tests.unit.scheduler.test_policy import BLOCK_SIZE, FakeWorker, make_policy, make_seq

MODEL = "m"
ENGINE = {"model_name": MODEL, "engine": "0"}


def scrape(metrics: SchedulerMetrics) -> dict[tuple[str, frozenset], float]:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples, name: str, **labels) -> float:
    return samples[(name, frozenset({**ENGINE, **labels}.items()))]


def bounds(samples, name: str) -> list[float]:
    return sorted(float(dict(labels)["le"]) for n, labels in samples if n == name + "_bucket")


def setup(num_blocks=100):
    policy, engine = make_policy(num_blocks=num_blocks), EngineLoop(SimpleNamespace(address="w0"), 8, 1000)
    engine.policy = policy
    engine._ready.set()
    metrics = SchedulerMetrics(MODEL, 100, [engine])
    engine.metrics = metrics.engine()
    return policy, engine, metrics


def step(policy, engine, worker, started_us, finished_us):
    plan = policy.schedule()
    events = policy.postprocess(plan, worker.step(plan), started_us, finished_us)
    engine.metrics.on_step(plan, events, started_us, finished_us)
    return events


def test_token_counters_and_per_token_histograms_follow_the_delivered_tokens():
    policy, engine, metrics = setup()
    worker = FakeWorker(token=7)
    a, b = make_seq(1, prompt_len=5, max_tokens=4, arrival_us=1_000), make_seq(2, prompt_len=3, max_tokens=2,
                                                                                arrival_us=1_000)
    policy.add(a)
    policy.add(b)
    delivered, now = 0, 1_000
    while policy.has_work():
        delivered += len(step(policy, engine, worker, now, now + 10_000))
        now += 10_000
    samples = scrape(metrics)
    assert delivered == 6
    assert value(samples, "vllm:prompt_tokens_total") == 8
    assert value(samples, "vllm:generation_tokens_total") == 6
    # First token 10 ms after arrival for both; then one token every 10 ms.
    assert value(samples, "vllm:time_to_first_token_seconds_count") == 2
    assert abs(value(samples, "vllm:time_to_first_token_seconds_sum") - 0.02) < 1e-9
    assert value(samples, "vllm:inter_token_latency_seconds_count") == (4 - 1) + (2 - 1)
    assert abs(value(samples, "vllm:inter_token_latency_seconds_sum") - 0.04) < 1e-9
    assert value(samples, "stormserve:token_queue_wait_seconds_count") == 6
    # Prompt tokens count in the step of the first token, with the tokens generated in it.
    assert value(samples, "vllm:iteration_tokens_total_sum") == 8 + 6
    assert value(samples, "stormserve:step_duration_seconds_count", kind="prefill") == 1
    assert value(samples, "stormserve:step_duration_seconds_count", kind="decode") == 3
    assert value(samples, "stormserve:step_batch_size_sum") == 2 + 2 + 1 + 1

    for seq in (a, b):
        engine.metrics.on_finished(seq, seq.finish_reason.value, now)
    samples = scrape(metrics)
    assert value(samples, "vllm:request_success_total", finished_reason="length") == 2
    assert value(samples, "vllm:request_success_total", finished_reason="stop") == 0
    assert value(samples, "vllm:request_prompt_tokens_sum") == 8
    assert value(samples, "vllm:request_generation_tokens_sum") == 6
    assert value(samples, "vllm:e2e_request_latency_seconds_count") == 2
    assert value(samples, "vllm:request_queue_time_seconds_count") == 2
    # Decode time from first to last token; per output token over the tokens after the first.
    assert abs(value(samples, "vllm:request_decode_time_seconds_sum") - (0.03 + 0.01)) < 1e-9
    assert abs(value(samples, "vllm:request_time_per_output_token_seconds_sum") - 0.02) < 1e-9


ENGINE_LABELS = frozenset(ENGINE)
HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds", "request_time_per_output_token_seconds",
              "e2e_request_latency_seconds", "request_queue_time_seconds", "request_inference_time_seconds",
              "request_prefill_time_seconds", "request_decode_time_seconds", "request_prompt_tokens",
              "request_generation_tokens", "iteration_tokens_total")
COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens",
            "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
# Every vLLM series the scheduler exports: its Prometheus type and label names, as vLLM v1 declares them.
VLLM_SERIES = {
    "vllm:num_requests_running": ("gauge", ENGINE_LABELS),
    "vllm:num_requests_waiting": ("gauge", ENGINE_LABELS),
    "vllm:kv_cache_usage_perc": ("gauge", ENGINE_LABELS),
    "vllm:cache_config_info": ("gauge", frozenset({"block_size", "num_gpu_blocks", "enable_prefix_caching",
                                                   "engine"})),
    "vllm:request_success": ("counter", ENGINE_LABELS | {"finished_reason"}),
    **{"vllm:" + name: ("counter", ENGINE_LABELS) for name in COUNTERS},
    **{"vllm:" + name: ("histogram", ENGINE_LABELS) for name in HISTOGRAMS},
}


def families(metrics: SchedulerMetrics) -> dict[str, tuple[str, frozenset, set[tuple]]]:
    """Each family of the exposition: its type, its label names and its samples' label sets (less `le`)."""
    found = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        labels = {tuple(sorted((k, v) for k, v in s.labels.items() if k != "le")) for s in family.samples}
        found[family.name] = (family.type, frozenset(k for ls in labels for k, _ in ls), labels)
    return found


def test_every_vllm_series_has_vllms_type_and_label_names_and_every_counter_its_created_time():
    _, _, metrics = setup()
    exported = families(metrics)
    vllm = {name: (kind, names) for name, (kind, names, _) in exported.items()
            if name.startswith("vllm:") and not name.endswith("_created")}
    assert vllm == VLLM_SERIES
    # prometheus_client's default, as vLLM's: a counter's `_created` beside it, per child, scrape-time ones included.
    for name, (kind, _, labels) in exported.items():
        if kind == "counter" and name.startswith(("vllm:", "stormserve:")):
            assert exported[name + "_created"][2] == labels, name


def test_a_preemption_counts_once_and_the_count_outlives_a_worker_restart():
    policy, engine, metrics = setup(num_blocks=4)
    worker = FakeWorker(token=7)
    # 4 + 8 tokens each, 3 blocks of 4: the pool of 4 holds one, so the newer is preempted once.
    for seq_id in (1, 2):
        policy.add(make_seq(seq_id, prompt_len=4, max_tokens=8, arrival_us=1_000 + seq_id))
    while policy.has_work():
        step(policy, engine, worker, 1_000, 2_000)
    assert value(scrape(metrics), "vllm:num_preemptions_total") == policy.num_preemptions == 1
    engine._become_ready(policy.capacity)
    assert value(scrape(metrics), "vllm:num_preemptions_total") == 1


def test_a_full_queue_is_refused_and_counted_and_no_other_refusal_is():
    policy, engine, metrics = setup()
    policy.add(make_seq(1))  # one sequence queued on the only worker
    engine._ready.clear()  # not ready: a request that passes the queue check is refused as unavailable
    router = Router([engine])
    request = scheduler_pb2.GenerateRequest(request_id="r2", prompt_token_ids=[10, 11, 12])
    queue_full = ("stormserve:requests_rejected_total", frozenset({"reason": "queue_full"}.items()))

    def refusal(max_queue_size: int) -> grpc.StatusCode:
        servicer = SchedulerServicer(SchedulerConfig(max_queue_size=max_queue_size), router, metrics=metrics)

        with pytest.raises(ServiceError) as refused:
            asyncio.run(servicer._generate(request))
        return refused.value.code

    assert scrape(metrics)[queue_full] == 0
    assert refusal(2) is grpc.StatusCode.UNAVAILABLE
    assert scrape(metrics)[queue_full] == 0
    assert refusal(1) is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refusal(1) is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert scrape(metrics)[queue_full] == 2


def test_histograms_have_vllms_boundaries():
    _, _, metrics = setup()
    samples = scrape(metrics)
    inf = float("inf")
    ttft = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
            80.0, 160.0, 640.0, 2560.0, inf]
    itl = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
           inf]
    latency = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0, inf]
    assert bounds(samples, "vllm:time_to_first_token_seconds") == ttft
    assert bounds(samples, "vllm:inter_token_latency_seconds") == itl
    assert bounds(samples, "vllm:request_time_per_output_token_seconds") == itl
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds"):
        assert bounds(samples, "vllm:" + name) == latency
    assert bounds(samples, "vllm:request_prompt_tokens") == [1, 2, 5, 10, 20, 50, 100, inf]
    assert build_1_2_5_buckets(2560) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    assert bounds(samples, "vllm:iteration_tokens_total") == [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096,
                                                               8192, 16384, inf]
    assert not any("pid" in dict(labels) for _, labels in samples)


def test_gauges_follow_the_state_and_return_to_idle_after_aborts():
    policy, engine, metrics = setup(num_blocks=10)
    worker = FakeWorker(token=7)
    samples = scrape(metrics)
    assert value(samples, "vllm:num_requests_running") == 0
    assert value(samples, "vllm:kv_cache_usage_perc") == 0
    assert samples[("vllm:cache_config_info", frozenset({"engine": "0", "block_size": str(BLOCK_SIZE),
                                                          "num_gpu_blocks": "10",
                                                          "enable_prefix_caching": "True"}.items()))] == 1
    seqs = [make_seq(i, prompt_len=8, max_tokens=4) for i in range(1, 5)]
    for seq in seqs:
        policy.add(seq)
    step(policy, engine, worker, 1_000, 2_000)
    samples = scrape(metrics)
    running = value(samples, "vllm:num_requests_running")
    assert running >= 1 and running + value(samples, "vllm:num_requests_waiting") == 4
    used = value(samples, "stormserve:kv_blocks_used")
    assert used > 0 and value(samples, "vllm:kv_cache_usage_perc") == used / 10
    assert value(samples, "stormserve:kv_blocks_free") == 10 - used
    for seq in seqs:  # every client left
        policy.finish(seq, FinishReason.ABORT)
        engine.metrics.on_finished(seq, "abort", 3_000)
    samples = scrape(metrics)
    assert value(samples, "vllm:num_requests_running") == value(samples, "vllm:num_requests_waiting") == 0
    assert value(samples, "vllm:kv_cache_usage_perc") == 0
    assert value(samples, "vllm:request_success_total", finished_reason="abort") == 4
    assert value(samples, "stormserve:worker_healthy", worker="w0") == 1


def test_a_sequence_aborted_before_its_first_token_has_no_prefill_decode_or_inference_time():
    policy, engine, metrics = setup()
    worker = FakeWorker(token=7)
    served, left = make_seq(1, max_tokens=2), make_seq(2, max_tokens=2)
    policy.add(served)
    policy.add(left)
    policy.finish(left, FinishReason.ABORT)  # its client left while it waited
    engine.metrics.on_finished(left, "abort", 5_000)
    now = 10_000
    while policy.has_work():
        step(policy, engine, worker, now, now + 10_000)
        now += 10_000
    engine.metrics.on_finished(served, "length", now)
    samples = scrape(metrics)
    assert value(samples, "vllm:request_success_total", finished_reason="abort") == 1
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_generation_tokens"):
        assert value(samples, f"vllm:{name}_count") == 2, name
    for name in ("request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds"):
        assert value(samples, f"vllm:{name}_count") == 1, name
    assert abs(value(samples, "vllm:request_decode_time_seconds_sum") - 0.01) < 1e-9


def test_prefix_cache_counts_queries_and_hits_in_tokens_across_worker_restarts():
    policy, engine, metrics = setup()
    worker = FakeWorker(token=7)
    for seq_id in (1, 2):  # the same 9-token prompt twice: 2 full blocks of 4 reused
        policy.add(make_seq(seq_id, prompt_len=9, max_tokens=1))
        while policy.has_work():
            step(policy, engine, worker, 1_000, 2_000)
    samples = scrape(metrics)
    assert value(samples, "vllm:prefix_cache_queries_total") == 18
    assert value(samples, "vllm:prefix_cache_hits_total") == 8
    engine._become_ready(policy.capacity)  # a restarted worker: a fresh policy, the counters go on
    samples = scrape(metrics)
    assert value(samples, "vllm:prefix_cache_queries_total") == 18
    assert value(samples, "vllm:num_preemptions_total") == 0


def test_speculative_decoding_counters_follow_the_drafts():
    engine = EngineLoop(SimpleNamespace(address="w0"), 8, 1000, SpeculationConfig("prompt_lookup", 4, 16))
    policy = make_policy(speculator=engine.speculator)
    engine.policy = policy
    engine._ready.set()
    metrics = SchedulerMetrics(MODEL, 100, [engine])
    engine.metrics = metrics.engine()
    worker = FakeWorker(policy=policy, copy_period=3)
    seq = make_seq(1, prompt_len=6, max_tokens=40)
    policy.add(seq)
    drafted = accepted = drafts = delivered = steps_with_tokens = 0
    now = 1_000
    while policy.has_work():
        plan = policy.schedule()
        events = policy.postprocess(plan, worker.step(plan), now, now + 10_000)
        engine.metrics.on_step(plan, events, now, now + 10_000)
        now += 10_000
        delivered += len(events)
        steps_with_tokens += bool(events)
        for entry in plan.scheduled:
            if entry.draft_token_ids:
                drafts += 1
                drafted += len(entry.draft_token_ids)
                accepted += len(events) - 1
    samples = scrape(metrics)
    assert 0 < accepted < drafted
    assert value(samples, "vllm:spec_decode_num_drafts_total") == drafts
    assert value(samples, "vllm:spec_decode_num_draft_tokens_total") == drafted
    assert value(samples, "vllm:spec_decode_num_accepted_tokens_total") == accepted
    assert value(samples, "vllm:generation_tokens_total") == delivered == 40
    # Tokens of one step: one inter-token latency each step after the first token.
    assert value(samples, "vllm:inter_token_latency_seconds_count") == steps_with_tokens - 1


def test_a_discovered_worker_takes_the_engine_label_of_one_that_left():
    """However many pods come and go, `engine` has as many values as workers at once."""
    async def scenario():
        router = Router([])
        metrics = SchedulerMetrics(MODEL, 100, router.engines)

        def make_engine(address: str) -> EngineLoop:
            engine = EngineLoop(FakeWorkerClient(address), 8, 64)
            engine.metrics = metrics.engine()
            return engine

        pool = WorkerPool(router, make_engine)
        await pool.apply(merge_slices(slices([ep("10.0.0.1", "a"), ep("10.0.0.2", "b")])))
        for generation in range(5):  # a's pod replaced again and again (a rollout, an autoscaler)
            await pool.apply(merge_slices(slices([ep("10.0.0.1", f"a{generation}"), ep("10.0.0.2", "b")])))
        await pool.apply(merge_slices(slices([ep("10.0.0.1", "a9"), ep("10.0.0.2", "b"), ep("10.0.0.3", "c")])))
        labels = {e.worker.address: e.metrics.label for e in router.engines}
        exported = {dict(labels)["engine"] for name, labels in scrape(metrics)
                    if name == "vllm:e2e_request_latency_seconds_count"}
        await pool.stop()
        return labels, exported

    labels, exported = asyncio.run(scenario())
    assert labels == {"10.0.0.1:50053": "0", "10.0.0.2:50053": "1", "10.0.0.3:50053": "2"}
    assert exported == {"0", "1", "2"}


def test_a_tally_counts_as_observing_each():
    from prometheus_client import CollectorRegistry, Histogram

    from services.scheduler.metrics import Tally

    amounts = [0.0, 0.0005, 0.001, 0.0011, 0.3, 7.0, 1e9, 0.001, 0.02]
    amounts += [0.01, 0.1, 1.0, 0.0099, 0.05, 0.5, 2.0, 0.001, 0.0001, 0.3, 0.01]  # a batch's worth
    samples = []
    for many in (False, True):
        registry = CollectorRegistry()
        histogram = Histogram("latency", "seconds", ["engine"], buckets=(0.001, 0.01, 0.1, 1.0), registry=registry)
        child = histogram.labels("0")
        if many:
            tally = Tally(child)
            for amount in amounts[:4]:
                tally.observe(amount)
            tally.flush()
            tally.flush()  # nothing more
            tally.observe(amounts[4])
            for amount in set(amounts[5:]):  # 0.3, 0.01 and 0.001 twice
                tally.observe(amount, amounts[5:].count(amount))
            tally.flush()
        else:
            for amount in amounts:
                child.observe(amount)
        found = {}
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            for sample in family.samples:
                if not sample.name.endswith("_created"):
                    found[(sample.name, sample.labels.get("le"))] = sample.value
        samples.append(found)
    observed, at_once = samples
    assert at_once.pop(("latency_sum", None)) == pytest.approx(observed.pop(("latency_sum", None)))
    assert at_once == observed
    assert observed[("latency_bucket", "0.001")] == 6 and observed[("latency_count", None)] == 20
