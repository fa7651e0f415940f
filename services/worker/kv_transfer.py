"""Moving whole KV blocks from this worker's pool into a peer's pool, with
Mooncake's transfer engine (the `mooncake-transfer-engine` wheels).

What a transfer is. kv_cache.py lays each cache tensor out as [num_layers,
num_slots, ...] with slot = block * block_size + offset, so one block of one
layer is one contiguous run of `block_bytes`, layer l starts `layer_stride`
bytes after layer l - 1, and blocks b..b+n-1 of a layer are one run of n x
block_bytes. Both pools register their cache tensors with their engine once;
`send_blocks` then writes, for every cache tensor and layer, each run of
consecutive (src, dst) block pairs as one (local address, remote address,
length) entry of one batch transfer (several past MAX_BATCH_ENTRIES entries),
straight from the registered local memory into the registered remote memory:
no staging copy, no tensor through Python. The sender pushes; the receiver's engine accepts writes only
inside memory it registered, so a wrong address fails the transfer rather
than landing in the peer's heap.

Addressing. Engines find each other by P2P handshake (metadata server
"P2PHANDSHAKE": no etcd, no Mooncake master): a peer is addressed by its
session id "host:rpc_port" (`describe().session`), and the first transfer to
it fetches its segment description over that port. What a sender needs of a
receiver is `PoolDescriptor`: the session, and per cache tensor its base
address, layer stride and block size in bytes; the scheduler carries it from
the decode worker to the prefill worker with the reserved block ids.

Transport by platform: cpu -> tcp (what the tests run); cuda -> rdma where
the host has RDMA devices (/sys/class/infiniband), else tcp, and the CUDA
build of the wheel (the -non-cuda build cannot read device memory);
npu -> ascend (the -npu build).

Failures. `send_blocks` blocks until the whole batch is acknowledged (it
releases the GIL: call it from a worker thread, not an event loop) and
raises KVTransferError when any entry fails: the peer is gone (fails within
milliseconds), it rejects an address, or it does not acknowledge within the
engine's timeout (MC_TRANSFER_TIMEOUT, which Mooncake reads when an engine is
constructed, at least 5 s, plus 1 ns per byte moved). After a timed-out
transfer bytes already on the wire may still land in the destination blocks
once the peer resumes (seen with a stopped peer): recompute into those same
blocks, or keep them out of the free list until the peer is known dead;
never hand them to another sequence at once.

How this differs from the connectors the same engine serves:
- vLLM's MooncakeConnector couples transfer and scheduling in the engine: the
  decode instance's worker sends the prefill worker its registered base
  addresses and block ids per request over a ZMQ side channel (found through
  a bootstrap server), and prefill worker threads push them with
  batch_transfer_sync_write. Here the scheduler owns both pools' block tables
  and reserves the destination blocks itself, and hands the prefill worker the
  peer's descriptor with the step: no side channel, no bootstrap server.
- vllm-ascend's (and MindIE's memory pool) run the same engine with the
  "ascend" protocol; MindIE's own prefill/decode path moves KV with Ascend's
  LLM-DataDist links, managed by its MS controller, not with Mooncake.
- Unlike vLLM's, nothing here is per layer or overlapped with the forward:
  a whole prefilled prefix moves after its prefill step, in one batch.
"""
from __future__ import annotations

import importlib
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Sequence

from services.worker.kv_cache import KVCachePool

log = logging.getLogger(__name__)

P2P_HANDSHAKE = "P2PHANDSHAKE"
# The wheel each platform needs: the -non-cuda build's TCP transport reads
# only host memory, the CUDA build stages device memory, the -npu build has
# the ascend transport.
PACKAGES = {"cpu": "mooncake-transfer-engine-non-cuda", "cuda": "mooncake-transfer-engine",
            "npu": "mooncake-transfer-engine-npu"}
# Mooncake clamps MC_TRANSFER_TIMEOUT to at least this many seconds.
MIN_TIMEOUT_S = 5
# Entries per batch: the TCP transport queues a bounded number of transfers per
# peer (MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER) and fails a batch beyond it at
# once ("TCP lane queue-full"): 2,100 entries passed, 2,500 failed (0.3.13.post1).
# Sparse blocks over many layers reach that (2 caches x 32 layers x 64 runs);
# larger batches go as several, one after another.
MAX_BATCH_ENTRIES = 1024


class KVTransferUnavailable(RuntimeError):
    """The transfer engine cannot run here: disaggregation is refused at start."""


class KVTransferError(RuntimeError):
    """A transfer failed or timed out: its destination blocks hold no usable KV."""

    def __init__(self, message: str, *, peer: str, timed_out: bool, elapsed_s: float):
        super().__init__(message)
        self.peer, self.timed_out, self.elapsed_s = peer, timed_out, elapsed_s


@dataclass(frozen=True)
class CacheRegion:
    """One registered cache tensor: block b of layer l starts at
    address + l * layer_stride + b * block_bytes."""

    address: int
    layer_stride: int
    block_bytes: int


@dataclass(frozen=True)
class PoolDescriptor:
    """What a peer needs to write into this pool."""

    session: str  # "host:rpc_port" of the engine's P2P handshake
    num_layers: int
    num_blocks: int  # the scheduler's block ids: 0 .. num_blocks - 1
    regions: tuple[CacheRegion, ...]  # K then V (latent then rope for MLA)

    def to_dict(self) -> dict:
        return {"session": self.session, "num_layers": self.num_layers, "num_blocks": self.num_blocks,
                "regions": [[r.address, r.layer_stride, r.block_bytes] for r in self.regions]}

    @classmethod
    def from_dict(cls, data: dict) -> PoolDescriptor:
        return cls(data["session"], data["num_layers"], data["num_blocks"],
                   tuple(CacheRegion(*r) for r in data["regions"]))


@dataclass(frozen=True)
class TransferResult:
    num_bytes: int
    elapsed_s: float
    num_entries: int  # (src, dst, length) entries of the batch


def transport_for(platform: str) -> str:
    """Mooncake's protocol for a platform name (Platform.name)."""
    if platform == "npu":
        return "ascend"
    if platform == "cuda":
        return "rdma" if _has_rdma_devices() else "tcp"
    return "tcp"


def _has_rdma_devices() -> bool:
    try:
        return bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        return False


def block_runs(src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src, dst, count) runs of block pairs consecutive on both sides, in src
    order: the pairs (3, 10), (4, 11), (5, 12), (9, 0) give (3, 10, 3), (9, 0, 1)."""
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"{len(src_blocks)} source blocks for {len(dst_blocks)} destination blocks")
    if len(set(dst_blocks)) != len(dst_blocks):
        raise ValueError("a destination block appears twice")
    runs: list[tuple[int, int, int]] = []
    for src, dst in sorted(zip(src_blocks, dst_blocks)):
        if runs:
            first_src, first_dst, count = runs[-1]
            if src == first_src + count and dst == first_dst + count:
                runs[-1] = (first_src, first_dst, count + 1)
                continue
        runs.append((src, dst, 1))
    return runs


def _import_engine(platform: str):
    package = PACKAGES.get(platform, PACKAGES["cpu"])
    try:
        return importlib.import_module("mooncake.engine")
    except ImportError as exc:  # absent, or present without its native libraries (libibverbs.so.1)
        raise KVTransferUnavailable(
            f"prefill/decode disaggregation needs Mooncake's transfer engine (pip package {package}), "
            f"which cannot be imported: {exc}") from exc


class KVTransfer:
    """This worker's end of KV transfers: an engine, its pool registered once."""

    def __init__(self, pool: KVCachePool, hostname: str, platform: str = "cpu", *,
                 timeout_s: float = 30.0, protocol: str | None = None):
        """`hostname` the address peers reach this worker on (the pod IP);
        `timeout_s` how long a transfer may go unacknowledged (at least 5 s)."""
        module = _import_engine(platform)
        caches = pool.caches
        if caches[0].device.type == "cuda" and not getattr(module, "SUPPORT_CUDA", False):
            raise KVTransferUnavailable(f"the installed Mooncake build cannot read CUDA memory: "
                                        f"install {PACKAGES['cuda']} rather than {PACKAGES['cpu']}")
        for cache in caches:
            if not cache.is_contiguous():
                raise ValueError("a KV cache tensor is not contiguous: its blocks have no fixed stride")
        self.pool = pool
        self.protocol = protocol or transport_for(platform)
        self.timeout_s = max(MIN_TIMEOUT_S, math.ceil(timeout_s))
        self._engine = _new_engine(module, self.timeout_s)
        if self._engine.initialize(hostname, P2P_HANDSHAKE, self.protocol, "") != 0:
            raise KVTransferUnavailable(f"Mooncake's transfer engine did not start on {hostname} "
                                        f"with the {self.protocol} transport (see its log above)")
        self.session = f"{hostname}:{self._engine.get_rpc_port()}"
        self._registered: list[int] = []
        for cache in caches:
            address, size = cache.data_ptr(), cache.numel() * cache.element_size()
            if self._engine.register_memory(address, size) != 0:
                self.close()
                raise KVTransferUnavailable(f"Mooncake could not register {size} bytes of KV cache "
                                            f"for the {self.protocol} transport")
            self._registered.append(address)
        self._descriptor = self._describe()
        log.info("KV transfer: %s engine at %s, %d cache tensors registered (%.1f MiB), timeout %d s",
                 self.protocol, self.session, len(caches),
                 sum(c.numel() * c.element_size() for c in caches) / 2**20, self.timeout_s)

    def _describe(self) -> PoolDescriptor:
        spec = self.pool.spec
        regions = []
        for cache in self.pool.caches:
            element = cache.element_size()
            regions.append(CacheRegion(cache.data_ptr(), cache.stride(0) * element,
                                       cache.stride(1) * element * spec.block_size))
        return PoolDescriptor(self.session, spec.num_layers, self.pool.num_blocks, tuple(regions))

    def describe(self) -> PoolDescriptor:
        return self._descriptor

    def send_blocks(self, remote: PoolDescriptor, src_blocks: Sequence[int],
                    dst_blocks: Sequence[int]) -> TransferResult:
        """Write local blocks src_blocks[i] of every layer into the peer's blocks
        dst_blocks[i]; returns once the peer acknowledged all of it. The step
        that wrote the source blocks must have finished (on a device, synchronized)."""
        local = self._descriptor
        self._check_compatible(remote)
        runs = block_runs(src_blocks, dst_blocks)
        for src, dst, count in runs:
            if src < 0 or src + count > local.num_blocks:
                raise ValueError(f"source block {src}..{src + count - 1} is outside this pool's {local.num_blocks}")
            if dst < 0 or dst + count > remote.num_blocks:
                raise ValueError(f"destination block {dst}..{dst + count - 1} is outside the peer's {remote.num_blocks}")
        sources: list[int] = []
        targets: list[int] = []
        lengths: list[int] = []
        for mine, theirs in zip(local.regions, remote.regions):
            for layer in range(local.num_layers):
                base, remote_base = mine.address + layer * mine.layer_stride, theirs.address + layer * theirs.layer_stride
                for src, dst, count in runs:
                    sources.append(base + src * mine.block_bytes)
                    targets.append(remote_base + dst * theirs.block_bytes)
                    lengths.append(count * mine.block_bytes)
        num_bytes = sum(lengths)
        start = time.perf_counter()
        status, chunk_start = 0, start
        for first in range(0, len(lengths), MAX_BATCH_ENTRIES):
            chunk, chunk_start = slice(first, first + MAX_BATCH_ENTRIES), time.perf_counter()
            status = self._engine.batch_transfer_sync_write(remote.session, sources[chunk], targets[chunk],
                                                            lengths[chunk])
            if status != 0:
                break
        elapsed = time.perf_counter() - start
        if status != 0:
            # Mooncake gives up on a batch after timeout_s (+1 ns per byte) without ack.
            timed_out = elapsed - (chunk_start - start) >= self.timeout_s
            raise KVTransferError(
                f"KV transfer of {len(src_blocks)} blocks ({num_bytes} bytes) to {remote.session} "
                f"{'timed out' if timed_out else 'failed'} after {elapsed:.3f} s (Mooncake status {status})",
                peer=remote.session, timed_out=timed_out, elapsed_s=elapsed)
        return TransferResult(num_bytes, elapsed, len(lengths))

    def _check_compatible(self, remote: PoolDescriptor) -> None:
        local = self._descriptor
        if remote.num_layers != local.num_layers or len(remote.regions) != len(local.regions):
            raise ValueError(f"the peer's pool has {remote.num_layers} layers x {len(remote.regions)} caches, "
                             f"this one {local.num_layers} x {len(local.regions)}")
        for mine, theirs in zip(local.regions, remote.regions):
            if mine.block_bytes != theirs.block_bytes:
                raise ValueError(f"the peer's blocks are {theirs.block_bytes} bytes, this pool's {mine.block_bytes}: "
                                 f"block size, heads, head_dim and dtype must match")

    def close(self) -> None:
        """Unregister the pool; the engine stops when it is collected."""
        for address in self._registered:
            self._engine.unregister_memory(address)
        self._registered.clear()


def _new_engine(module, timeout_s: int):
    """A TransferEngine whose sync transfers give up after timeout_s: Mooncake
    reads MC_TRANSFER_TIMEOUT in the engine's constructor only."""
    previous = os.environ.get("MC_TRANSFER_TIMEOUT")
    os.environ["MC_TRANSFER_TIMEOUT"] = str(timeout_s)
    try:
        return module.TransferEngine()
    finally:
        if previous is None:
            del os.environ["MC_TRANSFER_TIMEOUT"]
        else:
            os.environ["MC_TRANSFER_TIMEOUT"] = previous
