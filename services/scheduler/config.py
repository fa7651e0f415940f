"""Scheduler configuration (reference names in `alias`)."""
from __future__ import annotations

from dataclasses import dataclass

from services.common.config import require, setting
from services.common.drain import check_drain_timeout, drain_timeout_setting
from services.common.metrics import check_serving_group, serving_group_setting
from services.common.tls import InternalTlsSettings, check_internal_tls, health_port_setting
from services.common.model_files import DEFAULT_MODEL_NAME
from services.scheduler.speculation import METHODS, SpeculationConfig

DEFAULT_KV_TRANSFER_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class SchedulerConfig(InternalTlsSettings):
    """Queue, continuous batching and worker routing."""

    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(50052, "gRPC port")
    worker_addresses: tuple[str, ...] = setting(
        ("127.0.0.1:50053",), "comma-separated worker host:port list (worker_discovery=static)")
    worker_discovery: str = setting(
        "static", "where workers come from: static (worker_addresses) or endpointslices (the EndpointSlices "
        "of worker_service, through the Kubernetes API)")
    worker_service: str = setting("", "the worker Service whose EndpointSlices list the workers (endpointslices)")
    worker_namespace: str = setting(
        "", "namespace of worker_service (default: the scheduler pod's own, from its service account)")
    worker_port: str = setting(
        "", "name or number of the workers' gRPC port in the EndpointSlices (default: each slice's first port)")
    max_batch_size: int = setting(64, "most sequences in one engine step", alias="maxBatchSize")
    max_prefill_tokens: int = setting(
        1024, "most prompt tokens prefilled in one step (the reference defaults to 8192; see docs: configuration)",
        alias="maxPrefillTokens",
    )
    max_decode_steps: int = setting(
        1, "most decode steps one message to a worker runs when every running sequence decodes and none waits "
        "(planned and accounted at once: several keep one scheduler up with many fast workers, and a new request "
        "waits for up to twice as many steps; at most a KV block, and what the worker offers)")
    max_seq_len: int = setting(2560, "prompt + output cap in tokens", alias="maxSeqLen")
    max_iter_times: int = setting(512, "default and upper cap of max_tokens", alias="maxIterTimes")
    max_queue_size: int = setting(4096, "most requests waiting before new ones are refused")
    drain_timeout_s: float = drain_timeout_setting()
    metrics_port: int = setting(0, "HTTP port of the Prometheus /metrics endpoint; 0 = metrics off")
    model_name: str = setting(DEFAULT_MODEL_NAME, "the served model's name: the metrics' model_name label",
                              alias="modelName")
    serving_group: str = serving_group_setting()
    speculative_method: str = setting(
        "off", "speculative decoding without a draft model: off (for the whole server), prompt_lookup (n-grams "
        "of the prompt and output), suffix (most frequent continuations in this and past outputs) or mtp (the "
        "checkpoint's multi-token prediction module, on the worker; one token a step)")
    speculative_max_draft_tokens: int = setting(8, "most tokens drafted for a sequence in one step")
    speculative_draft_token_budget: int = setting(
        24, "drafted tokens one step may carry, less one per running sequence (0 drafts from that many on)")
    health_port: int = health_port_setting()
    kv_transfer_timeout_s: float = setting(
        DEFAULT_KV_TRANSFER_TIMEOUT_S, "prefill/decode disaggregation: how long one SendBlocks call may take before it counts as failed "
        "(tried twice, then the decode worker recomputes the prompt)")

    def __post_init__(self) -> None:
        require(self.kv_transfer_timeout_s > 0, f"kv_transfer_timeout_s must be > 0, got {self.kv_transfer_timeout_s}")
        require(self.worker_discovery in ("static", "endpointslices"),
                "worker_discovery must be static or endpointslices")
        if self.worker_discovery == "static":
            require(bool(self.worker_addresses), "worker_addresses must name at least one worker")
        else:
            require(bool(self.worker_service), "worker_discovery=endpointslices needs worker_service")
        require(1 <= self.max_batch_size <= 819200, "maxBatchSize must be in [1, 819200]")
        require(1 <= self.max_prefill_tokens <= 4194304, "maxPrefillTokens must be in [1, 4194304]")
        require(1 <= self.max_decode_steps <= 64, f"max_decode_steps must be in [1, 64], got {self.max_decode_steps}")
        require(self.max_seq_len >= 2, "maxSeqLen must be >= 2")
        require(self.max_iter_times >= 1, "maxIterTimes must be >= 1")
        require(self.max_queue_size >= 1, "max_queue_size must be >= 1")
        check_drain_timeout(self.drain_timeout_s)
        require(0 <= self.metrics_port <= 65535, f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        check_serving_group(self.serving_group)
        require(self.speculative_method in METHODS, f"speculative_method must be one of {', '.join(METHODS)}")
        require(1 <= self.speculative_max_draft_tokens <= 64, "speculative_max_draft_tokens must be in [1, 64]")
        require(self.speculative_draft_token_budget >= 0, "speculative_draft_token_budget must be >= 0")
        check_internal_tls(self)

    @property
    def speculation(self) -> SpeculationConfig:
        return SpeculationConfig(self.speculative_method, self.speculative_max_draft_tokens,
                                 self.speculative_draft_token_budget)
