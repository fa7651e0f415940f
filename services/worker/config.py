"""The worker's one typed config: flags, environment (STORMSERVE_*), defaults."""
from __future__ import annotations

from dataclasses import dataclass

from services.common.config import require, setting
from services.common.drain import check_drain_timeout, drain_timeout_setting
from services.common.metrics import check_serving_group, serving_group_setting
from services.common.tls import InternalTlsSettings, check_internal_tls, health_port_setting

DEVICES = ("auto", "cpu", "cuda", "npu")
DTYPES = ("auto", "bfloat16", "float16", "float32")
ACTIVATIONS = ("auto", "int8", "bfloat16")
GRAPHS = ("auto", "off")
ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True)
class WorkerConfig(InternalTlsSettings):
    """stormserve worker: runs the model one engine step at a time."""

    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(50053, "gRPC port (0 picks a free one)")
    metrics_port: int = setting(0, "HTTP port of the Prometheus /metrics endpoint (process metrics); 0 = off")
    step_port: int = setting(0, "TCP port of the step channel, where the scheduler sends steps as frames (the "
                                "port Describe reports; 0 picks a free one)")
    serving_group: str = serving_group_setting()
    model_path: str = setting(
        "", "HF model directory or .gguf file; empty = bundled SmolLM2-135M-Instruct",
        alias="modelWeightPath",
    )
    device: str = setting("auto", "auto, cpu, cuda or npu (auto: cuda, then npu, then cpu)")
    dtype: str = setting(
        "auto", "weight and KV cache dtype: auto, bfloat16, float16 or float32 "
        "(auto: bfloat16, or float32 on a CPU without native bfloat16)",
    )
    cache_block_size: int = setting(
        16, "tokens per KV cache block (fused paged attention: 128 to 512 on NPU, a multiple of 16 on CUDA)",
        alias="cacheBlockSize",
    )
    kv_cache_mib: int = setting(
        0, "memory budget of the KV cache pool in MiB; 0 = room for maxBatchSize sequences of maxSeqLen "
        "tokens, within half the memory available at start (CPU) or 80 %% of the free device memory",
    )
    max_batch_size: int = setting(64, "most sequences in one step", alias="maxBatchSize")
    max_seq_len: int = setting(2560, "prompt + output cap in tokens (sizes the automatic KV budget)",
                               alias="maxSeqLen")
    num_threads: int = setting(
        0, "torch intra-op CPU threads of the worker, split evenly between its tensor-parallel ranks "
        "(at least one each); 0 = the cores it may use (its CPU affinity, capped by its cgroup's CPU quota)")
    tensor_parallel_size: int = setting(
        1, "ranks (processes, one device each) the model is split over; rank 0 serves. In a group of pods "
        "(LeaderWorkerSet: LWS_GROUP_SIZE > 1) the whole group's: each pod runs tensor_parallel_size / "
        "LWS_GROUP_SIZE of them", alias="tensorParallelSize",
    )
    group_port: int = setting(
        29500, "a group of pods (LWS_GROUP_SIZE > 1): the leader pod's port of the group's rendezvous "
        "(torch.distributed's TCP store); rank 0's step channel takes the next one")
    drain_timeout_s: float = drain_timeout_setting()
    health_port: int = health_port_setting()
    activations: str = setting(
        "auto", "activations of 4-bit weights on CPU (a Q4 GGUF, AWQ, GPTQ, W4A16): int8 (quantized per row "
        "and group of 32, integer dot products, as llama.cpp does), bfloat16, or auto (int8 where the CPU has "
        "AVX2 or VNNI and a C compiler built the kernels)")
    graphs: str = setting(
        "auto", "decode steps replayed from device graphs captured at start: auto (on CUDA and Ascend, for the "
        "models whose steps can be captured) or off (every step eager)")
    speculative_method: str = setting(
        "off", "the scheduler's setting of the same name; mtp: load the checkpoint's multi-token prediction "
        "module and return its draft with each sampled token")
    role: str = setting(
        "both", "prefill, decode or both: a prefill worker computes prompts and sends their KV to a decode "
        "worker (SendBlocks, Mooncake's transfer engine), which goes on from there")
    kv_transfer_host: str = setting(
        "", "the address other workers' transfer engines reach this one's on (role prefill or decode); empty: "
        "host, or the pod's IP (POD_IP) where host is 0.0.0.0")
    kv_transfer_timeout_s: float = setting(30.0, "how long a KV transfer may go unacknowledged before it fails")

    def __post_init__(self) -> None:
        require(0 <= self.port <= 65535, f"port must be in [0, 65535], got {self.port}")
        require(0 <= self.metrics_port <= 65535, f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        require(0 <= self.step_port <= 65535, f"step_port must be in [0, 65535], got {self.step_port}")
        check_serving_group(self.serving_group)
        require(self.device in DEVICES, f"device must be one of {DEVICES}, got {self.device!r}")
        require(self.activations in ACTIVATIONS, f"activations must be one of {ACTIVATIONS}, got {self.activations!r}")
        require(self.graphs in GRAPHS, f"graphs must be one of {GRAPHS}, got {self.graphs!r}")
        require(self.role in ROLES, f"role must be one of {ROLES}, got {self.role!r}")
        require(self.kv_transfer_timeout_s >= 5, f"kv_transfer_timeout_s must be >= 5, got {self.kv_transfer_timeout_s}")
        require(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        require(
            1 <= self.cache_block_size <= 512,
            f"cache_block_size must be in [1, 512], got {self.cache_block_size}",
        )
        require(self.kv_cache_mib >= 0, f"kv_cache_mib must be >= 0, got {self.kv_cache_mib}")
        require(self.max_seq_len >= 2, f"max_seq_len must be >= 2, got {self.max_seq_len}")
        require(self.max_batch_size >= 1, f"max_batch_size must be >= 1, got {self.max_batch_size}")
        require(self.num_threads >= 0, f"num_threads must be >= 0, got {self.num_threads}")
        require(self.tensor_parallel_size >= 1, f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        require(1 <= self.group_port <= 65534, f"group_port must be in [1, 65534], got {self.group_port}")
        check_drain_timeout(self.drain_timeout_s)
        check_internal_tls(self)
