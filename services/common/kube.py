"""LIST + WATCH of one Service's EndpointSlices through the Kubernetes API, and
the endpoints they list: how the scheduler finds its workers and a tokenizer
its serving groups' schedulers.

A small direct client over httpx rather than `kubernetes`, `kubernetes_asyncio`
or `kr8s`: each service needs one read-only call pattern on one resource type,
inside its asyncio loop. `kubernetes` blocks (its watch would need a thread
feeding the loop); `kubernetes_asyncio` and `kr8s` are async but bring a large
generated model layer (or a second HTTP stack) and their own reconnect logic,
while what matters here — re-list on every reconnect and on 410 Gone, backoff,
a periodic full resync, keep the last known state while the API server is away —
must be ours and visible anyway. httpx is already a dependency; the wire format
(EndpointSliceList, newline-delimited watch events) is stable API.

In-cluster configuration as client-go's rest.InClusterConfig: the API server at
https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT, the service-account
token (re-read on every connection: kubelet rotates it) and CA. For tests and
out-of-cluster use, STORMSERVE_KUBE_API_URL names another API server (plain
http allowed; the token is sent only if the service-account file exists).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import ssl
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import httpx

log = logging.getLogger(__name__)
logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per watch and list

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
API_URL_ENV = "STORMSERVE_KUBE_API_URL"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
# A full re-list this often even when the watch looks healthy: a safety net
# against a lost event (the watch is also asked to end then, timeoutSeconds).
RESYNC_S = 300.0
BACKOFF_MIN_S = 0.5
BACKOFF_MAX_S = 30.0
# A watch that ends sooner than this after its list counts as a failure (backoff).
HEALTHY_WATCH_S = 5.0

# The slices of the Service, by name, each as the API's JSON object.
Slices = dict[str, dict]


class KubeApiError(Exception):
    """The API server refused a call or answered something unreadable."""

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.code = code


class Gone(KubeApiError):
    """410: the resourceVersion is too old to watch from; list again."""


class KubeConfigError(Exception):
    """No API server to talk to (not in a cluster, no override)."""


@dataclass(frozen=True)
class KubeApi:
    base_url: str
    namespace: str
    token_path: Path | None = None
    ca_path: Path | None = None

    @classmethod
    def from_environment(cls, namespace: str = "", environ=None,
                         account_dir: Path = SERVICE_ACCOUNT_DIR) -> KubeApi:
        environ = os.environ if environ is None else environ
        token = account_dir / "token"
        ca = account_dir / "ca.crt"
        if not namespace:
            ns_file = account_dir / "namespace"
            if not ns_file.exists():
                raise KubeConfigError(f"no worker namespace given and no {ns_file} (not in a pod?)")
            namespace = ns_file.read_text().strip()
        if url := environ.get(API_URL_ENV):
            return cls(url.rstrip("/"), namespace, token if token.exists() else None,
                       ca if ca.exists() and url.startswith("https:") else None)
        host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            raise KubeConfigError(f"not in a cluster: KUBERNETES_SERVICE_HOST/PORT unset (or set {API_URL_ENV})")
        if ":" in host:  # IPv6
            host = f"[{host}]"
        return cls(f"https://{host}:{port}", namespace, token, ca)

    def slices_path(self) -> str:
        return f"/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices"

    def headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self.token_path is not None:
            headers["Authorization"] = "Bearer " + self.token_path.read_text().strip()
        return headers

    def client(self) -> httpx.AsyncClient:
        verify: ssl.SSLContext | bool = True
        if self.ca_path is not None:
            verify = ssl.create_default_context(cafile=str(self.ca_path))
        # read=None: a watch is silent between events; RESYNC_S bounds it instead.
        return httpx.AsyncClient(base_url=self.base_url, verify=verify, trust_env=False,
                                 timeout=httpx.Timeout(10.0, read=None))


class EndpointSliceWatcher:
    """Keeps the current EndpointSlices of one Service and calls `on_change`
    with all of them after every list and every watch event.

    LIST, then WATCH from the list's resourceVersion. Whenever the watch ends —
    dropped connection, the resync interval, HTTP 410 or an ERROR event with
    code 410, any failure — it lists again (with backoff after failures), so a
    missed event is repaired by the next list. While the API server cannot be
    reached, the last known slices stand: `on_change` is not called."""

    log = log  # the service's own module may log as itself (a subclass)

    def __init__(self, api: KubeApi, service: str, on_change: Callable[[Slices], Awaitable[None]],
                 resync_s: float = RESYNC_S, backoff_min_s: float = BACKOFF_MIN_S,
                 backoff_max_s: float = BACKOFF_MAX_S, healthy_watch_s: float = HEALTHY_WATCH_S):
        self.api = api
        self.service = service
        self.on_change = on_change
        self.resync_s = resync_s
        self.backoff_min_s = backoff_min_s
        self.backoff_max_s = backoff_max_s
        self.healthy_watch_s = healthy_watch_s
        self.slices: Slices = {}
        self.num_lists = 0  # successful ones
        self.last_error: str | None = None

    async def run(self) -> None:
        delay = self.backoff_min_s
        loop = asyncio.get_running_loop()
        async with self.api.client() as client:
            while True:
                started = loop.time()
                failed = False
                try:
                    version = await self._list(client)
                    async with asyncio.timeout(self.resync_s + 5):
                        await self._watch(client, version)
                    self.log.info("watch of %s ended; listing again", self.service)
                except TimeoutError:
                    self.log.info("resync of %s", self.service)
                except Gone as exc:
                    self.log.info("watch of %s: %s; listing again", self.service, exc)
                except (httpx.HTTPError, KubeApiError, ValueError, KeyError, TypeError, OSError) as exc:
                    failed = True
                    self.last_error = f"{type(exc).__name__}: {exc}"
                    self.log.warning("EndpointSlices of %s: %s; keeping the %d slices known, retrying in %.1f s",
                                self.service, self.last_error, len(self.slices), delay)
                except Exception as exc:  # noqa: BLE001 - a bug here must not end discovery for good
                    failed = True
                    self.last_error = f"{type(exc).__name__}: {exc}"
                    self.log.exception("EndpointSlices of %s: unexpected error; retrying in %.1f s", self.service, delay)
                if failed or loop.time() - started < self.healthy_watch_s:
                    await asyncio.sleep(delay * random.uniform(0.8, 1.2))
                    delay = min(delay * 2, self.backoff_max_s)
                else:
                    delay = self.backoff_min_s

    def _params(self) -> dict[str, str]:
        return {"labelSelector": f"{SERVICE_NAME_LABEL}={self.service}"}

    async def _list(self, client: httpx.AsyncClient) -> str:
        reply = await client.get(self.api.slices_path(), params=self._params(), headers=self.api.headers())
        if reply.status_code != 200:
            raise _error(reply.status_code, reply.text)
        body = reply.json()
        self.slices = {item["metadata"]["name"]: item for item in body.get("items") or []}
        self.num_lists += 1
        self.last_error = None
        version = body["metadata"]["resourceVersion"]
        self.log.info("listed %d EndpointSlices of %s at resourceVersion %s", len(self.slices), self.service, version)
        await self.on_change(dict(self.slices))
        return version

    async def _watch(self, client: httpx.AsyncClient, version: str) -> None:
        params = {**self._params(), "watch": "1", "resourceVersion": version, "allowWatchBookmarks": "true",
                  "timeoutSeconds": str(int(self.resync_s))}
        async with client.stream("GET", self.api.slices_path(), params=params,
                                 headers=self.api.headers()) as reply:
            if reply.status_code != 200:
                raise _error(reply.status_code, (await reply.aread()).decode(errors="replace"))
            async for line in reply.aiter_lines():
                if line.strip():
                    await self._event(json.loads(line))

    async def _event(self, event: dict) -> None:
        kind, obj = event["type"], event["object"]
        if kind == "ERROR":
            raise _error(obj.get("code"), obj.get("message", ""))
        if kind == "BOOKMARK":
            return
        name = obj["metadata"]["name"]
        if kind in ("ADDED", "MODIFIED"):
            self.slices[name] = obj
        elif kind == "DELETED":
            self.slices.pop(name, None)
        else:
            raise KubeApiError(f"unknown watch event type {kind!r}")
        await self.on_change(dict(self.slices))


@dataclass(frozen=True)
class Endpoint:
    key: str  # the pod's UID, or the address when the endpoint names no pod
    address: str  # host:port of the endpoint (the port picked in merge_slices)
    ready: bool
    terminating: bool

    @property
    def draining(self) -> bool:
        return self.terminating or not self.ready


def merge_slices(slices: Iterable[dict], port: str = "") -> dict[str, Endpoint]:
    """The endpoints of all `slices` (EndpointSlice JSON objects) by key.

    `port` picks the port in each slice: a number, a port name, or ""
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


def _error(code: int | None, text: str) -> KubeApiError:
    message = text
    try:
        message = json.loads(text).get("message", text)
    except (ValueError, AttributeError):
        pass
    message = f"{code}: {message[:300]}"
    return Gone(message, code) if code == 410 else KubeApiError(message, code)
