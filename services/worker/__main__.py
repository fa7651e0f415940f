"""python -m services.worker: load the model, warm up, serve WorkerService."""
from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket

from services.common.config import load_config
from services.common.grpc_server import GrpcService
from services.common import tracing
from services.common.log import setup_logging
from services.common.metrics import process_registry, serve_metrics_in_thread
from services.common.supervisor import exit_with_supervisor
from services.common.tls import InternalTls
from services.worker.config import WorkerConfig
from services.worker.follower import build_runner
from services.worker.kv_transfer import KVTransfer, KVTransferUnavailable
from services.worker.model_runner import ModelRunner
from services.worker.parallel import TensorParallel
from services.worker.platforms import select_platform
from services.worker.pods import PodGroup
from services.worker.server import WorkerServicer
from services.worker.step_channel import serve_step_channel
from stormserve.worker.v1 import worker_pb2, worker_pb2_grpc


def load_runner(config: WorkerConfig) -> ModelRunner:
    """Blocking: pick the device, start the other ranks of a tensor-parallel
    group (here, or in the other pods of a group that spans pods), resolve and
    load the model, warm it up."""
    pods = PodGroup.from_env(os.environ, config.group_port)
    if pods is not None and not pods.is_leader:
        raise ValueError(f"this pod is worker {pods.index} of its group: it runs services.worker.follower")
    local_ranks = pods.ranks_per_pod(config.tensor_parallel_size) if pods else config.tensor_parallel_size
    platform = select_platform(config.device)
    platform.set_num_threads(config.num_threads, local_ranks)
    platform.set_activations(config.activations)
    group = TensorParallel.start(config, platform, pods) if config.tensor_parallel_size > 1 else None
    runner = build_runner(config, platform, group)
    runner.warm_up()
    return runner


def start_transfer(config: WorkerConfig, runner: ModelRunner) -> KVTransfer:
    """A prefill or decode worker's transfer engine over its KV pool. Raises
    ValueError (the worker then refuses to start) where it cannot run."""
    if config.tensor_parallel_size > 1:
        raise ValueError(f"role {config.role} with tensor_parallel_size > 1: KV transfer of sharded pools "
                         "is not supported yet")
    host = config.kv_transfer_host or config.host
    if host in ("0.0.0.0", "::"):
        host = os.environ.get("POD_IP") or socket.gethostbyname(socket.gethostname())
    try:
        return KVTransfer(runner.kv_pool, host, runner.kv_pool.caches[0].device.type,
                          timeout_s=config.kv_transfer_timeout_s)
    except KVTransferUnavailable as exc:
        raise ValueError(str(exc)) from None


# A draining worker stays up this long with nothing to run, so that the scheduler
# (health polled every second) has seen NOT_SERVING before it goes: a sequence
# placed here just before that still gets served.
DRAIN_SETTLE_S = 2.0


async def serve(config: WorkerConfig, log: logging.Logger) -> None:
    tls = InternalTls.of(config)
    service = GrpcService("worker", config.host, config.port, config.drain_timeout_s, tls, config.health_port)
    if config.metrics_port:
        serve_metrics_in_thread(process_registry(config.serving_group), config.host, config.metrics_port)
    servicer = WorkerServicer(drain=service.drain)
    service.add(
        worker_pb2_grpc.add_WorkerServiceServicer_to_server,
        servicer,
        worker_pb2.DESCRIPTOR.services_by_name["WorkerService"],
    )
    # Listen first (health answers NOT_SERVING while loading), then load off the loop.
    await service.start()
    steps = await serve_step_channel(servicer, config.host, config.step_port, tls)
    try:
        await servicer.load(functools.partial(load_runner, config))
        if config.role != "both":
            servicer.attach_transfer(config.role, start_transfer(config, servicer.runner))
            log.info("role %s: KV blocks move with Mooncake's transfer engine", config.role)
    except ValueError as exc:  # a model, format or setting refused by name: one line, not a traceback
        log.critical("cannot serve %s: %s", config.model_path or "the bundled model", exc)
        await service.server.stop(0)
        raise SystemExit(2) from None
    await service.set_serving(True)
    log.info("serving on port %d, steps also on port %d", service.port, servicer.step_port)
    await service.serve_forever(servicer.is_idle, DRAIN_SETTLE_S)
    steps.close()
    servicer.close()


def main() -> None:
    exit_with_supervisor()
    config = load_config(WorkerConfig)
    log = setup_logging("worker")
    tracing.setup("worker")
    log.info("config: %s", config)
    asyncio.run(serve(config, log))


if __name__ == "__main__":
    main()
