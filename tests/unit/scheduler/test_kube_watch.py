"""The EndpointSlice LIST + WATCH client against the fake API server: events,
a dropped watch, 410 (an open watch's ERROR event; a new watch's ERROR event
or HTTP reply), a periodic resync, the API server away and back; and the
in-cluster configuration."""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from services.scheduler.discovery import merge_slices
from services.scheduler.kube import EndpointSliceWatcher, KubeApi, KubeConfigError
from tests.fake_kube import FakeKube, endpoint_slice, slice_endpoint

NS, SERVICE = "serving", "workers"


def one_slice(name: str, *endpoints: dict, service: str = SERVICE) -> dict:
    return endpoint_slice(name, service, list(endpoints), 50053, namespace=NS)


class Seen:
    """What the watcher reported last, as merged endpoints {uid: (ready, terminating)}."""

    def __init__(self):
        self.calls = 0
        self.endpoints: dict = {}

    async def __call__(self, slices) -> None:
        self.calls += 1
        self.endpoints = {k: (e.ready, e.terminating) for k, e in merge_slices(slices.values()).items()}


async def until(condition, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def run_watcher(kube: FakeKube, scenario, **options) -> None:
    async def main():
        seen = Seen()
        watcher = EndpointSliceWatcher(KubeApi(kube.url, NS), SERVICE, seen,
                                       **{"backoff_min_s": 0.05, "backoff_max_s": 0.2, **options})
        task = asyncio.create_task(watcher.run())
        try:
            await scenario(watcher, seen)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())


@pytest.fixture
def kube():
    with FakeKube(bookmark_interval_s=0.2) as fake:
        yield fake


def test_list_then_watch_events_with_the_service_selector(kube):
    kube.put_slice(NS, one_slice("workers-a", slice_endpoint("10.0.0.1", uid="p1")))
    kube.put_slice(NS, one_slice("other-a", slice_endpoint("10.0.9.9", uid="x"), service="other"))
    kube.put_slice("elsewhere", endpoint_slice("workers-z", SERVICE, [slice_endpoint("10.1.0.1", uid="z")], 1))

    async def scenario(watcher, seen):
        await until(lambda: seen.endpoints == {"p1": (True, False)})
        kube.put_slice(NS, one_slice("workers-b", slice_endpoint("10.0.0.2", uid="p2", ready=False)))
        await until(lambda: seen.endpoints == {"p1": (True, False), "p2": (False, False)})
        kube.put_slice(NS, one_slice("workers-b", slice_endpoint("10.0.0.2", uid="p2")))
        kube.put_slice(NS, one_slice("workers-a", slice_endpoint("10.0.0.1", uid="p1", ready=False,
                                                                  terminating=True)))
        await until(lambda: seen.endpoints == {"p1": (False, True), "p2": (True, False)})
        kube.delete_slice(NS, "workers-a")
        await until(lambda: seen.endpoints == {"p2": (True, False)})
        await asyncio.sleep(0.5)  # bookmarks come and change nothing
        assert watcher.num_lists == 1 and kube.num_watches == 1
        assert seen.endpoints == {"p2": (True, False)}

    run_watcher(kube, scenario)
    list_call = kube.requests[0][1]
    assert list_call.startswith(f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices?")
    assert "labelSelector=kubernetes.io%2Fservice-name%3Dworkers" in list_call
    assert "watch=1" in kube.requests[1][1] and "allowWatchBookmarks=true" in kube.requests[1][1]


def test_a_dropped_watch_relists_and_finds_changes_whose_events_were_lost(kube):
    kube.put_slice(NS, one_slice("workers-a", slice_endpoint("10.0.0.1", uid="p1")))

    async def scenario(watcher, seen):
        await until(lambda: seen.endpoints == {"p1": (True, False)})
        kube.set_slices_quietly(NS, [one_slice("workers-b", slice_endpoint("10.0.0.2", uid="p2"))])
        await asyncio.sleep(0.3)
        assert seen.endpoints == {"p1": (True, False)}  # no event: not seen yet
        await until(lambda: kube.num_watches == 1)
        kube.drop_watches()
        await until(lambda: seen.endpoints == {"p2": (True, False)})
        assert watcher.num_lists == 2

    run_watcher(kube, scenario)


def test_410_on_the_open_watch_relists_and_finds_the_truth(kube):
    kube.put_slice(NS, one_slice("workers-a", slice_endpoint("10.0.0.1", uid="p1")))

    async def scenario(watcher, seen):
        await until(lambda: seen.endpoints == {"p1": (True, False)} and kube.num_watches == 1)
        kube.set_slices_quietly(NS, [one_slice("workers-a", slice_endpoint("10.0.0.1", uid="p1", ready=False)),
                                     one_slice("workers-b", slice_endpoint("10.0.0.3", uid="p3"))])
        kube.compact()  # the open watch ends with an ERROR event of code 410
        await until(lambda: seen.endpoints == {"p1": (False, False), "p3": (True, False)})
        assert watcher.num_lists == 2 and kube.num_gone == 1

    run_watcher(kube, scenario)


@pytest.mark.parametrize("as_http", [False, True])
def test_410_on_a_new_watch_relists_and_finds_the_truth(kube, as_http, caplog):
    """The history compacted between a list and its watch: the watch from the
    list's version gets 410 at once, as an HTTP reply or as an ERROR event."""
    caplog.set_level(logging.INFO, logger="services.scheduler.kube")
    kube.gone_as_http = as_http
    kube.put_slice(NS, one_slice("workers-a", slice_endpoint("10.0.0.1", uid="p1")))
    truth = [one_slice("workers-a", slice_endpoint("10.0.0.1", uid="p1", ready=False)),
             one_slice("workers-b", slice_endpoint("10.0.0.3", uid="p3"))]

    def change_and_compact():
        kube.set_slices_quietly(NS, truth)
        kube.compact()

    async def scenario(watcher, seen):
        await until(lambda: seen.endpoints == {"p1": (True, False)} and kube.num_watches == 1)
        kube.before_next_watch(change_and_compact)
        kube.drop_watches()  # list 2 (nothing new), then its watch gets 410, then list 3
        await until(lambda: seen.endpoints == {"p1": (False, False), "p3": (True, False)})
        assert watcher.num_lists == 3 and kube.num_gone == 1

    run_watcher(kube, scenario)
    # The second watch was the one answered 410: as the HTTP status, or in its stream.
    watch_codes = [code for _, path, code in kube.requests if "watch=1" in path]
    assert watch_codes[:2] == [200, 410 if as_http else 200], kube.requests
    # Taken as Gone (list again), not as a failing API server.
    assert any("410" in r.getMessage() and "listing again" in r.getMessage() for r in caplog.records)
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_watch_from_a_compacted_version_gets_410_as_http_or_event(kube):
    """The fake itself: both forms of Gone a real API server uses."""
    import httpx

    kube.put_slice(NS, one_slice("workers-a", slice_endpoint("10.0.0.1", uid="p1")))
    kube.compact()
    url = kube.url + f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices"
    listed = httpx.get(url).json()
    assert listed["kind"] == "EndpointSliceList" and int(listed["metadata"]["resourceVersion"]) > 2
    assert listed["items"][0]["metadata"]["resourceVersion"] == "2"
    with httpx.stream("GET", url, params={"watch": "1", "resourceVersion": "2"}) as reply:
        assert reply.status_code == 200
        import json
        events = [json.loads(line) for line in reply.iter_lines() if line]
    assert events == [{"type": "ERROR", "object": {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": f"too old resource version: 2 ({kube.resource_version})", "reason": "Expired", "code": 410}}]
    kube.gone_as_http = True
    assert httpx.get(url, params={"watch": "1", "resourceVersion": "2"}).status_code == 410
    assert httpx.get(kube.url + "/api/v1/pods").status_code == 404


def test_a_periodic_resync_relists_without_any_error(kube):
    kube.put_slice(NS, one_slice("workers-a", slice_endpoint("10.0.0.1", uid="p1")))

    async def scenario(watcher, seen):
        await until(lambda: watcher.num_lists >= 3, timeout_s=10)
        kube.set_slices_quietly(NS, [])
        await until(lambda: seen.endpoints == {}, timeout_s=10)

    run_watcher(kube, scenario, resync_s=1.0, healthy_watch_s=0.5)


def test_the_api_server_away_keeps_the_known_workers_and_back_relists(kube):
    kube.put_slice(NS, one_slice("workers-a", slice_endpoint("10.0.0.1", uid="p1")))

    async def scenario(watcher, seen):
        await until(lambda: seen.endpoints == {"p1": (True, False)})
        calls = seen.calls
        kube.stop()
        await until(lambda: watcher.last_error is not None)  # refused connections, with backoff
        await asyncio.sleep(0.5)
        assert seen.calls == calls and seen.endpoints == {"p1": (True, False)}
        kube.set_slices_quietly(NS, [one_slice("workers-a", slice_endpoint("10.0.0.1", uid="p1")),
                                     one_slice("workers-b", slice_endpoint("10.0.0.2", uid="p2"))])
        kube.start()  # same port
        await until(lambda: seen.endpoints == {"p1": (True, False), "p2": (True, False)})
        assert watcher.last_error is None

    run_watcher(kube, scenario)


def test_api_errors_back_off_and_keep_the_known_slices(kube):
    kube.put_slice(NS, one_slice("workers-a", slice_endpoint("10.0.0.1", uid="p1")))

    async def scenario(watcher, seen):
        await until(lambda: seen.endpoints == {"p1": (True, False)})
        await until(lambda: kube.num_watches == 1)  # a drop before the watch opens would miss it
        watcher.api = KubeApi(kube.url, "forbidden/x")  # every call now answers 404
        kube.drop_watches()
        await until(lambda: watcher.last_error is not None and "404" in watcher.last_error)
        lists = kube.num_lists
        await asyncio.sleep(0.6)
        assert kube.num_lists - lists <= 6  # backoff, not a hot loop
        assert seen.endpoints == {"p1": (True, False)}

    run_watcher(kube, scenario)


def test_in_cluster_configuration(tmp_path: Path):
    (tmp_path / "token").write_text("secret-token\n")
    (tmp_path / "ca.crt").write_text("not used here")
    (tmp_path / "namespace").write_text("serving\n")
    api = KubeApi.from_environment("", {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"},
                                   tmp_path)
    assert (api.base_url, api.namespace, api.ca_path) == ("https://10.96.0.1:443", "serving", tmp_path / "ca.crt")
    assert api.headers()["Authorization"] == "Bearer secret-token"
    api = KubeApi.from_environment("other", {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "6443"},
                                   tmp_path)
    assert (api.base_url, api.namespace) == ("https://[fd00::1]:6443", "other")
    api = KubeApi.from_environment("ns", {"STORMSERVE_KUBE_API_URL": "http://127.0.0.1:8001/"}, tmp_path / "none")
    assert (api.base_url, api.token_path, api.headers().get("Authorization")) == ("http://127.0.0.1:8001", None, None)
    with pytest.raises(KubeConfigError, match="not in a cluster"):
        KubeApi.from_environment("ns", {}, tmp_path / "none")
    with pytest.raises(KubeConfigError, match="namespace"):
        KubeApi.from_environment("", {"STORMSERVE_KUBE_API_URL": "http://x"}, tmp_path / "none")


def test_a_failing_update_is_retried_by_a_fresh_list(kube):
    kube.put_slice(NS, one_slice("workers-a", slice_endpoint("10.0.0.1", uid="p1")))

    async def main():
        seen, failures = Seen(), []

        async def flaky(slices):
            if not failures:
                failures.append(1)
                raise RuntimeError("boom")
            await seen(slices)

        watcher = EndpointSliceWatcher(KubeApi(kube.url, NS), SERVICE, flaky, backoff_min_s=0.05)
        task = asyncio.create_task(watcher.run())
        try:
            await until(lambda: seen.endpoints == {"p1": (True, False)})
            assert watcher.num_lists == 2 and not task.done()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
