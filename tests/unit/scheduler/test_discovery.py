"""Workers from EndpointSlices: merging the slices into endpoints keyed by pod
UID, and the pool's state machine (join, drain, back, gone, UID reuse, resync)
on real EngineLoops and Router with fake worker clients."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from services.common.errors import WORKER_LOST
from services.scheduler.discovery import Endpoint, WorkerPool, merge_slices
from services.scheduler.engine import EngineLoop, SequenceFailed
from services.scheduler.policy import WorkerCapacity
from services.scheduler.router import Router
from services.scheduler.worker_client import WorkerHealth
from tests.fake_kube import endpoint_slice, slice_endpoint
from tests.unit.scheduler.test_policy import make_seq
from tests.unit.scheduler.streams import submit

SERVICE = "workers"


def ep(address: str, uid: str | None = None, **conditions) -> dict:
    return slice_endpoint(address, uid=uid, **conditions)


def slices(*groups: list[dict], port: int = 50053) -> list[dict]:
    return [endpoint_slice(f"{SERVICE}-{i}", SERVICE, endpoints, port) for i, endpoints in enumerate(groups)]


# --- merging ---------------------------------------------------------------------


def test_endpoints_of_several_slices_merge_by_pod_uid():
    merged = merge_slices(slices([ep("10.0.0.1", "a"), ep("10.0.0.2", "b", ready=False)],
                                 [ep("10.0.0.3", "c", ready=False, terminating=True), ep("10.0.0.4")]))
    assert merged == {
        "a": Endpoint("a", "10.0.0.1:50053", ready=True, terminating=False),
        "b": Endpoint("b", "10.0.0.2:50053", ready=False, terminating=False),
        "c": Endpoint("c", "10.0.0.3:50053", ready=False, terminating=True),
        "10.0.0.4:50053": Endpoint("10.0.0.4:50053", "10.0.0.4:50053", ready=True, terminating=False),
    }
    assert [e.draining for e in merged.values()] == [False, True, True, False]


def test_an_endpoint_in_two_slices_counts_as_ready_if_either_says_so():
    merged = merge_slices(slices([ep("10.0.0.1", "a", ready=False)], [ep("10.0.0.1", "a")]))
    assert merged["a"].ready and len(merged) == 1


def test_unset_conditions_read_as_ready_and_not_terminating():
    item = endpoint_slice("s", SERVICE, [{"addresses": ["10.0.0.9"], "targetRef": {"uid": "z"}}], 7)
    assert merge_slices([item]) == {"z": Endpoint("z", "10.0.0.9:7", ready=True, terminating=False)}


def test_the_port_is_picked_by_name_or_number_and_ipv6_is_bracketed():
    item = endpoint_slice("s", SERVICE, [ep("fd00::5", "a")], 9000, address_type="IPv6")
    item["ports"] = [{"name": "metrics", "port": 9100}, {"name": "grpc", "port": 50053}]
    assert merge_slices([item])["a"].address == "[fd00::5]:9100"  # first port by default
    assert merge_slices([item], "grpc")["a"].address == "[fd00::5]:50053"
    assert merge_slices([item], "6000")["a"].address == "[fd00::5]:6000"
    assert merge_slices([item], "http") == {}  # no such port in this slice
    item["addressType"] = "FQDN"
    assert merge_slices([item]) == {}


# --- the pool ----------------------------------------------------------------------

INFO = SimpleNamespace(model_path="/models/smol", vocab_size=100, eos_token_ids=[2])


class FakeWorkerClient:
    """Always serving; steps never answer, so whatever is placed stays in flight."""

    def __init__(self, address: str, info=INFO):
        self.address = address
        self.info = info
        self.closed = False

    async def health(self) -> WorkerHealth:
        return WorkerHealth.SERVING

    async def describe(self):
        return WorkerCapacity(num_kv_blocks=64, block_size=4, max_batch_size=8, eos_token_ids=frozenset({2})), self.info

    async def send(self, plan) -> None:
        pass

    async def receive(self):
        await asyncio.Event().wait()

    def reset(self) -> None:
        pass

    async def close(self) -> None:
        self.closed = True


def make_pool(infos: dict[str, object] | None = None):
    router = Router([])
    made: list[EngineLoop] = []

    def make_engine(address: str) -> EngineLoop:
        engine = EngineLoop(FakeWorkerClient(address, (infos or {}).get(address, INFO)), 8, 64)
        made.append(engine)
        return engine

    return router, WorkerPool(router, make_engine), made


async def until(condition, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def addresses(engines) -> list[str]:
    return [e.worker.address for e in engines]


def test_ready_endpoints_join_not_ready_drain_and_removed_ones_fail_their_requests():
    async def scenario():
        router, pool, made = make_pool()
        await pool.apply(merge_slices(slices([ep("10.0.0.1", "a"), ep("10.0.0.2", "b"),
                                              ep("10.0.0.3", "c", ready=False)])))
        # c is starting: not started until ready.
        assert addresses(router.engines) == ["10.0.0.1:50053", "10.0.0.2:50053"]
        await until(lambda: len(router.ready_engines) == 2)
        a, b = router.engines
        stream_a = submit(a, [make_seq(1)])
        stream_b = submit(b, [make_seq(2)])

        # a not ready: it drains: it keeps its sequence, gets no new ones.
        await pool.apply(merge_slices(slices([ep("10.0.0.1", "a", ready=False), ep("10.0.0.2", "b"),
                                              ep("10.0.0.3", "c")])))
        assert router.is_draining(a) and a.load == 1
        await until(lambda: len(router.ready_engines) == 2)
        assert a not in router.ready_engines
        for i in range(5):
            assert router.place([make_seq(10 + i)]) is not a

        # Terminating drains too; ready again takes work again.
        await pool.apply(merge_slices(slices([ep("10.0.0.1", "a"), ep("10.0.0.2", "b", ready=False, terminating=True),
                                              ep("10.0.0.3", "c")])))
        assert not router.is_draining(a) and router.is_draining(b)

        # b is gone: only its request fails, with the worker-lost error.
        await pool.apply(merge_slices(slices([ep("10.0.0.1", "a"), ep("10.0.0.3", "c")])))
        assert b not in router.engines and b.worker.closed
        failed = stream_b.get_nowait()
        assert isinstance(failed, SequenceFailed)
        assert failed.message == WORKER_LOST  # the address stays in the log
        assert stream_a.empty() and a.load == 1
        await pool.stop()

    asyncio.run(scenario())


def test_a_reused_ip_with_a_new_pod_uid_is_a_new_worker():
    async def scenario():
        router, pool, made = make_pool()
        await pool.apply(merge_slices(slices([ep("10.0.0.1", "old-pod")])))
        await until(lambda: len(router.ready_engines) == 1)
        old = router.engines[0]
        stream = submit(old, [make_seq(1)])
        await pool.apply(merge_slices(slices([ep("10.0.0.1", "new-pod")])))
        assert isinstance(stream.get_nowait(), SequenceFailed)  # the old pod's state is gone
        assert len(router.engines) == 1 and router.engines[0] is not old and old.worker.closed
        assert pool.engines.keys() == {"new-pod"}
        await until(lambda: len(router.ready_engines) == 1)
        await pool.stop()

    asyncio.run(scenario())


def test_a_resync_applies_the_whole_truth_at_once():
    """A re-list replaces everything: missed adds, removals and drains all at once."""
    async def scenario():
        router, pool, _ = make_pool()
        await pool.apply(merge_slices(slices([ep("10.0.0.1", "a"), ep("10.0.0.2", "b")])))
        await pool.apply(merge_slices(slices([ep("10.0.0.2", "b", ready=False)], [ep("10.0.0.4", "d")])))
        assert set(pool.engines) == {"b", "d"} and router.is_draining(pool.engines["b"])
        await pool.apply({})
        assert router.engines == [] and pool.engines == {}
        await pool.stop()

    asyncio.run(scenario())


def test_a_worker_serving_another_model_does_not_join():
    async def scenario():
        other = SimpleNamespace(model_path="/models/big", vocab_size=200, eos_token_ids=[0])
        router, pool, _ = make_pool({"10.0.0.2:50053": other})
        await pool.apply(merge_slices(slices([ep("10.0.0.1", "a")])))
        await until(lambda: len(router.ready_engines) == 1)
        await pool.apply(merge_slices(slices([ep("10.0.0.1", "a"), ep("10.0.0.2", "b")])))
        await asyncio.sleep(0.3)
        assert [e.worker.address for e in router.ready_engines] == ["10.0.0.1:50053"]
        assert len(router.engines) == 2  # known, refused while its model differs
        await pool.stop()

    asyncio.run(scenario())


@pytest.mark.parametrize("draining", [True, False])
def test_get_load_lists_discovered_workers_and_their_drain(draining):
    from services.scheduler.config import SchedulerConfig
    from services.scheduler.server import SchedulerServicer
    from stormserve.scheduler.v1 import scheduler_pb2

    async def scenario():
        router, pool, _ = make_pool()
        await pool.apply(merge_slices(slices([ep("10.0.0.1", "a", ready=True), ep("10.0.0.2", "b")])))
        await until(lambda: len(router.ready_engines) == 2)
        await pool.apply(merge_slices(slices([ep("10.0.0.1", "a", ready=not draining), ep("10.0.0.2", "b")])))
        load = await SchedulerServicer(SchedulerConfig(), router).GetLoad(scheduler_pb2.GetLoadRequest(), None)
        await pool.stop()
        return load

    load = asyncio.run(scenario())
    assert [(w.address, w.is_ready, w.draining) for w in load.workers] == [
        ("10.0.0.1:50053", not draining, draining), ("10.0.0.2:50053", True, False)]  # draining: not ready
    assert load.num_workers_ready == (1 if draining else 2)


# --- settings ------------------------------------------------------------------------


def test_discovery_settings_from_the_environment():
    from services.common.config import load_config
    from services.scheduler.config import SchedulerConfig

    env = {"STORMSERVE_WORKER_DISCOVERY": "endpointslices", "STORMSERVE_WORKER_SERVICE": "stormserve-worker",
           "STORMSERVE_WORKER_NAMESPACE": "serving", "STORMSERVE_WORKER_PORT": "grpc"}
    config = load_config(SchedulerConfig, [], env)
    assert (config.worker_discovery, config.worker_service, config.worker_namespace, config.worker_port) == (
        "endpointslices", "stormserve-worker", "serving", "grpc")
    assert load_config(SchedulerConfig, [], {}).worker_discovery == "static"
    for bad in ({"STORMSERVE_WORKER_DISCOVERY": "endpointslices"}, {"STORMSERVE_WORKER_DISCOVERY": "dns"}):
        with pytest.raises(SystemExit):
            load_config(SchedulerConfig, [], bad)


def test_a_scheduler_outside_a_cluster_says_so_and_exits(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("KUBERNETES_", "STORMSERVE_"))},
           "PYTHONPATH": f"{root / 'gen'}{os.pathsep}{root}", "STORMSERVE_WORKER_DISCOVERY": "endpointslices",
           "STORMSERVE_WORKER_SERVICE": "workers", "STORMSERVE_WORKER_NAMESPACE": "serving"}
    done = subprocess.run([sys.executable, "-m", "services.scheduler", "--port", "0"], env=env, cwd=root,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "not in a cluster" in done.stderr, done.stderr[-2000:]
