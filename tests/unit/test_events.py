"""EventRecorder: kube-proxy's Events, sent in the background as client-go's recorder sends them."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any, Iterator

import kubernetes
import pytest

from reconciler import events
from reconciler.daemon import start_events
from reconciler.events import NOTE_MAX, SERIES_WINDOW, EventRecorder, SendError, api_sender, node_ref, service_ref
from reconciler.health import BindError, RetryingListener


class Sink:
    """A sender: `fail` sends fail first (retry: whether the API might take them later)."""

    def __init__(self, fail: int = 0, retry: bool = True) -> None:
        self.created: list[tuple[str, dict[str, Any]]] = []
        self.fail, self.retry, self.calls = fail, retry, 0

    def __call__(self, namespace: str, body: dict[str, Any]) -> None:
        self.calls += 1
        if self.fail:
            self.fail -= 1
            raise SendError("connection refused", self.retry)
        self.created.append((namespace, body))


def wait_for(condition: Any, seconds: float = 5.0) -> bool:
    done = threading.Event()
    for _ in range(int(seconds / 0.01)):
        if condition():
            return True
        done.wait(0.01)
    return bool(condition())


def recorder(sink: Sink, now: list[float]) -> EventRecorder:
    r = EventRecorder(sink, "node-a", clock=lambda: now[0])
    r.start()
    return r


def test_an_event_is_what_client_go_creates() -> None:
    sink, now = Sink(), [1_800_000_000.0]  # (a whole second: still six fraction digits)
    r = recorder(sink, now)
    assert r.record(service_ref("shop", "web"), "Warning", "FailedToStartServiceHealthcheck", "Listen", "x" * 2000)
    r.stop()
    [(namespace, body)] = sink.created
    assert namespace == "shop"
    assert body["metadata"] == {"name": f"web.{int(now[0] * 1e9):x}", "namespace": "shop"}
    assert body["eventTime"] == "2027-01-15T08:00:00.000000Z"
    assert (body["reportingController"], body["reportingInstance"]) == (
        "service-reconciler", f"service-reconciler-{socket.gethostname()}"[:128])
    assert body["regarding"] == {"apiVersion": "v1", "kind": "Service", "namespace": "shop", "name": "web"}
    assert (body["type"], body["reason"], body["action"]) == ("Warning", "FailedToStartServiceHealthcheck", "Listen")
    assert body["note"] == "x" * NOTE_MAX


def test_a_cluster_scoped_object_s_event_goes_to_default() -> None:
    sink, now = Sink(), [100.0]
    r = recorder(sink, now)
    r.record(node_ref("node-a"), "Normal", "Starting", "StartKubeProxy", "")
    r.stop()
    assert [(ns, b["regarding"]["kind"]) for ns, b in sink.created] == [("default", "Node")]


def test_an_event_recurring_within_the_series_window_is_sent_once() -> None:
    sink, now = Sink(), [100.0]
    r = recorder(sink, now)
    ref = service_ref("default", "lb")
    assert r.record(ref, "Warning", "FailedToStartServiceHealthcheck", "Listen", "port 1 in use")
    now[0] += SERIES_WINDOW - 1
    assert not r.record(ref, "Warning", "FailedToStartServiceHealthcheck", "Listen", "port 1 in use")
    assert r.record(ref, "Warning", "FailedToStartServiceHealthcheck", "Listen", "port 2 in use")  # another note
    now[0] += SERIES_WINDOW - 1  # it recurred meanwhile: the window runs from then
    assert not r.record(ref, "Warning", "FailedToStartServiceHealthcheck", "Listen", "port 1 in use")
    now[0] += SERIES_WINDOW
    assert r.record(ref, "Warning", "FailedToStartServiceHealthcheck", "Listen", "port 1 in use")
    r.stop()
    assert [b["note"] for _, b in sink.created] == ["port 1 in use", "port 2 in use", "port 1 in use"]


def test_a_send_the_api_could_not_take_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(events, "SEND_RETRY", 0.01)
    sink, now = Sink(fail=2), [100.0]
    r = recorder(sink, now)
    r.record(node_ref("node-a"), "Normal", "Starting", "StartKubeProxy", "")
    assert wait_for(lambda: r.sent == 1)
    r.stop()
    assert (sink.calls, r.sent, r.failed) == (3, 1, 0)


def test_a_refused_event_is_logged_and_may_recur(caplog: Any) -> None:
    sink, now = Sink(fail=1, retry=False), [100.0]
    r = recorder(sink, now)
    r.record(node_ref("node-a"), "Normal", "Starting", "StartKubeProxy", "")
    assert wait_for(lambda: r.failed == 1)
    assert (sink.calls, r.sent, r.failed) == (1, 0, 1)  # refused: not tried again
    assert "cannot record event Starting on Node node-a: connection refused" in caplog.text
    assert r.record(node_ref("node-a"), "Normal", "Starting", "StartKubeProxy", "")  # no series to join
    r.stop()
    assert r.sent == 1


def test_healthz_that_cannot_listen_is_an_event_on_the_node() -> None:
    def refuse() -> None:
        raise BindError("healthz: cannot listen on 0.0.0.0:10256: Address already in use")

    sink, listener = Sink(), RetryingListener(refuse, 5.0)
    r = start_events(sink, "node-a", None, listener)
    assert not listener.start(retry=False)
    r.stop()
    assert [(b["reason"], b["action"], b["regarding"]["kind"], b["note"]) for _, b in sink.created] == [
        ("Starting", "StartKubeProxy", "Node", ""),
        ("FailedToStartProxierHealthcheck", "StartKubeProxy", "Node",
         "failed to start proxier healthz: healthz: cannot listen on 0.0.0.0:10256: Address already in use")]


@pytest.fixture
def api() -> Iterator[tuple[Any, list[tuple[str, bytes]], list[int]]]:
    """An HTTP server answering POSTs with the status in `status` (first one left, then 201)."""
    got: list[tuple[str, bytes]] = []
    status: list[int] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            got.append((self.path, self.rfile.read(int(self.headers["Content-Length"]))))
            body = b"{}"
            self.send_response(status.pop(0) if status else 201)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    srv = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    client = kubernetes.client.ApiClient(kubernetes.client.Configuration(host=f"http://127.0.0.1:{srv.server_port}"))
    yield client, got, status
    srv.shutdown()
    srv.server_close()


def test_the_api_sender_posts_the_event_as_it_is(api: Any) -> None:
    client, got, status = api
    send = api_sender(client)
    body = {"apiVersion": "events.k8s.io/v1", "kind": "Event", "eventTime": "2027-01-15T08:00:00.000000Z",
            "metadata": {"name": "web.1", "namespace": "shop"}, "note": ""}
    send("shop", body)
    [(path, data)] = got
    assert path == "/apis/events.k8s.io/v1/namespaces/shop/events"
    assert json.loads(data) == body  # (the client's model would rewrite eventTime)
    status += [503, 422]
    with pytest.raises(SendError) as busy:
        send("shop", body)
    with pytest.raises(SendError) as invalid:
        send("shop", body)
    assert (busy.value.retry, invalid.value.retry) == (True, False)
