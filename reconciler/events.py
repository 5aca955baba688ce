"""Kubernetes Events, as kube-proxy records them (events.k8s.io/v1), when the source is the API.

kube-proxy records two: `StartKubeProxy` on its Node when it starts, and
`FailedToStartServiceHealthcheck` on a Service whose healthCheckNodePort cannot be opened. They are
sent by a background thread (never holding up a sync); a full queue drops them, as client-go's
broadcaster does. An event the same as one sent in the last SERIES_WINDOW seconds (the same
object, type, reason, action and note; client-go would count it in that event's series) is not
sent again.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from datetime import datetime, timezone
from typing import Any, Callable

log = logging.getLogger(__name__)

REPORTING_CONTROLLER = "service-reconciler"
SERIES_WINDOW = 6 * 60.0  # client-go's: an isomorphic event within it joins the first one's series
QUEUE_SIZE = 1000  # client-go's broadcaster queue
NOTE_MAX = 1024  # the API server refuses a longer note

Sender = Callable[[str, dict[str, Any]], None]  # (namespace, Event body) -> create it, or raise


def node_ref(node: str) -> dict[str, str]:
    """kube-proxy's NodeRef: cluster-scoped, its UID the node's name."""
    return {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node}


def service_ref(namespace: str, name: str) -> dict[str, str]:
    return {"apiVersion": "v1", "kind": "Service", "namespace": namespace, "name": name}


def api_sender(api_client: Any) -> Sender:
    """Creates events with the official client (EventsV1Api)."""
    import kubernetes

    events = kubernetes.client.EventsV1Api(api_client)

    def send(namespace: str, body: dict[str, Any]) -> None:
        events.create_namespaced_event(namespace, body, _preload_content=False, _request_timeout=10)

    return send


class EventRecorder:
    """events.k8s.io/v1 Events about `node`'s proxy, sent in the background."""

    def __init__(self, send: Sender, node: str, clock: Callable[[], float] = time.time) -> None:
        self._send = send
        self._instance = f"{REPORTING_CONTROLLER}-{node}"
        self._clock = clock
        self._queue: queue.Queue[tuple[str, dict[str, Any]] | None] = queue.Queue(QUEUE_SIZE)
        self._sent: dict[tuple[Any, ...], float] = {}  # isomorphic key -> when first sent
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.sent = 0  # (tests) events created
        self.failed = 0  # (tests) events the API refused or that could not reach it

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="events", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Send what is queued (bounded by `timeout`), then stop."""
        if self._thread is None:
            return
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)

    def record(self, regarding: dict[str, str], type_: str, reason: str, action: str, note: str) -> bool:
        """Queue an Event (False: not queued: a repeat within SERIES_WINDOW, or the queue is full)."""
        note = note[:NOTE_MAX]
        now = self._clock()
        key = (tuple(sorted(regarding.items())), type_, reason, action, note)
        with self._lock:
            self._sent = {k: t for k, t in self._sent.items() if now - t < SERIES_WINDOW}
            if key in self._sent:
                return False
            self._sent[key] = now
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
            "note": note,
        }
        try:
            self._queue.put_nowait((namespace, body))
        except queue.Full:
            log.debug("event queue full; dropped %s %s", reason, regarding.get("name"))
            return False
        return True

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            namespace, body = item
            try:
                self._send(namespace, body)
                self.sent += 1
            except Exception as exc:  # noqa: BLE001 - an event is never worth stopping for
                self.failed += 1
                log.warning("cannot record event %s on %s %s: %s", body["reason"], body["regarding"]["kind"],
                            body["regarding"]["name"], exc)
