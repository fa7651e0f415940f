"""The scheduler's Prometheus metrics: vLLM's engine set under vLLM's names,
labels (`model_name`, `engine`), help texts and buckets, and our extras under
`stormserve:`.

The scheduler is the one process that sees every sequence of its serving group
from queue to last token, so it alone observes them: the edges and tokenizers
in front of it scale out, and a request counted there too would be counted
twice when dashboards sum over pods. One `engine` label value per worker:
each worker runs its own batch, as one vLLM engine core does, so summing over
`engine` gives the group. The value is the lowest index no other current
worker holds (a static list's position): a discovered worker that joins takes
the index, and the series, of one that left, so the label has as many values
as there are workers at once, however many come and go.

What is counted where, and what it costs:
- once per step (`EngineMetrics.on_step`, and the planning time): token
  counters, TTFT at a sequence's first token, one inter-token latency and one
  queue-wait per token (counted once per distinct value: a step's tokens
  mostly share theirs), the step's size and duration — added up in plain
  numbers (`Tally`) and written into the histograms and the token counter when
  the registry is collected (a scrape), O(distinct values in the step);
- once per sequence (`on_finished`): request_success and the per-request histograms;
- at scrape time (`_StateCollector`): running, waiting, KV usage, prefix-cache
  and preemption counters, worker health — read from the engines' state on the
  event loop (the metrics server runs there), nothing on the hot path.

A sequence is one vLLM request: vLLM runs `n > 1` as n child requests, and so
are our sibling sequences counted, each with its prompt.
"""
from __future__ import annotations

import itertools
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence as Seq
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.common.metrics import (
    ITERATION_TOKENS_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TOKEN_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    build_1_2_5_buckets,
    process_registry,
)
from services.scheduler.sequence import Sequence, TokenEvent

if TYPE_CHECKING:
    from services.scheduler.engine import EngineLoop
    from services.scheduler.plan import StepPlan

LABELS = ("model_name", "engine")
# vLLM's FinishReason strings; "error": the worker was lost under the request.
FINISHED_REASONS = ("stop", "length", "abort", "error")
STEP_KINDS = ("prefill", "decode", "mixed")
TRANSFER_OUTCOMES = ("sent", "retried", "recomputed", "kept")
QUEUE_WAIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                      60.0, 300.0, 1800.0, 7680.0)
STEP_DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0,
                         10.0, 30.0, 80.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512, 1024)
PLANNING_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00015, 0.0002, 0.0003, 0.0005, 0.001, 0.002, 0.005,
                    0.01, 0.05)
US = 1e-6


class SchedulerMetrics:
    """One registry for the scheduler process; `engine()` binds a joining worker's series.
    `engines` is the live list of workers (the router's, which discovery changes in place)."""

    def __init__(self, model_name: str, max_model_len: int, engines: Seq[EngineLoop] = (),
                 group: str | None = None):
        self.model_name = model_name
        self.engines = engines
        self.registry = process_registry(group)  # with a group, every series carries it (`group` label)
        reg = self.registry
        # Each `engine` label's EngineMetrics, whose tallies a scrape writes out first.
        self._tallied: dict[str, EngineMetrics] = {}
        reg.register(_TallyFlush(self._tallied))  # before the series it writes into: collected first

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, LABELS + extra, registry=reg)

        def histogram(name: str, doc: str, buckets: Iterable[float], extra: tuple[str, ...] = ()) -> Histogram:
            return Histogram(name, doc, LABELS + extra, buckets=tuple(buckets), registry=reg)

        token_buckets = build_1_2_5_buckets(max_model_len)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.request_success = counter("vllm:request_success", "Count of successfully processed requests.",
                                       ("finished_reason",))
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                               token_buckets)
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.",
                                        REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        # Ours.
        self.token_queue_wait = histogram(
            "stormserve:token_queue_wait_seconds",
            "Per generated token: time from the sequence's previous token (or arrival) until the step that "
            "computed it started.", QUEUE_WAIT_BUCKETS)
        self.step_batch_size = histogram("stormserve:step_batch_size", "Sequences in one engine step.",
                                         BATCH_SIZE_BUCKETS)
        self.step_duration = histogram(
            "stormserve:step_duration_seconds",
            "Engine step time on the worker, by kind: prefill (prompt chunks only), decode (one token per "
            "sequence only) or mixed.", STEP_DURATION_BUCKETS, ("kind",))
        self.step_messages = counter(
            "stormserve:step_messages",
            "Messages sent to workers, each one engine step or several (max_decode_steps); against the count of "
            "step_duration_seconds, the steps a message runs.")
        self.step_planning = histogram(
            "stormserve:step_planning_seconds",
            "Scheduler CPU time planning one step (the batching policy's decision, before its message is built).",
            PLANNING_BUCKETS)
        self.rejected = Counter("stormserve:requests_rejected", "Requests refused before they ran, by reason.",
                                ("reason",), registry=reg)
        self.rejected.labels("queue_full")  # the one reason the scheduler decides; at 0 from the start
        # Prefill/decode disaggregation (handoff.py).
        self.kv_transfers = Counter(
            "stormserve:kv_transfers", "Sequences moved from a prefill to a decode worker, by outcome: sent, "
            "retried (sent on the second try), recomputed (failed twice: the decode worker computed the prompt) "
            "or kept (no decode worker could take it: it decoded where it was prefilled).",
            ("model_name", "outcome"), registry=reg)
        self.kv_transfer_bytes = Counter("stormserve:kv_transfer_bytes", "Bytes of KV cache sent between workers.",
                                         ("model_name",), registry=reg)
        self.kv_transfer_duration = Histogram(
            "stormserve:kv_transfer_duration_seconds", "Time of one successful KV transfer (SendBlocks).",
            ("model_name",), buckets=QUEUE_WAIT_BUCKETS, registry=reg)
        for outcome in TRANSFER_OUTCOMES:  # at 0 from the start, as every series of ours
            self.kv_transfers.labels(model_name, outcome)
        self.kv_transfer_bytes.labels(model_name)
        self.kv_transfers_in_flight = Gauge(
            "stormserve:kv_transfers_in_flight", "Sequences between a prefill and a decode worker: waiting for "
            "room on one, or being sent.", ("model_name",), registry=reg)
        self.registry.register(_StateCollector(self, engines))

    def engine(self) -> EngineMetrics:
        """The series of a worker about to join: the lowest `engine` index no current worker holds."""
        held = {e.metrics.label for e in self.engines if e.metrics is not None}
        label = next(str(i) for i in itertools.count() if str(i) not in held)
        if (left := self._tallied.get(label)) is not None:
            left.flush()  # the worker that held the label left: what it counted stays counted
        engine = self._tallied[label] = EngineMetrics(self, label)
        return engine


class EngineMetrics:
    """One worker's bound series (label lookups done once) and the recording logic."""

    def __init__(self, metrics: SchedulerMetrics, engine: str):
        self.label = engine
        values = (metrics.model_name, engine)
        self.prompt_tokens = metrics.prompt_tokens.labels(*values)
        self.generation_tokens = metrics.generation_tokens.labels(*values)
        self._num_generated = 0  # tokens counted since the last flush
        self.step_messages = metrics.step_messages.labels(*values)
        self._num_messages = 0  # messages answered since the last flush
        self.success = {r: metrics.request_success.labels(*values, r) for r in FINISHED_REASONS}
        self.request_prompt_tokens = metrics.request_prompt_tokens.labels(*values)
        self.request_generation_tokens = metrics.request_generation_tokens.labels(*values)
        self.iteration_tokens = Tally(metrics.iteration_tokens.labels(*values))
        self.ttft = metrics.ttft.labels(*values)
        self.itl = Tally(metrics.itl.labels(*values))
        self.tpot = metrics.tpot.labels(*values)
        self.e2e = metrics.e2e.labels(*values)
        self.queue_time = metrics.queue_time.labels(*values)
        self.inference_time = metrics.inference_time.labels(*values)
        self.prefill_time = metrics.prefill_time.labels(*values)
        self.decode_time = metrics.decode_time.labels(*values)
        self.token_queue_wait = Tally(metrics.token_queue_wait.labels(*values))
        self.step_batch_size = Tally(metrics.step_batch_size.labels(*values))
        self.step_duration = {k: Tally(metrics.step_duration.labels(*values, k)) for k in STEP_KINDS}
        self.step_planning = Tally(metrics.step_planning.labels(*values))
        self._tallies = [self.iteration_tokens, self.itl, self.token_queue_wait, self.step_batch_size,
                         self.step_planning, *self.step_duration.values()]

    def flush(self) -> None:
        """Write what the tallies and the token count hold into the series."""
        for tally in self._tallies:
            tally.flush()
        if self._num_generated:
            self.generation_tokens.inc(self._num_generated)
            self._num_generated = 0
        if self._num_messages:
            self.step_messages.inc(self._num_messages)
            self._num_messages = 0

    def on_step(self, plan: StepPlan, events: list[tuple[Sequence, TokenEvent]], started_us: int,
                finished_us: int, packed: Mapping[tuple[int, int, float], int] = {}) -> None:
        """A step answered: `events` are the tokens it delivered (postprocess's result),
        `packed` how many it gave to sinks (never a first token) by (batch size,
        queue wait µs, latency ms)."""
        decodes = plan.num_decodes
        prefills = plan.batch_size - decodes
        steps = plan.steady.steps  # a message of several steps: each observed, sharing its time evenly
        if prefills or decodes:
            kind = "mixed" if prefills and decodes else "decode" if decodes else "prefill"
            self.step_duration[kind].observe((finished_us - started_us) * US / steps, steps)
            self.step_batch_size.observe(prefills + decodes, steps)
        prompt = 0
        previous = None
        itl, queue_wait = self.itl, self.token_queue_wait
        num_packed = 0
        for (_, queue_wait_us, latency_ms), count in packed.items():
            itl.observe(latency_ms * 1e-3, count)
            queue_wait.observe(queue_wait_us * US, count)
            num_packed += count
        for seq, event in events:
            if seq is previous:
                continue  # forced tokens (a spent thinking budget) come with the sampled one: not a new latency
            previous = seq
            if not seq.first_token_us:
                # vLLM counts a request's prompt with its first token; TTFT from its arrival here.
                seq.first_token_us = finished_us
                prompt += seq.num_prompt_tokens
                self.ttft.observe((finished_us - seq.arrival_us) * US)
            else:
                itl.observe(event.latency_ms * 1e-3)
            queue_wait.observe(event.queue_wait_us * US)
        if prompt:
            self.prompt_tokens.inc(prompt)
        self._num_generated += len(events) + num_packed
        self._num_messages += 1
        if plan.batch_size:
            self.iteration_tokens.observe((prompt + len(events) + num_packed) / steps, steps)

    def on_finished(self, seq: Sequence, reason: str, now_us: int) -> None:
        """Once per sequence, when its Generate call is done with it (finished, aborted or failed)."""
        self.success[reason].inc()
        self.e2e.observe((now_us - seq.arrival_us) * US)
        scheduled = seq.first_scheduled_us or now_us
        self.queue_time.observe((scheduled - seq.arrival_us) * US)
        first, last = seq.first_token_us, seq.last_event_us
        if first:  # without a token (aborted or failed before it) no phase ran to its end: none is observed
            self.prefill_time.observe((first - scheduled) * US)
            self.decode_time.observe((last - first) * US)
            self.inference_time.observe((last - scheduled) * US)
        generated = len(seq.output_token_ids)
        self.tpot.observe((last - first) * US / (generated - 1) if first and generated > 1 else 0.0)
        self.request_prompt_tokens.observe(seq.num_prompt_tokens)
        self.request_generation_tokens.observe(generated)


class Tally:
    """A labelled histogram's observations (no exemplars), added up in plain
    numbers and written into it by `flush` with one increment per bucket
    touched and one of the sum, however many there were: a step observes a
    latency and a queue wait per token, and each `observe` of the histogram
    takes locks and walks the buckets (prometheus_client 0.26's internals, pinned)."""

    __slots__ = ("_histogram", "_bounds", "_counts", "_sum")

    def __init__(self, histogram: Histogram):
        self._histogram = histogram
        self._bounds = histogram._upper_bounds
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0

    def observe(self, amount: float, count: int = 1) -> None:
        """As `histogram.observe(amount)` `count` times, once flushed."""
        self._counts[bisect_left(self._bounds, amount)] += count  # the first bound >= amount, as observe() finds it
        self._sum += amount * count

    def flush(self) -> None:
        counts, buckets = self._counts, self._histogram._buckets
        if not any(counts):
            return
        for index, count in enumerate(counts):
            if count:
                buckets[index].inc(count)
                counts[index] = 0
        self._histogram._sum.inc(self._sum)
        self._sum = 0.0


class _TallyFlush(Collector):
    """Collected before the series: writes every engine's tallies into them."""

    def __init__(self, tallied: Mapping[str, EngineMetrics]):
        self.tallied = tallied

    def describe(self):
        return []

    def collect(self):
        for engine in self.tallied.values():
            engine.flush()
        return []


class _StateCollector(Collector):
    """Gauges and state counters, read from the engines when scraped."""

    def __init__(self, metrics: SchedulerMetrics, engines: Seq[EngineLoop]):
        self.metrics = metrics
        self.engines = engines

    def describe(self):
        return []  # computed at collect time: nothing to check for name clashes up front

    def collect(self):
        labels = list(LABELS)
        running = GaugeMetricFamily("vllm:num_requests_running", "Number of requests in model execution batches.",
                                    labels=labels)
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                                    labels=labels)
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                                  labels=labels)
        cache_info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                       labels=["block_size", "enable_prefix_caching", "engine", "num_gpu_blocks"])
        queries = CounterMetricFamily("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.", labels=labels)
        hits = CounterMetricFamily("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                                   labels=labels)
        preemptions = CounterMetricFamily("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                                          labels=labels)
        used = GaugeMetricFamily("stormserve:kv_blocks_used", "KV blocks held by sequences on the worker.",
                                 labels=labels)
        free = GaugeMetricFamily("stormserve:kv_blocks_free",
                                 "KV blocks a sequence can get now (free or evictable prefix-cache blocks).",
                                 labels=labels)
        healthy = GaugeMetricFamily("stormserve:worker_healthy",
                                    "1 while the worker is serving and its KV state known, else 0.",
                                    labels=labels + ["worker"])
        drafts = CounterMetricFamily("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", labels=labels)
        draft_tokens = CounterMetricFamily("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                                           labels=labels)
        accepted = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                                       labels=labels)
        waits = CounterMetricFamily(
            "stormserve:spec_decode_waits",
            "Times a sequence was not planned ahead so that it could draft from its next token.", labels=labels)
        for index, engine in enumerate(self.engines):
            label = engine.metrics.label if engine.metrics is not None else str(index)
            values = [self.metrics.model_name, label]
            policy = engine.policy
            healthy.add_metric(values + [engine.worker.address], 1.0 if engine.is_ready else 0.0)
            counts = engine.cache_counts()
            speculator = engine.speculator
            for family, count in ((queries, counts[0]), (hits, counts[1]), (preemptions, counts[2]),
                                  (drafts, speculator.num_drafts), (draft_tokens, speculator.num_draft_tokens),
                                  (accepted, speculator.num_accepted_tokens), (waits, speculator.num_waits)):
                family.add_metric(values, count, created=engine.created_s)
            if policy is None:
                continue
            num_running = len(policy.running)
            running.add_metric(values, num_running)
            waiting.add_metric(values, policy.num_unfinished - num_running)
            total = policy.blocks.num_blocks
            num_free = policy.num_free_blocks
            usage.add_metric(values, 1.0 - num_free / total if total else 0.0)
            used.add_metric(values, total - num_free)
            free.add_metric(values, num_free)
            cache_info.add_metric([str(policy.blocks.block_size), "True", label, str(total)], 1.0)
        yield from (running, waiting, usage, cache_info, queries, hits, preemptions, used, free, healthy,
                    drafts, draft_tokens, accepted, waits)
