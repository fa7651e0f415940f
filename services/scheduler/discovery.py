"""Workers discovered from the EndpointSlices of the worker Service
(worker_discovery=endpointslices; kube.py lists and watches them).

All slices of the Service are merged into one set of endpoints keyed by pod UID
(`targetRef.uid`; the address when an endpoint names no pod), so a pod that
reuses a departed pod's IP is a new worker, not the old one back. Each change
of that set is applied to the router:

- a ready endpoint not known yet joins: an EngineLoop is started for it, and it
  takes sequences once its gRPC health is SERVING and its Describe matches the
  model of the others (EngineLoop and Router do that part);
- a known endpoint that is not ready or terminating drains: no new sequences,
  its running ones finish; it takes new ones again if it turns ready;
- an endpoint that is gone from every slice is gone: its EngineLoop stops and
  its in-flight requests end with the worker-lost error.

An endpoint seen first while not ready is not started: it joins when ready.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from services.common.kube import Endpoint, merge_slices  # noqa: F401 - merge_slices: the scheduler's too
from services.scheduler.engine import EngineLoop
from services.scheduler.router import Router

log = logging.getLogger(__name__)


class WorkerPool:
    """The discovered workers: one EngineLoop per endpoint key, kept in step
    with the endpoints that `apply` is given."""

    def __init__(self, router: Router, make_engine: Callable[[str], EngineLoop]):
        self.router = router
        self.make_engine = make_engine
        self.engines: dict[str, EngineLoop] = {}

    async def apply(self, endpoints: dict[str, Endpoint]) -> None:
        for key in [k for k in self.engines if k not in endpoints]:
            engine = self.engines.pop(key)
            address = engine.worker.address
            log.info("worker %s (%s) left the worker Service", address, key)
            self.router.remove(engine)
            await engine.retire(f"worker {address} left the worker Service")
        for key, endpoint in endpoints.items():
            engine = self.engines.get(key)
            if engine is None:
                if endpoint.draining:
                    continue  # starting up (or already leaving): it joins when ready
                log.info("worker %s (%s) joins", endpoint.address, key)
                engine = self.make_engine(endpoint.address)
                self.engines[key] = engine
                self.router.add(engine)
                engine.start()
            elif endpoint.draining != self.router.is_draining(engine):
                log.info("worker %s (%s) %s", endpoint.address, key,
                         "drains" if endpoint.draining else "is ready again")
                self.router.set_draining(engine, endpoint.draining)

    async def stop(self) -> None:
        for engine in self.engines.values():
            await engine.stop()
        self.engines.clear()
