"""python -m services.scheduler: run the SchedulerService."""
from __future__ import annotations

import asyncio

from services.common.config import load_config
from services.common.grpc_server import GrpcService
from services.common.log import setup_logging
from services.common.metrics import serve_metrics
from services.common.supervisor import exit_with_supervisor
from services.scheduler.config import SchedulerConfig
from services.scheduler.engine import EngineLoop
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.router import Router
from services.scheduler.server import SchedulerServicer
from services.scheduler.worker_client import WorkerClient
from stormserve.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

READY_POLL_S = 0.5


async def main() -> None:
    exit_with_supervisor()
    config = load_config(SchedulerConfig)
    log = setup_logging("scheduler")
    engines = [
        EngineLoop(WorkerClient(address), config.max_batch_size, config.max_prefill_tokens)
        for address in config.worker_addresses
    ]
    router = Router(engines)
    metrics = None
    if config.metrics_port:
        metrics = SchedulerMetrics(config.model_name, config.max_seq_len, engines)
        for index, engine in enumerate(engines):
            engine.metrics = metrics.engine(index)
        await serve_metrics(metrics.registry, config.host, config.metrics_port)
    service = GrpcService("scheduler", config.host, config.port)
    service.add(
        scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server,
        SchedulerServicer(config, router, metrics),
        scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"],
    )
    await service.start()
    for engine in engines:
        engine.start()

    async def track_readiness() -> None:
        serving = None
        while True:
            now = bool(router.ready_engines)
            if now != serving:
                serving = now
                await service.set_serving(now)
                log.info("serving: %s (%d/%d workers ready)", now, len(router.ready_engines), len(engines))
            await asyncio.sleep(READY_POLL_S)

    tracker = asyncio.create_task(track_readiness())
    await service.serve_forever()
    tracker.cancel()
    for engine in engines:
        await engine.stop()


if __name__ == "__main__":
    asyncio.run(main())
