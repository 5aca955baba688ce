"""KubernetesSource against tests/fakeapi.py: real HTTP through the official client."""

from __future__ import annotations

import gc
import json
import logging
import random
import socket
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator

import kubernetes.client
import pytest
from kubernetes.config import incluster_config

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from reconciler.health import node_eligible
from reconciler.sources import kubernetes as kubernetes_source
from reconciler.sources.kubernetes import (  # noqa: E402
    PROXY_LABEL_SELECTOR,
    KubernetesSource,
    load_api_client,
)
from tests.fakeapi import FakeAPIServer, endpoint_slice, node, service  # noqa: E402

NODE = "node-a"
PROXY_NAME = {"service.kubernetes.io/service-proxy-name": "other-proxy"}
HEADLESS = {"service.kubernetes.io/headless": ""}


def wait_until(pred: Callable[[], bool], timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def names(src: KubernetesSource, kind: str) -> set[str]:
    return {o.name for o in src.snapshot() if o.kind == kind}


def body(src: KubernetesSource, kind: str, name: str) -> dict[str, Any] | None:
    return next((dict(o.body) for o in src.snapshot() if o.kind == kind and o.name == name), None)


class Calls:
    def __init__(self) -> None:
        self.n = 0
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            self.n += 1


@pytest.fixture
def server() -> Iterator[FakeAPIServer]:
    srv = FakeAPIServer(bookmark_interval=0.1).start()
    yield srv
    srv.stop()


@pytest.fixture
def make_source() -> Iterator[Callable[..., KubernetesSource]]:
    started: list[KubernetesSource] = []

    def make(srv: FakeAPIServer, start: bool = True, **kw: Any) -> KubernetesSource:
        kw.setdefault("backoff_max", 0.3)
        kw.setdefault("backoff_initial", 0.05)
        api = kubernetes.client.ApiClient(kubernetes.client.Configuration(host=srv.url))
        src = KubernetesSource(api, NODE, **kw)
        started.append(src)
        if start:
            src.start()
        return src

    yield make
    for src in started:
        src.stop()


def populate(srv: FakeAPIServer) -> None:
    for name in ("a", "b", "c"):
        srv.create(service(name))
        srv.create(endpoint_slice(f"{name}-x1", name, ["10.0.0.1"]))
    srv.create(node(NODE, {"topology.kubernetes.io/zone": "zone-1"}))
    srv.create(node("node-b"))


# -- initial sync ------------------------------------------------------------------------


@pytest.mark.parametrize("held", ["Service", "EndpointSlice", "Node"])
def test_wait_synced_needs_every_initial_list(server: FakeAPIServer, make_source: Any, held: str) -> None:
    populate(server)
    server.hold_lists(held)
    calls = Calls()
    src = make_source(server, on_change=calls)
    assert not src.wait_synced(0.4)
    assert calls.n == 0
    assert held not in {o.kind for o in src.snapshot()}
    server.release_lists(held)
    assert src.wait_synced(3)
    assert {o.kind for o in src.snapshot()} == {"Service", "EndpointSlice", "Node"}
    assert wait_until(lambda: calls.n == 1)  # exactly once for the initial sync
    time.sleep(0.3)
    assert calls.n == 1


def test_snapshot_objects_are_plain_api_json(server: FakeAPIServer, make_source: Any) -> None:
    populate(server)
    src = make_source(server)
    assert src.wait_synced(3)
    objs = src.snapshot()
    assert [o.kind for o in objs] == ["Service"] * 3 + ["EndpointSlice"] * 3 + ["Node"]
    svc = next(o for o in objs if o.kind == "Service" and o.name == "a")
    assert svc.namespace == "default"
    assert str(svc.location) == "kubernetes:Service/default/a"
    assert svc.body["apiVersion"] == "v1" and svc.body["kind"] == "Service"
    assert svc.body["spec"]["clusterIP"] == "10.96.0.10"  # camelCase, as on the wire
    eps = next(o for o in objs if o.kind == "EndpointSlice")
    assert eps.body["apiVersion"] == "discovery.k8s.io/v1" and eps.body["addressType"] == "IPv4"
    # Unchanged objects come back as the very same SourceObjects (the run loop's caches rely on
    # it); a changed one is a new object.
    again = src.snapshot()
    assert all(a is b for a, b in zip(objs, again)) and len(objs) == len(again)
    server.update(service("a", port=81))
    deadline = time.monotonic() + 3
    while body(src, "Service", "a")["spec"]["ports"][0]["port"] != 81 and time.monotonic() < deadline:  # type: ignore[index]
        time.sleep(0.01)
    third = src.snapshot()
    changed = next(o for o in third if o.kind == "Service" and o.name == "a")
    assert changed is not svc and changed.body["spec"]["ports"][0]["port"] == 81
    assert all(a is b for a, b in zip(objs, third) if a.name != "a" or a.kind != "Service")


def test_the_first_list_is_answered_from_the_watch_cache(server: FakeAPIServer, make_source: Any) -> None:
    """As client-go's reflector: resourceVersion "0", which the API server answers from its watch
    cache, whole (hundreds of nodes starting at once do not each page through etcd)."""
    for i in range(7):
        server.create(service(f"svc-{i}"))
    src = make_source(server, page_size=3)
    assert src.wait_synced(3)
    assert names(src, "Service") == {f"svc-{i}" for i in range(7)}
    reqs = server.list_requests("Service")
    assert [(r.get("resourceVersion"), r.get("limit")) for r in reqs] == [("0", "3")]
    assert src.resource_version("Service") == str(server.resource_version)


def test_pagination_uses_limit_and_continue(make_source: Any) -> None:
    """Without a watch cache the server pages even a list at "0": the pages follow, each without a
    resourceVersion (the API server refuses one beside a continue token), and relists at a version
    are paged too."""
    with FakeAPIServer(bookmark_interval=None, watch_cache=False) as srv:
        for i in range(7):
            srv.create(service(f"svc-{i}"))
        src = make_source(srv, page_size=3, backoff_initial=0.01, backoff_max=0.05)
        assert src.wait_synced(3)
        assert names(src, "Service") == {f"svc-{i}" for i in range(7)}
        reqs = srv.list_requests("Service")
        assert [(r.get("resourceVersion"), r.get("limit"), bool(r.get("continue"))) for r in reqs] == [
            ("0", "3", False), (None, "3", True), (None, "3", True)]
        seen = src.resource_version("Service")
        srv.create(service("svc-7"))
        srv.compact()
        srv.close_watches()  # (no bookmarks: the watch from `seen` is 410, then a relist at it)
        assert wait_until(lambda: "svc-7" in names(src, "Service"))
        relist = srv.list_requests("Service")[3]
        assert (relist.get("resourceVersion"), relist.get("limit")) == (seen, "3")


def test_expired_continue_token_ends_in_one_whole_list(make_source: Any) -> None:
    with FakeAPIServer(watch_cache=False) as server:
        for i in range(5):
            server.create(service(f"svc-{i}"))
        first = [True]

        def compact_after_first_page(kind: str, q: dict[str, str]) -> None:
            if kind == "Service" and first[0]:
                first[0] = False
                server.delete("Service", "default", "svc-0")
                server.compact()  # the continue token handed out with this page is now too old

        server.on_list_page = compact_after_first_page
        src = make_source(server, page_size=2, backoff_initial=0.01, backoff_max=0.05)
        assert src.wait_synced(3)
        assert names(src, "Service") == {"svc-1", "svc-2", "svc-3", "svc-4"}
        pages = [(bool(q.get("continue")), q.get("limit")) for q in server.list_requests("Service")]
        # page 1, 410 Expired, then one list without pages (paging again could expire again)
        assert pages == [(False, "2"), (True, "2"), (False, None)]
        assert src.counters["errors"] == 0  # restarting the list needs no backoff
        assert src.requests.get("410") == 1  # every request counted by its status (rest_client_requests_total)
        assert src.host == server.url.split("://", 1)[1]


def test_a_version_the_server_lost_is_followed_by_a_consistent_list(make_source: Any) -> None:
    """A paged relist at the last version seen that the server has compacted away (410), as
    client-go's reflector: the list is made again without a version, at once."""
    with FakeAPIServer(bookmark_interval=None, watch_cache=False) as srv:
        for i in range(4):
            srv.create(service(f"svc-{i}"))
        src = make_source(srv, page_size=2, backoff_initial=0.01, backoff_max=0.05)
        assert src.wait_synced(3)
        seen = src.resource_version("Service")
        srv.delete("Service", "default", "svc-0")
        srv.compact()
        srv.close_watches()
        assert wait_until(lambda: "svc-0" not in names(src, "Service"))
        relists = [(q.get("resourceVersion"), bool(q.get("continue"))) for q in srv.list_requests("Service")[2:]]
        assert relists[:3] == [(seen, False), (None, False), (None, True)]  # 410, then a consistent list
        srv.create(service("svc-9"))  # and it watches from there
        assert wait_until(lambda: "svc-9" in names(src, "Service"))


def test_snapshots_stay_ordered_by_kind_namespace_name(server: FakeAPIServer, make_source: Any) -> None:
    """(The order is kept between snapshots, and sorted again only when an object comes or goes.)"""
    populate(server)
    src = make_source(server)
    assert src.wait_synced(3)

    def in_order() -> bool:
        keys = [(("Service", "EndpointSlice", "Node").index(o.kind), o.namespace, o.name) for o in src.snapshot()]
        return keys == sorted(keys)

    assert in_order()
    server.create(service("0-first", namespace="aaa"))
    server.delete("Service", "default", "b")
    server.update(endpoint_slice("a-x1", "a", ["10.0.0.9"]))
    server.create(endpoint_slice("zz", "a", ["10.0.0.8"], namespace="zzz"))
    assert wait_until(lambda: "zz" in names(src, "EndpointSlice") and "0-first" in names(src, "Service"))
    assert wait_until(lambda: "b" not in names(src, "Service"))
    assert in_order()
    # a change of one object (no object come or gone): that one is new, the others the same
    # objects in the same places (the snapshot looks at the changed ones only)
    before = src.snapshot()
    server.update(endpoint_slice("a-x1", "a", ["10.0.0.7"]))
    assert wait_until(lambda: "10.0.0.7" in str(body(src, "EndpointSlice", "a-x1")))
    after = src.snapshot()
    assert [o.key for o in after] == [o.key for o in before]
    assert [o is p for o, p in zip(after, before)] == [o.name != "a-x1" for o in before]
    # the same through a relist (every watch 410), a Service changed meanwhile
    server.expire_watches = True
    server.close_watches()
    server.update(service("c", port=8080))
    assert wait_until(lambda: src.counters["relists"] >= 3, timeout=10)
    server.expire_watches = False
    assert wait_until(lambda: body(src, "Service", "c")["spec"]["ports"][0]["port"] == 8080)  # type: ignore[index]
    again = src.snapshot()
    assert [o.key for o in again] == [o.key for o in after] and in_order()
    assert [o is p for o, p in zip(again, after)] == [o.name != "c" for o in after]


def test_only_what_a_proxy_reads_is_kept(server: FakeAPIServer, make_source: Any) -> None:
    """managedFields, the last-applied annotation, status conditions, an endpoint's targetRef: at
    10k Services the informer cache was ~2x the rest of the process. What is kept is what the
    build and the change metrics read; a change to the rest alone is no change."""
    svc = service("a")
    svc["metadata"].update(managedFields=[{"manager": "kubectl", "fieldsV1": {"f:spec": {}}}], uid="u1",
                           annotations={"kubectl.kubernetes.io/last-applied-configuration": "{...}", "team": "x"})
    svc["spec"]["selector"] = {"app": "a"}
    svc["status"] = {"conditions": [{"type": "Ready"}], "loadBalancer": {"ingress": [{"ip": "192.0.2.1"}]}}
    server.create(svc)
    eps = endpoint_slice("a-1", "a", ["10.0.0.1"])
    eps["metadata"]["annotations"] = {"endpoints.kubernetes.io/last-change-trigger-time": "2026-12-03T00:00:00Z",
                                      "other": "y"}
    eps["endpoints"][0].update(targetRef={"kind": "Pod", "name": "a-xyz", "uid": "p1"}, hostname="a-xyz",
                               nodeName=NODE, zone="zone-1", hints={"forZones": [{"name": "zone-1"}]})
    server.create(eps)
    calls = Calls()
    src = make_source(server, on_change=calls)
    assert src.wait_synced(3)
    assert wait_until(lambda: calls.n == 1)
    got = body(src, "Service", "a")
    assert got is not None and got["metadata"] == {"name": "a", "namespace": "default", "labels": {}, "annotations": {}}
    assert got["spec"]["selector"] == {"app": "a"} and got["status"] == {"loadBalancer": {"ingress": [{"ip": "192.0.2.1"}]}}
    got = body(src, "EndpointSlice", "a-1")
    assert got is not None and got["metadata"]["annotations"] == {
        "endpoints.kubernetes.io/last-change-trigger-time": "2026-12-03T00:00:00Z"}
    assert got["endpoints"] == [{"addresses": ["10.0.0.1"], "conditions": {"ready": True}, "nodeName": NODE,
                                 "zone": "zone-1", "hints": {"forZones": [{"name": "zone-1"}]}}]
    # the same from a watch event; and an update of what is not kept notifies no one
    svc["metadata"]["managedFields"] = [{"manager": "other"}]
    server.update(svc)
    server.create(service("b"))
    assert wait_until(lambda: "b" in names(src, "Service"))
    assert calls.n == 2  # (b only)
    svc["spec"]["ports"][0]["port"] = 8080
    server.update(svc)
    assert wait_until(lambda: body(src, "Service", "a")["spec"]["ports"][0]["port"] == 8080)  # type: ignore[index]
    assert "managedFields" not in body(src, "Service", "a")["metadata"]  # type: ignore[index]


def test_cached_bodies_share_their_keys_and_common_values(server: FakeAPIServer, make_source: Any) -> None:
    """The keys, and the values of the fields a cluster has few of (node names, protocols), of the
    bodies kept are one string each, whichever list or event brought them: 20k bodies held
    ~40 MiB of copies of them. An address is its own (never interned: see _shared)."""
    for name in ("a", "b"):
        slice_ = endpoint_slice(f"{name}-x1", name, ["10.0.0.1"])
        slice_["endpoints"][0]["nodeName"] = "node-with-a-long-name-" + "x" * 20
        server.create(slice_)
    server.create(node(NODE))
    src = make_source(server)
    assert src.wait_synced(3)
    slice_ = endpoint_slice("c-x1", "c", ["10.0.0.2"])
    slice_["endpoints"][0]["nodeName"] = "node-with-a-long-name-" + "x" * 20
    server.create(slice_)
    assert wait_until(lambda: "c-x1" in names(src, "EndpointSlice"))
    a, b, c = (o.body for o in src.snapshot() if o.kind == "EndpointSlice")
    for other in (b, c):
        assert all(x is y for x, y in zip(a["endpoints"][0], other["endpoints"][0]))  # (the keys)
        assert other["endpoints"][0]["nodeName"] is a["endpoints"][0]["nodeName"]
        assert other["ports"][0]["protocol"] is a["ports"][0]["protocol"]
    assert a["endpoints"][0]["addresses"][0] is not sys.intern("10.0.0.1")


@pytest.mark.parametrize("text,items,meta", [
    (b'{"kind":"ServiceList","metadata":{"resourceVersion":"7","continue":"x"},"items":[{"a":1},{"b":[2]}]}',
     [{"a": 1}, {"b": [2]}], {"resourceVersion": "7", "continue": "x"}),
    (b' {\n "items" : [ ] , "metadata" : {"resourceVersion": "8"} }\n', [], {"resourceVersion": "8"}),
    (b'{"items": null, "metadata": {}}', [], {}),
    (b'{"metadata": {"resourceVersion": "9"}}', [], {"resourceVersion": "9"}),
])
def test_a_list_is_read_item_by_item(text: bytes, items: list[Any], meta: dict[str, Any]) -> None:
    from reconciler.sources.kubernetes import _list_body

    taken: list[Any] = []
    assert _list_body(text.decode(), taken.append) == meta and taken == items
    assert taken == (json.loads(text).get("items") or [])


@pytest.mark.parametrize("text", [b"", b"[]", b'{"items": [1 2]}', b'{"items": [1,', b'{"a" 1}', b'{"a": 1',
                                  b'{"items": [1,]}', b'{"a": 1,}', b'{"a": 1} {}', b'{1: 2}', b'{"items": [], }'])
def test_a_list_that_is_no_json_object_is_an_error(text: bytes) -> None:
    from reconciler.sources.kubernetes import _list_body

    with pytest.raises(ValueError):
        _list_body(text.decode(), lambda _item: None)


# -- watch -------------------------------------------------------------------------------


def test_updates_and_deletes_reach_the_snapshot(server: FakeAPIServer, make_source: Any) -> None:
    populate(server)
    calls = Calls()
    src = make_source(server, on_change=calls)
    assert src.wait_synced(3)
    assert wait_until(lambda: calls.n == 1)
    server.update(service("a", port=8080))
    server.delete("Service", "default", "b")
    server.create(service("d", namespace="other"))
    server.update(endpoint_slice("c-x1", "c", ["10.0.0.7", "10.0.0.8"]))
    server.delete("EndpointSlice", "default", "a-x1")
    assert wait_until(lambda: names(src, "Service") == {"a", "c", "d"})
    assert wait_until(lambda: names(src, "EndpointSlice") == {"b-x1", "c-x1"})
    assert body(src, "Service", "a")["spec"]["ports"][0]["port"] == 8080  # type: ignore[index]
    eps = body(src, "EndpointSlice", "c-x1")
    assert [e["addresses"][0] for e in eps["endpoints"]] == ["10.0.0.7", "10.0.0.8"]  # type: ignore[index]
    assert {(o.namespace, o.name) for o in src.snapshot() if o.kind == "Service"} >= {("other", "d")}
    assert wait_until(lambda: calls.n == 6)
    assert src.counters["events"] == 5 and src.counters["relists"] == 0
    assert src.resource_version("Service") == str(server.resource_version - 2)


def test_objects_replaced_before_any_build_are_not_kept(server: FakeAPIServer, make_source: Any) -> None:
    """While no build takes the snapshots (an input that keeps failing), an object changed again
    and again holds only its newest version until release_bodies, which then lets that one go."""
    server.create(service("a"))
    server.create(node(NODE))
    src = make_source(server)
    assert src.wait_synced(3)
    first = next(o for o in src.snapshot() if o.kind == "Service")
    old = weakref.ref(first)
    del first
    for port in range(8081, 8086):
        server.update(service("a", port=port))
        assert wait_until(lambda: body(src, "Service", "a")["spec"]["ports"][0]["port"] == port)  # type: ignore[index]
    gc.collect()
    assert old() is None, "a replaced, never built object is still held"
    current = next(o for o in src.snapshot() if o.kind == "Service")
    src.release_bodies({id(current)})
    assert "spec" not in current.body


def with_trigger(slice_: dict[str, Any], when: str) -> dict[str, Any]:
    slice_["metadata"]["annotations"] = {"endpoints.kubernetes.io/last-change-trigger-time": when}
    return slice_


def test_change_log_counts_every_event_and_what_no_snapshot_took(server: FakeAPIServer, make_source: Any) -> None:
    """kube-proxy's change metrics: *_changes_total count events (the initial list's objects too);
    *_changes_pending: distinct Services, and EndpointSlice events, since the last take."""
    populate(server)
    src = make_source(server)
    assert src.wait_synced(3)
    assert src.changes() == (3, 3, 3, 3)
    src.take_changes()
    assert src.changes() == (3, 3, 0, 0)
    server.update(service("a", port=8080))
    server.update(service("a", port=8081))
    for i, when in enumerate(("2024-01-01T00:00:01Z", "2024-01-01T00:00:02Z", "2024-01-01T00:00:03Z")):
        server.update(with_trigger(endpoint_slice("b-x1", "b", [f"10.0.0.{i + 2}"]), when))
    server.update(with_trigger(endpoint_slice("c-x1", "c", ["10.0.0.9"]), "2024-01-01T00:00:04Z"))
    server.delete("EndpointSlice", "default", "c-x1")
    assert wait_until(lambda: src.changes()[:2] == (5, 8))
    assert src.changes() == (5, 8, 1, 5)
    times, dropped = src.take_changes()
    # one trigger time per event; a deleted slice drops its Service's (kube-proxy's tracker does)
    assert times == {("default", "b"): ["2024-01-01T00:00:01Z", "2024-01-01T00:00:02Z", "2024-01-01T00:00:03Z"]}
    assert dropped == {("default", "c")}
    assert src.changes() == (5, 8, 0, 0)


def test_selectors_match_kube_proxy(server: FakeAPIServer, make_source: Any) -> None:
    populate(server)
    server.create(service("custom", labels=PROXY_NAME))
    server.create(endpoint_slice("custom-x1", "custom", ["10.0.0.9"], labels=PROXY_NAME))
    server.create(endpoint_slice("headless-x1", "headless", ["10.0.0.5"], labels=HEADLESS))
    src = make_source(server)
    assert src.wait_synced(3)
    assert names(src, "Service") == {"a", "b", "c"}
    assert names(src, "EndpointSlice") == {"a-x1", "b-x1", "c-x1"}
    assert names(src, "Node") == {NODE}
    for q in server.list_requests("Service") + server.watch_requests("EndpointSlice"):
        assert q["labelSelector"] == PROXY_LABEL_SELECTOR
    assert server.list_requests("Node")[0]["fieldSelector"] == f"metadata.name={NODE}"
    # Relabelling moves objects in and out of the watched selection.
    server.update(service("a", labels=PROXY_NAME))
    server.update(service("custom"))
    assert wait_until(lambda: names(src, "Service") == {"b", "c", "custom"})
    server.update(node("node-b", {"new": "label"}))
    time.sleep(0.2)
    assert names(src, "Node") == {NODE}


def test_node_labels_are_in_the_snapshot(server: FakeAPIServer, make_source: Any) -> None:
    server.create(node("node-b"))
    src = make_source(server)
    assert src.wait_synced(3)
    assert names(src, "Node") == set()
    server.create(node(NODE, {"topology.kubernetes.io/zone": "zone-1"}))
    assert wait_until(lambda: names(src, "Node") == {NODE})
    obj = next(o for o in src.snapshot() if o.kind == "Node")
    assert (obj.namespace, str(obj.location)) == ("", f"kubernetes:Node//{NODE}")
    assert obj.body["metadata"]["labels"]["topology.kubernetes.io/zone"] == "zone-1"
    server.update(node(NODE, {"topology.kubernetes.io/zone": "zone-2"}))
    assert wait_until(
        lambda: body(src, "Node", NODE)["metadata"]["labels"]["topology.kubernetes.io/zone"] == "zone-2"  # type: ignore[index]
    )
    # a status update (heartbeats, conditions: every few seconds) is no change to the proxy
    before = src.snapshot()
    heartbeat = node(NODE, {"topology.kubernetes.io/zone": "zone-2"})
    heartbeat["status"] = {"conditions": [{"type": "Ready", "lastHeartbeatTime": "2026-12-02T01:00:00Z"}]}
    server.update(heartbeat)
    server.create(service("after"))  # a change behind it, to know it was seen
    assert wait_until(lambda: "after" in names(src, "Service"))
    assert next(o for o in src.snapshot() if o.kind == "Node") is next(o for o in before if o.kind == "Node")
    moved = node(NODE, {"topology.kubernetes.io/zone": "zone-2"})
    moved["status"] = {"addresses": [{"type": "InternalIP", "address": "172.30.0.9"}]}
    server.update(moved)
    assert wait_until(lambda: body(src, "Node", NODE)["status"]["addresses"] != [])  # type: ignore[index]


def test_a_deleted_node_is_kept_as_last_seen_and_marked_deleted(server: FakeAPIServer, make_source: Any) -> None:
    """kube-proxy keeps the zone and node IPs it had when its Node is deleted (routing unchanged);
    /healthz then reports the node ineligible: the snapshot keeps the Node, with a deletionTimestamp."""
    zoned = node(NODE, {"topology.kubernetes.io/zone": "zone-1"})
    zoned["status"] = {"addresses": [{"type": "InternalIP", "address": "172.30.0.9"}]}
    server.create(zoned)
    src = make_source(server)
    assert src.wait_synced(3)
    # deleted while the watch was away: the relist no longer lists it
    server.stop()
    server.delete("Node", "", NODE)
    server.compact()
    server.start()
    assert wait_until(lambda: "deletionTimestamp" in body(src, "Node", NODE)["metadata"])  # type: ignore[index]
    kept = body(src, "Node", NODE)
    assert kept["metadata"]["labels"]["topology.kubernetes.io/zone"] == "zone-1"  # type: ignore[index]
    assert kept["status"]["addresses"] == [{"type": "InternalIP", "address": "172.30.0.9"}]  # type: ignore[index]
    assert not node_eligible(kept)
    # re-created: the new one, eligible
    server.create(node(NODE, {"topology.kubernetes.io/zone": "zone-2"}))
    assert wait_until(lambda: "deletionTimestamp" not in body(src, "Node", NODE)["metadata"])  # type: ignore[index]
    assert node_eligible(body(src, "Node", NODE))
    # deleted under the watch
    server.delete("Node", "", NODE)
    assert wait_until(lambda: "deletionTimestamp" in body(src, "Node", NODE)["metadata"])  # type: ignore[index]
    assert body(src, "Node", NODE)["metadata"]["labels"]["topology.kubernetes.io/zone"] == "zone-2"  # type: ignore[index]


def test_bookmarks_advance_the_resource_version(server: FakeAPIServer, make_source: Any) -> None:
    populate(server)
    calls = Calls()
    src = make_source(server, on_change=calls)
    assert src.wait_synced(3)
    listed = int(src.resource_version("Service"))
    for i in range(5):
        server.create(endpoint_slice(f"extra-{i}", "a", ["10.1.0.1"]))
    latest = server.resource_version
    assert latest > listed
    # No Service event happened, yet the Service informer learns the newer resourceVersion.
    kinds = ("Service", "EndpointSlice", "Node")
    assert wait_until(lambda: all(int(src.resource_version(k)) >= latest for k in kinds))
    assert src.counters["bookmarks"] > 0
    assert wait_until(lambda: calls.n == 6)  # 1 sync + 5 slices; bookmarks never notify
    # So a compaction plus a watch restart resumes without relisting.
    server.compact()
    server.close_watches()
    assert wait_until(lambda: len(server.watch_requests("Service")) >= 2)
    assert server.watch_requests("Service")[-1]["resourceVersion"] == str(latest)
    time.sleep(0.2)
    assert src.counters["relists"] == 0
    assert len(server.list_requests("Service")) == 1


def test_without_bookmarks_compaction_forces_a_relist(make_source: Any) -> None:
    with FakeAPIServer(bookmark_interval=None) as srv:
        populate(srv)
        src = make_source(srv)
        assert src.wait_synced(3)
        srv.create(endpoint_slice("extra", "a", ["10.1.0.1"]))
        assert wait_until(lambda: "extra" in names(src, "EndpointSlice"))
        srv.compact()
        srv.close_watches()
        assert wait_until(lambda: len(srv.list_requests("Service")) == 2)
        assert wait_until(lambda: src.counters["relists"] >= 2)  # Service and Node were behind
        assert src.counters["bookmarks"] == 0
        assert names(src, "Service") == {"a", "b", "c"}
        src.stop()


@pytest.mark.parametrize("gone_mode", ["event", "http"])
def test_gone_relists_and_replaces_the_cache(make_source: Any, gone_mode: str) -> None:
    with FakeAPIServer(bookmark_interval=0.1, gone_mode=gone_mode) as srv:
        populate(srv)
        calls = Calls()
        src = make_source(srv, on_change=calls)
        assert src.wait_synced(3)
        assert wait_until(lambda: calls.n == 1)
        srv.stop()  # the gap: the informer misses everything below
        srv.delete("Service", "default", "b")
        srv.delete("EndpointSlice", "default", "b-x1")
        srv.update(service("a", port=9090))
        srv.create(service("d"))
        srv.compact()
        srv.start()
        assert wait_until(lambda: names(src, "Service") == {"a", "c", "d"})
        assert wait_until(lambda: names(src, "EndpointSlice") == {"a-x1", "c-x1"})
        assert body(src, "Service", "a")["spec"]["ports"][0]["port"] == 9090  # type: ignore[index]
        assert src.counters["relists"] >= 2
        assert len(srv.list_requests("Service")) == 2
        stale = srv.watch_requests("Service")[-2]["resourceVersion"]  # answered with 410
        assert int(stale) < srv.resource_version - 3
        # relisted at the last version seen, unpaged (the watch cache answers it; client-go too)
        first, relist = srv.list_requests("Service")
        assert (first.get("resourceVersion"), relist.get("resourceVersion"), relist.get("limit")) == ("0", stale, None)
        assert src.resource_version("Service") == str(srv.resource_version)
        assert calls.n >= 3  # sync + at least one change per relisted resource
        # kube-proxy counts every object a relist delivers (client-go's Replace updates each one):
        # Services a, b, c listed; then a, c, d listed and b gone: 3 + 4. Slices a-x1, b-x1, c-x1;
        # then a-x1, c-x1 listed and b-x1 gone: 3 + 3.
        assert wait_until(lambda: src.changes()[:2] == (7, 6)), src.changes()
        srv.create(service("e"))  # and the new watch works
        assert wait_until(lambda: "e" in names(src, "Service"))
        src.stop()


def test_a_refused_watch_relists(make_source: Any) -> None:
    """A watch the server refuses with an error of its own (here 504 "Too large resource
    version") is not retried from the same resourceVersion for ever: the informer lists again."""
    with FakeAPIServer(bookmark_interval=None) as srv:
        populate(srv)
        src = make_source(srv, backoff_initial=0.01, backoff_max=0.05)
        assert src.wait_synced(3)
        rv = src.resource_version("Service")
        srv.refused_rvs.add(rv)
        srv.close_watches()  # the next watch starts from the refused resourceVersion
        assert wait_until(lambda: sum(w["resourceVersion"] == rv for w in srv.watch_requests("Service")) >= 2)
        srv.create(service("late"))
        assert wait_until(lambda: "late" in names(src, "Service"))
        assert len(srv.list_requests("Service")) >= 2  # relisted (again, while the list's version is refused)
        src.stop()


def test_a_watch_gone_at_once_again_and_again_is_relisted_ever_more_slowly(make_source: Any,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """When an API server restarts, every node's watch gets its 410 at once: the relist waits (with
    client-go's jitter, which spreads the nodes), and a server that answers each new watch with 410
    again is relisted ever more slowly, not in a tight loop."""
    monkeypatch.setattr(random, "uniform", lambda a, b: a)
    with FakeAPIServer(bookmark_interval=None) as srv:
        populate(srv)
        src = make_source(srv, backoff_initial=0.05, backoff_max=0.2)
        assert src.wait_synced(3)
        delays = recorded_waits(src, monkeypatch)
        srv.expire_watches = True
        srv.close_watches()
        time.sleep(1.0)
        lists = len(srv.list_requests("Service"))
        src.stop()
        waits = [d for t, d in delays if t.endswith("-Service")]
        assert waits[:4] == pytest.approx([0.05, 0.1, 0.2, 0.2]), waits
        assert 3 <= lists <= 8, lists  # (1 s: 0.05 + 0.1 + 0.2 + 0.2 + 0.2 + ...)


def test_jitter_spreads_each_delay_over_d_to_2d(make_source: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[float, float]] = []

    def uniform(a: float, b: float) -> float:
        seen.append((a, b))
        return b

    monkeypatch.setattr(random, "uniform", uniform)
    with FakeAPIServer(bookmark_interval=None) as srv:
        populate(srv)
        src = make_source(srv, start=False, watch_timeout=300)
        delays = recorded_waits(src, monkeypatch)
        srv.stop()  # (an outage: backoff)
        src.start()
        assert wait_until(lambda: len(delays) >= 3)
        srv.start()
        assert src.wait_synced(5)
        assert wait_until(lambda: srv.watch_requests("Service"))
        src.stop()
    assert set(seen) == {(1.0, 2.0)}
    assert delays[0][1] == pytest.approx(0.1)  # 0.05 x 2
    # each watch asks for a timeout between 1x and 2x the configured one (client-go: 5-10 minutes)
    assert {w["timeoutSeconds"] for w in srv.watch_requests("Service")} == {"600"}


def test_a_throttled_request_waits_its_retry_after(make_source: Any) -> None:
    """429 Too Many Requests (API Priority and Fairness): retried after its Retry-After, by urllib3's
    own retries (client-go waits it too), not counted as a failure."""
    with FakeAPIServer(bookmark_interval=None) as srv:
        populate(srv)
        srv.throttled["Service"], srv.retry_after = 2, 1
        src = make_source(srv, start=False, backoff_initial=0.01, backoff_max=0.05)
        started = time.monotonic()
        src.start()
        assert src.wait_synced(10)
        took = time.monotonic() - started
        src.stop()
    assert took >= 2.0 and srv.throttled["Service"] == 0
    assert src.counters["errors"] == 0


def test_requests_that_reach_no_server_are_counted_as_errors(make_source: Any) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    api = kubernetes.client.ApiClient(kubernetes.client.Configuration(host=f"http://127.0.0.1:{port}"))
    src = KubernetesSource(api, NODE, backoff_initial=0.01, backoff_max=0.05, connect_timeout=0.5)
    src.start()
    try:
        assert wait_until(lambda: src.requests.get("<error>", 0) >= 3), src.requests
        assert set(src.requests) == {"<error>"}
    finally:
        src.stop()


def test_server_restart_reconnects_and_catches_up(server: FakeAPIServer, make_source: Any,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="reconciler.sources.kubernetes")
    populate(server)
    src = make_source(server)
    assert src.wait_synced(3)
    before = src.resource_version("Service")
    assert src.failing is None
    server.stop()
    server.create(service("while-down"))
    server.delete("Service", "default", "c")
    assert wait_until(lambda: src.counters["errors"] >= 1)
    assert src.failing is None  # (a failure retried within FAILING_AFTER seconds is not an outage yet)
    src.FAILING_AFTER = 0.0
    assert wait_until(lambda: src.counters["errors"] >= 3 * 2)  # repeated failed reconnects
    failing = src.failing  # (what the run loop's /healthz says meanwhile)
    assert failing is not None and failing.startswith("source: the API server cannot be read (")
    assert f"cannot reach the API server at 127.0.0.1:{server.port}" in failing
    server.start()
    assert wait_until(lambda: names(src, "Service") == {"a", "b", "while-down"})
    assert wait_until(lambda: src.failing is None)
    # Re-watched from the last resourceVersion: no relist was needed.
    assert src.counters["relists"] == 0
    assert len(server.list_requests("Service")) == 1
    assert int(server.watch_requests("Service")[-1]["resourceVersion"]) >= int(before)
    t0 = time.monotonic()
    src.stop()
    assert time.monotonic() - t0 < 1.0
    # the outage said once per try in a line (not urllib3's retry report), and its end said
    down = [r.getMessage() for r in caplog.records if "cannot reach" in r.getMessage()]
    assert any(m.startswith(f"Service informer: cannot reach the API server at 127.0.0.1:{server.port}: ")
               for m in down)
    assert "Max retries exceeded" not in caplog.text and all("keeping what it has, retrying in" in m for m in down)
    assert "Service informer: the API server answers again" in caplog.text


def recorded_waits(src: Any, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, float]]:
    """The source's backoff waits, as (thread name, seconds), as they happen."""
    delays: list[tuple[str, float]] = []
    real_wait = src._stop.wait

    def wait(timeout: float | None = None) -> bool:
        delays.append((threading.current_thread().name, timeout or 0.0))
        return bool(real_wait(timeout))

    monkeypatch.setattr(src._stop, "wait", wait)
    return delays


def test_backoff_is_exponential_and_capped(make_source: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    srv = FakeAPIServer().start()
    srv.stop()  # a port where nothing listens
    monkeypatch.setattr(random, "uniform", lambda a, b: 1.0)
    src = make_source(srv, start=False, backoff_initial=0.01, backoff_max=0.08)
    delays = recorded_waits(src, monkeypatch)
    src.start()
    assert wait_until(lambda: len(delays) >= 18)
    src.stop()
    per_thread = [d for t, d in delays if t.endswith("-Service")][:6]
    assert per_thread == pytest.approx([0.01, 0.02, 0.04, 0.08, 0.08, 0.08])
    assert not src.wait_synced(0)


def test_a_watch_the_server_answers_ends_the_outage_s_backoff(make_source: Any, monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """After an outage the delays have grown to their cap; a watch the server answers again (then
    closes at once, as an API server shutting down in a rolling restart does) is retried after the
    first delay, not the cap: a Node drained meanwhile is seen within seconds."""
    monkeypatch.setattr(random, "uniform", lambda a, b: 1.0)
    with FakeAPIServer(bookmark_interval=None) as srv:
        populate(srv)
        src = make_source(srv, backoff_initial=0.05, backoff_max=2.0)
        assert src.wait_synced(3)
        delays = recorded_waits(src, monkeypatch)
        srv.stop()
        assert wait_until(lambda: sum(t.endswith("-Node") for t, _ in delays) >= 5, timeout=10)
        srv.start()
        opened = len(srv.watch_requests("Node"))
        assert wait_until(lambda: len(srv.watch_requests("Node")) > opened, timeout=10)
        seen = len(delays)
        srv.close_watches()  # (answered, then closed at once)
        assert wait_until(lambda: any(t.endswith("-Node") for t, _ in delays[seen:]), timeout=10)
        after = [d for t, d in delays[seen:] if t.endswith("-Node")]
        outage = [d for t, d in delays[:seen] if t.endswith("-Node")]
        assert max(outage) >= 0.8 and after[0] == pytest.approx(0.05), (outage, after)
        src.stop()


# -- configuration -----------------------------------------------------------------------


def test_load_api_client_from_kubeconfig(server: FakeAPIServer, make_source: Any, tmp_path: Path) -> None:
    populate(server)
    cfg = tmp_path / "kubeconfig"
    cfg.write_text(
        f"""apiVersion: v1
kind: Config
clusters: [{{name: fake, cluster: {{server: "{server.url}"}}}}]
users: [{{name: me, user: {{token: secret-token}}}}]
contexts: [{{name: fake, context: {{cluster: fake, user: me}}}}]
current-context: fake
"""
    )
    api = load_api_client(str(cfg))
    assert api.configuration.host == server.url
    src = KubernetesSource(api, NODE)
    try:
        src.start()
        assert src.wait_synced(3)
        assert names(src, "Node") == {NODE}
    finally:
        src.stop()


def test_a_kubeconfig_token_file_is_read_again(server: FakeAPIServer, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """kubeadm's kube-proxy kubeconfig names the pod's service account token by tokenFile, which
    the kubelet rotates: read again (client-go: every minute), relative to the kubeconfig."""
    populate(server)
    (tmp_path / "secrets").mkdir()
    token = tmp_path / "secrets" / "token"
    token.write_text("")  # (not written yet when the client is made: read again all the same)
    cfg = tmp_path / "kubeconfig"
    cfg.write_text(
        f"""apiVersion: v1
kind: Config
clusters: [{{name: fake, cluster: {{server: "{server.url}"}}}}]
users: [{{name: me, user: {{tokenFile: secrets/token}}}}]
contexts: [{{name: fake, context: {{cluster: fake, user: me}}}}]
current-context: fake
"""
    )
    monkeypatch.setattr(kubernetes_source, "TOKEN_FILE_PERIOD", 0.0)
    api = load_api_client(str(cfg))
    token.write_text("token-v1\n")
    src = KubernetesSource(api, NODE, backoff_initial=0.01, backoff_max=0.05)
    try:
        src.start()
        assert src.wait_synced(3)
        assert set(server.authorizations) == {"Bearer token-v1"}
        token.write_text("token-v2\n")
        server.close_watches()
        assert wait_until(lambda: server.authorizations[-1] == "Bearer token-v2")  # (none signed before, after)
        seen = len(server.authorizations)
        server.close_watches()  # (new requests)
        assert wait_until(lambda: len(server.authorizations) > seen + 2)
        assert set(server.authorizations[seen:]) == {"Bearer token-v2"}
        token.unlink()  # a read that fails keeps the last token
        seen = len(server.authorizations)
        server.close_watches()
        assert wait_until(lambda: len(server.authorizations) > seen + 2)
        assert set(server.authorizations[seen:]) == {"Bearer token-v2"}
    finally:
        src.stop()


def test_load_api_client_in_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    caplog: pytest.LogCaptureFixture) -> None:
    token, ca = tmp_path / "token", tmp_path / "ca.crt"
    token.write_text("sa-token")
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(token))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(ca))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    monkeypatch.setenv("KUBERNETES_PORT_443_TCP_ADDR", "10.96.0.1")  # as the kubelet sets it
    with caplog.at_level("WARNING"):
        api = load_api_client(None)
    assert api.configuration.host == "https://10.96.0.1:443"
    assert api.configuration.ssl_ca_cert == str(ca)
    # through the ClusterIP this proxy programs: told, with the fix
    assert "ClusterIP 10.96.0.1" in caplog.text and "KUBERNETES_SERVICE_HOST" in caplog.text
    caplog.clear()
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "192.0.2.10")  # the API server's own address
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    with caplog.at_level("WARNING"):
        assert load_api_client(None).configuration.host == "https://192.0.2.10:6443"
    assert caplog.text == ""


def test_an_api_error_is_one_line_with_the_servers_own_message() -> None:
    """A 403 names the account and the verb it lacks (as client-go logs it), and no API error is
    logged over several lines with its headers (the client's str() of it)."""
    from kubernetes.client.exceptions import ApiException

    from reconciler.sources.kubernetes import _described

    forbidden = ApiException(status=403, reason="Forbidden")
    forbidden.headers = {"Content-Type": "application/json"}
    forbidden.body = json.dumps({"kind": "Status", "status": "Failure", "reason": "Forbidden", "code": 403,
                                 "message": 'endpointslices.discovery.k8s.io is forbidden: User\n"system:serviceaccount:'
                                            'kube-system:reconciler" cannot list resource "endpointslices"'}).encode()
    assert "\n" in str(forbidden)
    assert _described(forbidden) == ('HTTP 403 Forbidden: endpointslices.discovery.k8s.io is forbidden: User '
                                     '"system:serviceaccount:kube-system:reconciler" cannot list resource '
                                     '"endpointslices"')
    busy = ApiException(status=429, reason="Too Many Requests")
    busy.body = "slow down\n" + "x" * 1000
    assert _described(busy) == "HTTP 429 Too Many Requests: slow down " + "x" * 290
    assert _described(ApiException(status=500, reason="Internal Server Error")) == "HTTP 500 Internal Server Error"
