"""`python -m services.envoy --drain`: a graceful stop, run before Envoy gets its
SIGTERM (the chart's preStop hook), since on SIGTERM alone Envoy closes its
listeners at once and cuts the streams in flight.

Over the admin interface (`envoy_admin_path` or `envoy_admin_port`, the same
settings Envoy was started with) it starts the graceful drain of Envoy's
listener: from then on every HTTP/1.1 reply says `Connection: close`
and every HTTP/2 connection gets a GOAWAY, so clients open their next
connection elsewhere, while running requests go on. Then it waits until no
request is running (or the drain timeout has passed) and returns; the SIGTERM
that follows finds nothing to cut."""
from __future__ import annotations

import logging
import time

import httpx

from services.envoy.config import EnvoyConfig

log = logging.getLogger(__name__)
# The listener's stat_prefix in deploy/envoy/envoy.yaml.j2.
ACTIVE_REQUESTS = "http.stormserve.downstream_rq_active"
POLL_S = 0.5


def admin_client(config: EnvoyConfig) -> httpx.Client:
    if config.admin_url is None:
        raise SystemExit("--drain needs Envoy's admin interface: set envoy_admin_path (or envoy_admin_port)")
    transport = httpx.HTTPTransport(uds=config.envoy_admin_path) if config.envoy_admin_path else None
    return httpx.Client(base_url=config.admin_url, transport=transport, timeout=5)


def active_requests(admin: httpx.Client) -> int:
    text = admin.get("/stats", params={"filter": f"^{ACTIVE_REQUESTS}$"}).text
    return int(text.split(":")[1]) if ":" in text else 0


def drain(config: EnvoyConfig) -> bool:
    """Start the graceful drain, then wait for the running requests; True when
    none is left before the drain timeout."""
    with admin_client(config) as admin:
        admin.post("/drain_listeners", params={"graceful": ""}).raise_for_status()
        deadline = time.monotonic() + config.drain_timeout_s
        last = None
        while (running := active_requests(admin)) and time.monotonic() < deadline:
            if running != last:
                log.info("draining: %d requests running", running)
                last = running
            time.sleep(POLL_S)
    if running:
        log.warning("drain timeout (%.0f s): %d requests still running", config.drain_timeout_s, running)
    else:
        log.info("drained: no request running")
    return not running
