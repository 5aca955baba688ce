"""Kubernetes Events, as kube-proxy records them (events.k8s.io/v1), when the source is the API.

kube-proxy's: `Starting` (action `StartKubeProxy`) on its Node when it starts,
`FailedToStartProxierHealthcheck` on it while /healthz cannot listen, and
`FailedToStartServiceHealthcheck` on a Service whose healthCheckNodePort cannot be opened. They are
sent by a background thread (never holding up a sync), as client-go's recorder sends them: a full
queue drops them, a send the server could not take (no connection, 429, 5xx) is tried up to
MAX_TRIES times, SEND_RETRY seconds apart. An event the same as one that recurred in the last
SERIES_WINDOW seconds (the same object, type, reason, action and note; client-go would count it
in that event's series) is not sent again.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from datetime import datetime, timezone
from typing import Any, Callable

log = logging.getLogger(__name__)

REPORTING_CONTROLLER = "service-reconciler"
SERIES_WINDOW = 6 * 60.0  # client-go's: an isomorphic event within it joins the first one's series
QUEUE_SIZE = 1000  # client-go's broadcaster queue
NOTE_MAX = 1024  # the API server refuses a longer note
INSTANCE_MAX = 128  # ... and a longer reportingInstance
MAX_TRIES, SEND_RETRY = 12, 10.0  # client-go's


class SendError(Exception):
    """The API did not take an Event; `retry`: it may take it later (no connection, 429, 5xx)."""

    def __init__(self, message: str, retry: bool) -> None:
        super().__init__(message)
        self.retry = retry


Sender = Callable[[str, dict[str, Any]], None]  # (namespace, Event body) -> create it, or raise


def node_ref(node: str) -> dict[str, str]:
    """kube-proxy's NodeRef: cluster-scoped, its UID the node's name."""
    return {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node}


def service_ref(namespace: str, name: str) -> dict[str, str]:
    return {"apiVersion": "v1", "kind": "Service", "namespace": namespace, "name": name}


def api_sender(api_client: Any) -> Sender:
    """POSTs the Event's JSON as it is, through the official client's connection, auth and TLS
    (its EventsV1Api would rewrite eventTime through its model: the server wants six fraction
    digits exactly)."""

    def send(namespace: str, body: dict[str, Any]) -> None:
        try:
            method, url, headers, data, post = api_client.param_serialize(
                "POST", "/apis/events.k8s.io/v1/namespaces/{namespace}/events", path_params={"namespace": namespace},
                header_params={"Content-Type": "application/json", "Accept": "application/json"}, body=body,
                auth_settings=["BearerToken"])
            resp = api_client.call_api(method, url, headers, data, post, _request_timeout=10)
            resp.read()  # (the connection goes back to the pool)
        except Exception as exc:  # noqa: BLE001 - urllib3's connection and timeout errors
            raise SendError(str(exc), retry=True) from exc
        if not 200 <= resp.status < 300:
            raise SendError(f"HTTP {resp.status}: {(resp.data or b'')[:200]!r}",
                            retry=resp.status == 429 or resp.status >= 500)

    return send


class EventRecorder:
    """events.k8s.io/v1 Events about `node`'s proxy, sent in the background."""

    def __init__(self, send: Sender, node: str, clock: Callable[[], float] = time.time) -> None:
        self._send = send
        self._instance = f"{REPORTING_CONTROLLER}-{socket.gethostname() or node}"[:INSTANCE_MAX]  # (client-go's)
        self._clock = clock
        self._stopping = threading.Event()
        self._queue: queue.Queue[tuple[str, dict[str, Any]] | None] = queue.Queue(QUEUE_SIZE)
        self._sent: dict[tuple[Any, ...], float] = {}  # isomorphic key -> when it last occurred
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.sent = 0  # (tests) events created
        self.failed = 0  # (tests) events the API refused or that could not reach it

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="events", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Send what is queued (bounded by `timeout`; no more retries), then stop."""
        if self._thread is None:
            return
        self._stopping.set()
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)

    def record(self, regarding: dict[str, str], type_: str, reason: str, action: str, note: str) -> bool:
        """Queue an Event (False: not queued: a repeat within SERIES_WINDOW, or the queue is full)."""
        now = self._clock()
        namespace = regarding.get("namespace") or "default"  # (cluster-scoped objects': client-go's)
        body = {
            "apiVersion": "events.k8s.io/v1",
            "kind": "Event",
            "metadata": {"name": f"{regarding['name']}.{int(now * 1e9):x}", "namespace": namespace},
            "eventTime": datetime.fromtimestamp(now, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "reportingController": REPORTING_CONTROLLER,
            "reportingInstance": self._instance,
            "regarding": regarding,
            "type": type_,
            "reason": reason,
            "action": action,
            "note": note[:NOTE_MAX],
        }
        key = _isomorphic(body)
        with self._lock:
            self._sent = {k: t for k, t in self._sent.items() if now - t < SERIES_WINDOW}
            recurs = key in self._sent
            self._sent[key] = now  # (when it recurs: the series goes on)
        if recurs:
            return False
        try:
            self._queue.put_nowait((namespace, body))
        except queue.Full:
            log.debug("event queue full; dropped %s %s", reason, regarding.get("name"))
            self._forget(body)
            return False
        return True

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._deliver(*item)

    def _deliver(self, namespace: str, body: dict[str, Any]) -> None:
        for attempt in range(1, MAX_TRIES + 1):
            try:
                self._send(namespace, body)
                self.sent += 1
                return
            except Exception as exc:  # noqa: BLE001 - an event is never worth stopping for
                retry = getattr(exc, "retry", False) and attempt < MAX_TRIES
                if retry and not self._stopping.wait(SEND_RETRY):
                    continue
                self.failed += 1
                self._forget(body)  # (a later recurrence is sent)
                log.warning("cannot record event %s on %s %s: %s", body["reason"], body["regarding"]["kind"],
                            body["regarding"]["name"], exc)
                return

    def _forget(self, body: dict[str, Any]) -> None:
        with self._lock:
            self._sent.pop(_isomorphic(body), None)


def _isomorphic(body: dict[str, Any]) -> tuple[Any, ...]:
    """What makes two Events the same one recurring (client-go's isomorphic key)."""
    return (tuple(sorted(body["regarding"].items())), body["type"], body["reason"], body["action"], body["note"])
