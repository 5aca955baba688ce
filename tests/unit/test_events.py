"""EventRecorder: kube-proxy's Events, sent in the background, a repeat within the series window once."""

from __future__ import annotations

import threading
from typing import Any

from reconciler.events import NOTE_MAX, SERIES_WINDOW, EventRecorder, node_ref, service_ref


class Sink:
    def __init__(self, fail: int = 0) -> None:
        self.created: list[tuple[str, dict[str, Any]]] = []
        self.fail = fail
        self.calls = threading.Semaphore(0)

    def __call__(self, namespace: str, body: dict[str, Any]) -> None:
        try:
            if self.fail:
                self.fail -= 1
                raise OSError("connection refused")
            self.created.append((namespace, body))
        finally:
            self.calls.release()


def recorder(sink: Sink, now: list[float]) -> EventRecorder:
    r = EventRecorder(sink, "node-a", clock=lambda: now[0])
    r.start()
    return r


def test_an_event_is_what_client_go_creates() -> None:
    sink, now = Sink(), [1_800_000_000.25]
    r = recorder(sink, now)
    assert r.record(service_ref("shop", "web"), "Warning", "FailedToStartServiceHealthcheck", "Listen", "x" * 2000)
    r.stop()
    [(namespace, body)] = sink.created
    assert namespace == "shop"
    assert body["metadata"] == {"name": f"web.{int(now[0] * 1e9):x}", "namespace": "shop"}
    assert body["eventTime"] == "2027-01-15T08:00:00.250000Z"
    assert (body["reportingController"], body["reportingInstance"]) == ("service-reconciler",
                                                                        "service-reconciler-node-a")
    assert body["regarding"] == {"apiVersion": "v1", "kind": "Service", "namespace": "shop", "name": "web"}
    assert (body["type"], body["reason"], body["action"]) == ("Warning", "FailedToStartServiceHealthcheck", "Listen")
    assert body["note"] == "x" * NOTE_MAX


def test_a_cluster_scoped_object_s_event_goes_to_default() -> None:
    sink, now = Sink(), [100.0]
    r = recorder(sink, now)
    r.record(node_ref("node-a"), "Normal", "StartKubeProxy", "Starting", "Starting service-reconciler.")
    r.stop()
    assert [(ns, b["regarding"]["kind"]) for ns, b in sink.created] == [("default", "Node")]


def test_a_repeat_within_the_series_window_is_sent_once() -> None:
    sink, now = Sink(), [100.0]
    r = recorder(sink, now)
    ref = service_ref("default", "lb")
    assert r.record(ref, "Warning", "FailedToStartServiceHealthcheck", "Listen", "port 1 in use")
    now[0] += SERIES_WINDOW - 1
    assert not r.record(ref, "Warning", "FailedToStartServiceHealthcheck", "Listen", "port 1 in use")
    assert r.record(ref, "Warning", "FailedToStartServiceHealthcheck", "Listen", "port 2 in use")  # another note
    now[0] += 2  # the first one's window is over
    assert r.record(ref, "Warning", "FailedToStartServiceHealthcheck", "Listen", "port 1 in use")
    r.stop()
    assert [b["note"] for _, b in sink.created] == ["port 1 in use", "port 2 in use", "port 1 in use"]


def test_a_failed_send_is_logged_and_the_next_one_still_goes(caplog) -> None:
    sink, now = Sink(fail=1), [100.0]
    r = recorder(sink, now)
    r.record(node_ref("node-a"), "Normal", "StartKubeProxy", "Starting", "one")
    r.record(node_ref("node-a"), "Normal", "StartKubeProxy", "Starting", "two")
    r.stop()
    assert (r.failed, r.sent) == (1, 1)
    assert [b["note"] for _, b in sink.created] == ["two"]
    assert "cannot record event StartKubeProxy on Node node-a: connection refused" in caplog.text
