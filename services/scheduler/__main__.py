"""python -m services.scheduler: run the SchedulerService."""
from __future__ import annotations

import asyncio
import gc

from services.common.config import load_config
from services.common.grpc_server import GrpcService
from services.common import tracing
from services.common.log import setup_logging
from services.common.metrics import serve_metrics
from services.common.supervisor import exit_with_supervisor
from services.common.tls import InternalTls
from services.scheduler.config import SchedulerConfig
from services.scheduler.discovery import WorkerPool, merge_slices
from services.scheduler.engine import EngineLoop, LoopSlices
from services.scheduler.kube import EndpointSliceWatcher, KubeApi, KubeConfigError
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.router import Router
from services.scheduler.server import SchedulerServicer
from services.scheduler.worker_client import WorkerClient
from stormserve.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

READY_POLL_S = 0.5
# The step loop allocates a few short-lived objects per token: with the default
# thresholds (700, 10, 10) a young collection ran every 700 of them, and every
# tenth one went on to the older objects. Measured (bench.scheduler_throughput,
# 16 x 64): 309 -> 263-277 us of CPU a step; no collection at all gained nothing more.
GC_THRESHOLDS = (10_000, 10, 10)


async def main() -> None:
    exit_with_supervisor()
    config = load_config(SchedulerConfig)
    log = setup_logging("scheduler")
    tracing.setup("scheduler")

    # Off when metrics_port is 0: then nothing is recorded. The collector reads the
    # router's list of engines, which discovery changes in place.
    router = Router([])
    tls = InternalTls.of(config)
    metrics = (SchedulerMetrics(config.model_name, config.max_seq_len, router.engines, config.serving_group)
               if config.metrics_port else None)

    router.handoff.transfer_timeout_s, router.handoff.metrics = config.kv_transfer_timeout_s, metrics

    slices = LoopSlices()  # shared: the engines take turns in the event loop's iterations

    def make_engine(address: str) -> EngineLoop:
        engine = EngineLoop(WorkerClient(address, tls), config.max_batch_size, config.max_prefill_tokens,
                            config.speculation, slices, config.max_decode_steps)
        if metrics is not None:
            engine.metrics = metrics.engine()  # its `engine` label, from the workers in the router now
        return engine

    discovered = config.worker_discovery == "endpointslices"
    engines: list[EngineLoop] = []  # the static list, each in the router before the next is made
    for address in () if discovered else config.worker_addresses:
        engines.append(make_engine(address))
        router.add(engines[-1])
    if metrics is not None:
        await serve_metrics(metrics.registry, config.host, config.metrics_port)
    pool = WorkerPool(router, make_engine)
    watcher = None
    if discovered:
        try:
            api = KubeApi.from_environment(config.worker_namespace)
        except KubeConfigError as exc:
            raise SystemExit(f"worker_discovery=endpointslices: {exc}") from exc

        async def on_slices(slices) -> None:
            await pool.apply(merge_slices(slices.values(), config.worker_port))

        watcher = EndpointSliceWatcher(api, config.worker_service, on_slices)
        log.info("workers: the EndpointSlices of service %s/%s at %s", api.namespace, config.worker_service,
                 api.base_url)
    service = GrpcService("scheduler", config.host, config.port, config.drain_timeout_s, tls, config.health_port)
    service.add(
        scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server,
        SchedulerServicer(config, router, service.drain, metrics),
        scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"],
    )
    await service.start()
    gc.collect()
    gc.freeze()  # what start-up built lives as long as the process: no collection walks it again
    gc.set_threshold(*GC_THRESHOLDS)
    for engine in engines:
        engine.start()
    watching = asyncio.create_task(watcher.run()) if watcher is not None else None

    async def track_readiness() -> None:
        serving = None
        while True:
            now = bool(router.ready_engines)
            if now != serving:
                serving = now
                await service.set_serving(now)
                log.info("serving: %s (%d/%d workers ready)", now, len(router.ready_engines), len(router.engines))
            await asyncio.sleep(READY_POLL_S)

    tracker = asyncio.create_task(track_readiness())
    await service.serve_forever()
    tracker.cancel()
    if watching is not None:
        watching.cancel()
    await pool.stop()
    for engine in engines:
        await engine.stop()


if __name__ == "__main__":
    asyncio.run(main())
