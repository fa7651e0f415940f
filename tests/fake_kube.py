"""A fake Kubernetes API server that serves discovery.k8s.io/v1 EndpointSlices,
for tests: standalone (standard library only), plain HTTP, in a thread.

It speaks the real wire format of the two calls a client of EndpointSlices
makes:

- LIST   GET /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices
         [?labelSelector=key=value[,key=value]]
  -> {"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
      "metadata": {"resourceVersion": "N"}, "items": [EndpointSlice, ...]}
  (also GET /apis/discovery.k8s.io/v1/endpointslices for all namespaces)
- WATCH  the same path with ?watch=1&resourceVersion=N[&allowWatchBookmarks=true]
         [&timeoutSeconds=S]
  -> 200, chunked, one JSON event per line:
     {"type": "ADDED"|"MODIFIED"|"DELETED", "object": EndpointSlice}
     {"type": "BOOKMARK", "object": {"kind": "EndpointSlice", "apiVersion": ...,
                                      "metadata": {"resourceVersion": "N"}}}
     {"type": "ERROR", "object": Status}   (code 410 for a compacted version)
  A watch from a resourceVersion older than the last `compact()` gets 410:
  an ERROR event in the stream (what a real API server sends), or an HTTP 410
  Status reply if `gone_as_http` is set (which a client must take the same
  way); `compact()` also ends the open watches with that ERROR event (as a
  watch that fell behind the cache is). A client watches from the version its
  list returned, so for a new watch to get 410 the compaction must come
  between the list and the watch: `before_next_watch(kube.compact)`.

Anything else answers 404 with a Status body. Each slice's resourceVersion is
the global counter at its last change, as etcd's.

Use:

    kube = FakeKube().start()            # kube.url -> http://127.0.0.1:PORT
    kube.put_slice("default", endpoint_slice("workers-abc", "workers",
                   [slice_endpoint("10.0.0.1", uid="pod-1")], port=50053))
    kube.put_slice(...)                  # again, same name: MODIFIED
    kube.delete_slice("default", "workers-abc")
    kube.drop_watches()                  # close every open watch stream
    kube.set_slices_quietly("default", [...])  # change without events (lost events)
    kube.compact()                       # open watches end with an ERROR 410 event;
                                         # a watch from an older version gets 410
    kube.before_next_watch(fn)           # fn() when the next watch request comes,
                                         # before it is answered (between a list and its watch)
    kube.stop(); kube.start()            # the API server away, then back (same port)

Counters `num_lists`, `num_watches` and `num_gone` (410s sent, as HTTP or as an
ERROR event), and `requests`, each (method, path with query, HTTP status), let a
test see what a client did and what it was answered.
"""
from __future__ import annotations

import copy
import json
import threading
import time
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

API_VERSION = "discovery.k8s.io/v1"
PREFIX = "/apis/discovery.k8s.io/v1"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"


def slice_endpoint(address: str, uid: str | None = None, ready: bool = True, serving: bool | None = None,
                   terminating: bool = False, pod_name: str | None = None, namespace: str = "default") -> dict:
    """One entry of an EndpointSlice's `endpoints`, as the EndpointSlice controller writes it."""
    ep: dict = {
        "addresses": [address],
        "conditions": {"ready": ready, "serving": ready if serving is None else serving,
                       "terminating": terminating},
    }
    if uid is not None:
        ep["targetRef"] = {"kind": "Pod", "namespace": namespace, "name": pod_name or f"pod-{uid}", "uid": uid}
    return ep


def endpoint_slice(name: str, service: str, endpoints: list[dict], port: int, port_name: str = "grpc",
                   namespace: str = "default", address_type: str = "IPv4") -> dict:
    """An EndpointSlice of `service` (labelled kubernetes.io/service-name) with one TCP port."""
    return {
        "kind": "EndpointSlice",
        "apiVersion": API_VERSION,
        "metadata": {"name": name, "namespace": namespace, "labels": {SERVICE_NAME_LABEL: service},
                     "generateName": f"{service}-"},
        "addressType": address_type,
        "endpoints": endpoints,
        "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
    }


def status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


class FakeKube:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, bookmark_interval_s: float = 5.0):
        self.host, self.port = host, port
        self.bookmark_interval_s = bookmark_interval_s
        self.gone_as_http = False
        self.num_lists = 0
        self.num_watches = 0
        self.num_gone = 0
        self.requests: list[tuple[str, str, int]] = []
        self._version = 1
        self._slices: dict[tuple[str, str], dict] = {}  # (namespace, name) -> slice
        # Changes since the last compaction: (version, type, object).
        self._events: list[tuple[int, str, dict]] = []
        self._oldest = 1  # a watch from a version below this gets 410
        self._drops = 0  # bumped by drop_watches
        self._compactions = 0  # bumped by compact
        self._before_next_watch: Callable[[], None] | None = None
        self._cond = threading.Condition()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def resource_version(self) -> int:
        return self._version

    def start(self) -> FakeKube:
        fake = self

        class Handler(_Handler):
            kube = fake

        self._server = ThreadingHTTPServer((self.host, self.port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-kube", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Close the listening socket and every open watch (the port can be reused by start)."""
        if self._server is None:
            return
        self.drop_watches()
        self._server.shutdown()
        self._server.server_close()
        self._server = None

    def __enter__(self) -> FakeKube:
        return self.start() if self._server is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- changing the state --------------------------------------------------

    def put_slice(self, namespace: str, obj: dict) -> int:
        """Create or replace a slice (ADDED or MODIFIED); returns its resourceVersion."""
        obj = copy.deepcopy(obj)
        name = obj["metadata"]["name"]
        with self._cond:
            self._version += 1
            known = self._slices.get((namespace, name))
            meta = obj["metadata"]
            meta["namespace"] = namespace
            meta["resourceVersion"] = str(self._version)
            meta["uid"] = known["metadata"]["uid"] if known else str(uuid.uuid4())
            meta.setdefault("creationTimestamp", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
            self._slices[(namespace, name)] = obj
            self._events.append((self._version, "MODIFIED" if known else "ADDED", copy.deepcopy(obj)))
            self._cond.notify_all()
            return self._version

    def delete_slice(self, namespace: str, name: str) -> None:
        with self._cond:
            obj = self._slices.pop((namespace, name))
            self._version += 1
            obj = copy.deepcopy(obj)
            obj["metadata"]["resourceVersion"] = str(self._version)
            self._events.append((self._version, "DELETED", obj))
            self._cond.notify_all()

    def set_slices_quietly(self, namespace: str, slices: list[dict]) -> None:
        """Replace a namespace's slices without any watch event, as if the events
        were lost: only a re-list shows the change."""
        with self._cond:
            for key in [k for k in self._slices if k[0] == namespace]:
                del self._slices[key]
            for obj in slices:
                obj = copy.deepcopy(obj)
                self._version += 1
                obj["metadata"].update(namespace=namespace, resourceVersion=str(self._version),
                                       uid=str(uuid.uuid4()))
                self._slices[(namespace, obj["metadata"]["name"])] = obj

    def drop_watches(self) -> None:
        """End every open watch stream (as a restarting API server or a load balancer would)."""
        with self._cond:
            self._drops += 1
            self._cond.notify_all()

    def compact(self) -> None:
        """Forget the history: every open watch ends with an ERROR event of code
        410 (too old resource version), and a new watch from any version before
        now gets 410."""
        with self._cond:
            self._version += 1
            self._events.clear()
            self._oldest = self._version
            self._compactions += 1
            self._cond.notify_all()

    def before_next_watch(self, fn: Callable[[], None]) -> None:
        """Call `fn` once, when the next watch request arrives and before it is
        answered: what `fn` changes happened between the client's list and its
        watch (with `compact`, that watch's version is already too old)."""
        with self._cond:
            self._before_next_watch = fn

    def slices(self, namespace: str) -> list[dict]:
        with self._cond:
            return [copy.deepcopy(v) for (ns, _), v in sorted(self._slices.items()) if ns == namespace]

    # --- serving ---------------------------------------------------------------

    def _matching(self, obj: dict, namespace: str | None, selector: dict[str, str]) -> bool:
        meta = obj["metadata"]
        labels = meta.get("labels") or {}
        return ((namespace is None or meta.get("namespace") == namespace)
                and all(labels.get(k) == v for k, v in selector.items()))


def _parse_selector(text: str) -> dict[str, str]:
    """Equality label selectors only (`a=b,c==d`), which is what EndpointSlice clients use."""
    selector = {}
    for term in filter(None, (t.strip() for t in text.split(","))):
        key, _, value = term.replace("==", "=").partition("=")
        selector[key.strip()] = value.strip()
    return selector


class _Handler(BaseHTTPRequestHandler):
    kube: FakeKube
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args) -> None:  # quiet
        pass

    def send_response(self, code: int, message: str | None = None) -> None:
        self.kube.requests.append((self.command, getattr(self, "path", ""), code))
        super().send_response(code, message)

    def _send_json(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        kube = self.kube
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        parts = url.path.rstrip("/").split("/")
        namespace: str | None
        if url.path.rstrip("/") == PREFIX + "/endpointslices":
            namespace = None
        elif (url.path.startswith(PREFIX + "/namespaces/") and len(parts) == 7
              and parts[6] == "endpointslices"):
            namespace = parts[5]
        else:
            self._send_json(404, status(404, "NotFound", f"the server could not find the requested resource {url.path}"))
            return
        selector = _parse_selector(query.get("labelSelector", ""))
        if query.get("watch") in ("1", "true"):
            self._watch(namespace, selector, query)
        else:
            self._list(namespace, selector)

    def _list(self, namespace: str | None, selector: dict[str, str]) -> None:
        kube = self.kube
        with kube._cond:
            kube.num_lists += 1
            items = [copy.deepcopy(v) for _, v in sorted(kube._slices.items())
                     if kube._matching(v, namespace, selector)]
            version = kube._version
        self._send_json(200, {"kind": "EndpointSliceList", "apiVersion": API_VERSION,
                              "metadata": {"resourceVersion": str(version)}, "items": items})

    def _watch(self, namespace: str | None, selector: dict[str, str], query: dict[str, str]) -> None:
        kube = self.kube
        try:
            since = int(query.get("resourceVersion") or 0)
        except ValueError:
            self._send_json(400, status(400, "BadRequest", "invalid resourceVersion"))
            return
        bookmarks = query.get("allowWatchBookmarks") in ("1", "true")
        timeout = float(query["timeoutSeconds"]) if "timeoutSeconds" in query else None
        with kube._cond:
            before, kube._before_next_watch = kube._before_next_watch, None
        if before is not None:
            before()
        with kube._cond:
            kube.num_watches += 1
            drops, compactions = kube._drops, kube._compactions
            too_old = 0 < since < kube._oldest
            kube.num_gone += too_old
            gone = status(410, "Expired", f"too old resource version: {since} ({kube._oldest})")
        if too_old and kube.gone_as_http:
            self._send_json(410, gone)
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            if too_old:
                self._chunk({"type": "ERROR", "object": gone})
                return
            cursor = since if since else kube._version  # "0"/unset: from now (no initial ADDED events)
            ends = time.monotonic() + timeout if timeout else None
            next_bookmark = time.monotonic() + kube.bookmark_interval_s
            while True:
                with kube._cond:
                    kube._cond.wait_for(
                        lambda: kube._drops != drops or kube._server is None or kube._compactions != compactions
                        or any(v > cursor for v, _, _ in kube._events),
                        timeout=0.2)
                    if kube._drops != drops or kube._server is None:
                        return
                    expired = kube._compactions != compactions
                    events = [(v, t, o) for v, t, o in kube._events if v > cursor]
                    version = kube._version
                for v, kind, obj in events:
                    cursor = v
                    if kube._matching(obj, namespace, selector):
                        self._chunk({"type": kind, "object": obj})
                if expired:
                    with kube._cond:
                        kube.num_gone += 1
                    self._chunk({"type": "ERROR", "object": status(
                        410, "Expired", f"too old resource version: {cursor} ({kube._oldest})")})
                    return
                now = time.monotonic()
                if bookmarks and now >= next_bookmark:
                    cursor = max(cursor, version)
                    self._chunk({"type": "BOOKMARK", "object": {
                        "kind": "EndpointSlice", "apiVersion": API_VERSION,
                        "metadata": {"resourceVersion": str(cursor)}}})
                    next_bookmark = now + kube.bookmark_interval_s
                if ends is not None and now >= ends:
                    return
        except (BrokenPipeError, ConnectionResetError):
            return
        finally:
            try:
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except OSError:
                pass
            self.close_connection = True

    def _chunk(self, event: dict) -> None:
        data = json.dumps(event).encode() + b"\n"
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Serve EndpointSlices from a JSON file of slices (a list).")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--namespace", default="default")
    parser.add_argument("slices", nargs="?", help="JSON file: a list of EndpointSlice objects")
    args = parser.parse_args()
    kube = FakeKube(port=args.port).start()
    if args.slices:
        with open(args.slices) as f:
            for item in json.load(f):
                kube.put_slice(args.namespace, item)
    print(kube.url, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        kube.stop()
