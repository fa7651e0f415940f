"""KV blocks moved between two real pools in two OS processes by Mooncake's
TCP transport: byte-exact, only where asked, and failures that surface."""
from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from services.worker import kv_transfer
from services.worker.kv_cache import KVCachePool, KVCacheSpec, LatentLayout
from services.worker.kv_transfer import (KVTransfer, KVTransferError, KVTransferUnavailable, PoolDescriptor,
                                         block_runs)

NUM_BLOCKS = 12
SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)


def _pool(seed: int, num_blocks: int = NUM_BLOCKS) -> KVCachePool:
    pool = KVCachePool(SPEC, num_blocks, torch.device("cpu"), reserved_blocks=1)
    generator = torch.Generator().manual_seed(seed)
    for cache in pool.caches:
        cache.copy_(torch.randn(cache.shape, generator=generator))
    return pool


def _blocks(cache: torch.Tensor, block: int) -> torch.Tensor:
    """Block `block` of every layer: [num_layers, block_size, heads, head_dim]."""
    return cache[:, block * SPEC.block_size:(block + 1) * SPEC.block_size]


# A receiving worker in its own process: its own pool (the same seeded
# contents as _pool) and engine; prints its descriptor, then on each line of
# stdin saves its K and V to that path and answers "saved".
PEER = """
import json, sys, torch
from services.worker.kv_transfer import KVTransfer
from tests.unit.worker.test_kv_transfer import _pool
pool = _pool(int(sys.argv[1]))
transfer = KVTransfer(pool, "127.0.0.1")
print(json.dumps(transfer.describe().to_dict()), flush=True)
for line in sys.stdin:
    torch.save([cache.clone() for cache in pool.caches], line.strip())
    print("saved", flush=True)
"""


class Peer:
    def __init__(self, seed: int, workdir):
        self.workdir = workdir
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.process = subprocess.Popen([sys.executable, "-c", PEER, str(seed)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)

    def descriptor(self) -> PoolDescriptor:
        line = self.process.stdout.readline()
        assert line, "the peer did not start"
        return PoolDescriptor.from_dict(json.loads(line))

    def caches(self) -> list[torch.Tensor]:
        path = self.workdir / f"caches-{self.process.pid}.pt"
        self.process.stdin.write(f"{path}\n")
        self.process.stdin.flush()
        assert self.process.stdout.readline().strip() == "saved"
        return torch.load(path)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)
            self.process.kill()
        self.process.wait(10)


@pytest.fixture(scope="module")
def peers(tmp_path_factory):
    """Two receiving processes (started together: each pays torch's import):
    one kept, one to kill or stop."""
    try:
        importlib.import_module("mooncake.engine")
    except ImportError as exc:  # skipped where it is not installed, except under CI=true
        (pytest.fail if os.environ.get("CI") == "true" else pytest.skip)(f"Mooncake's transfer engine: {exc}")
    workdir = tmp_path_factory.mktemp("kv_transfer")
    started = [Peer(seed=1, workdir=workdir), Peer(seed=2, workdir=workdir)]
    try:
        yield [(peer, peer.descriptor()) for peer in started]
    finally:
        for peer in started:
            peer.stop()


@pytest.fixture(scope="module")
def sender(peers):
    pool = _pool(seed=0)
    transfer = KVTransfer(pool, "127.0.0.1", timeout_s=5)
    yield pool, transfer
    transfer.close()


def test_runs_coalesce_consecutive_pairs_on_both_sides():
    assert block_runs([3, 4, 5, 9], [10, 11, 12, 0]) == [(3, 10, 3), (9, 0, 1)]
    assert block_runs([5, 3, 4], [12, 10, 11]) == [(3, 10, 3)]  # order of the pairs is free
    assert block_runs([1, 2], [5, 7]) == [(1, 5, 1), (2, 7, 1)]  # consecutive on one side only
    assert block_runs([], []) == []
    with pytest.raises(ValueError, match="twice"):
        block_runs([1, 2], [3, 3])
    with pytest.raises(ValueError, match="2 source blocks for 1"):
        block_runs([1, 2], [3])


def test_blocks_land_exactly_in_the_chosen_slots_and_nowhere_else(peers, sender):
    pool, transfer = sender
    (peer, remote), _ = peers
    before = peer.caches()
    src, dst = [2, 3, 4, 7, 11], [0, 1, 2, 9, 5]
    result = transfer.send_blocks(remote, src, dst)

    assert result.num_bytes == len(src) * SPEC.bytes_per_block
    # Runs (2->0 x3), (7->9), (11->5); for each of K and V, each layer.
    assert result.num_entries == 3 * 2 * SPEC.num_layers and result.elapsed_s > 0
    after = peer.caches()
    for local, old, new in zip(pool.caches, before, after):
        for s, d in zip(src, dst):
            assert torch.equal(_blocks(new, d), _blocks(local, s))
        untouched = [b for b in range(NUM_BLOCKS + 1) if b not in dst]  # + the reserved block
        for b in untouched:
            assert torch.equal(_blocks(new, b), _blocks(old, b))


def test_a_batch_past_the_engines_queue_goes_as_several(peers):
    """Every other block of 2 layers x an MLA pool's two caches (latent and rope,
    blocks of different sizes): 2,400 entries, more than the TCP transport
    queues for one peer; two engines in this process."""
    spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=6, block_size=1, dtype=torch.float32,
                       latent=LatentLayout(kv_lora_rank=4, rope_dim=2, per_head_values=12))
    pools = [KVCachePool(spec, 1200, torch.device("cpu")) for _ in range(2)]
    for cache in pools[0].caches:
        cache.copy_(torch.randn(cache.shape))
    source, target = (KVTransfer(pool, "127.0.0.1") for pool in pools)
    blocks = list(range(0, 1200, 2))
    result = source.send_blocks(target.describe(), blocks, blocks)
    assert result.num_entries == 2400 > kv_transfer.MAX_BATCH_ENTRIES
    for sent, received in zip(pools[0].caches, pools[1].caches):
        assert torch.equal(received[:, 0::2], sent[:, 0::2]) and not received[:, 1::2].any()
    source.close(), target.close()


def test_a_mismatched_or_out_of_range_request_is_refused_before_sending(peers, sender):
    _, transfer = sender
    (_, remote), _ = peers
    with pytest.raises(ValueError, match="outside the peer's"):
        transfer.send_blocks(remote, [0], [NUM_BLOCKS])
    with pytest.raises(ValueError, match="outside this pool's"):
        transfer.send_blocks(remote, [NUM_BLOCKS], [0])
    other = PoolDescriptor(remote.session, remote.num_layers, remote.num_blocks,
                           tuple(kv_transfer.CacheRegion(r.address, r.layer_stride, r.block_bytes * 2)
                                 for r in remote.regions))
    with pytest.raises(ValueError, match="must match"):
        transfer.send_blocks(other, [0], [0])
    assert transfer.send_blocks(remote, [], []).num_bytes == 0


def test_a_write_outside_the_peers_registered_pool_fails(peers, sender):
    _, transfer = sender
    (_, remote), _ = peers
    # A descriptor that lies about the peer's addresses: its engine refuses the write.
    shifted = PoolDescriptor(remote.session, remote.num_layers, remote.num_blocks,
                             tuple(kv_transfer.CacheRegion(r.address + (1 << 40), r.layer_stride, r.block_bytes)
                                   for r in remote.regions))
    with pytest.raises(KVTransferError, match="failed") as failure:
        transfer.send_blocks(shifted, [0], [0])
    assert not failure.value.timed_out and failure.value.peer == remote.session


def test_a_dead_peer_fails_at_once(peers, sender):
    # (A stopped peer is not tested: a small write the peer's kernel buffers may
    # complete or time out, depending on when the stop lands.)
    _, transfer = sender
    _, (victim, remote) = peers
    transfer.send_blocks(remote, [0, 1], [0, 1])  # connected
    os.kill(victim.process.pid, signal.SIGKILL)
    victim.process.wait(10)
    start = time.monotonic()
    with pytest.raises(KVTransferError, match="failed") as failure:
        transfer.send_blocks(remote, [0], [0])
    assert not failure.value.timed_out and time.monotonic() - start < 3


def test_without_the_engine_disaggregation_is_refused_with_the_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # import raises ImportError
    with pytest.raises(KVTransferUnavailable, match="mooncake-transfer-engine-non-cuda.*cannot be imported"):
        KVTransfer(_pool(seed=0, num_blocks=2), "127.0.0.1")
    with pytest.raises(KVTransferUnavailable, match="mooncake-transfer-engine-npu"):
        KVTransfer(_pool(seed=0, num_blocks=2), "127.0.0.1", platform="npu")


def test_transport_follows_the_platform(monkeypatch):
    assert kv_transfer.transport_for("cpu") == "tcp"
    assert kv_transfer.transport_for("npu") == "ascend"
    monkeypatch.setattr(kv_transfer, "_has_rdma_devices", lambda: True)
    assert kv_transfer.transport_for("cuda") == "rdma"
    monkeypatch.setattr(kv_transfer, "_has_rdma_devices", lambda: False)
    assert kv_transfer.transport_for("cuda") == "tcp"
