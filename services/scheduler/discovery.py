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
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from services.scheduler.engine import EngineLoop
from services.scheduler.router import Router

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Endpoint:
    key: str  # the pod's UID, or the address when the endpoint names no pod
    address: str  # host:port of the worker's gRPC port
    ready: bool
    terminating: bool

    @property
    def draining(self) -> bool:
        return self.terminating or not self.ready


def merge_slices(slices: Iterable[dict], port: str = "") -> dict[str, Endpoint]:
    """The endpoints of all `slices` (EndpointSlice JSON objects) by key.

    `port` picks the worker port in each slice: a number, a port name, or ""
    for the slice's first port. A slice without that port is skipped; so are
    FQDN slices. An endpoint in several slices (while one moves) counts as
    ready if any of them says so."""
    merged: dict[str, Endpoint] = {}
    for item in slices:
        if item.get("addressType", "IPv4") not in ("IPv4", "IPv6"):
            continue
        number = _slice_port(item, port)
        if number is None:
            continue
        for ep in item.get("endpoints") or []:
            addresses = ep.get("addresses") or []
            if not addresses:
                continue
            host = addresses[0]
            address = f"[{host}]:{number}" if ":" in host else f"{host}:{number}"
            uid = (ep.get("targetRef") or {}).get("uid")
            conditions = ep.get("conditions") or {}
            # The API: an unset `ready` is unknown and should be read as ready; unset `terminating` is false.
            found = Endpoint(key=uid or address, address=address,
                             ready=conditions.get("ready") is not False,
                             terminating=conditions.get("terminating") is True)
            known = merged.get(found.key)
            if known is None or (known.draining and not found.draining):
                merged[found.key] = found
    return merged


def _slice_port(item: dict, wanted: str) -> int | None:
    ports = [p for p in item.get("ports") or [] if p.get("port")]
    if wanted.isdigit():
        return int(wanted)
    if not wanted:
        return ports[0]["port"] if ports else None
    return next((p["port"] for p in ports if p.get("name") == wanted), None)


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
