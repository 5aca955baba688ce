"""A fake Kubernetes API server speaking the real list/watch wire protocol over HTTP.

Serves GET /api/v1/services, /apis/discovery.k8s.io/v1/endpointslices and /api/v1/nodes:
lists (limit/continue over a consistent snapshot, labelSelector, fieldSelector) and
`watch=true` chunked JSON-line streams with ADDED/MODIFIED/DELETED/BOOKMARK/ERROR events.
Test hooks: create/update/delete, compact, hold/release lists, close_watches, stop/start
(same port), and a request log.
"""

from __future__ import annotations

import base64
import copy
import itertools
import json
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable
from urllib.parse import parse_qs, urlsplit

Obj = dict[str, Any]


@dataclass(frozen=True)
class _Kind:
    kind: str
    api_version: str
    path: str
    namespaced: bool


KINDS = {
    k.kind: k
    for k in (
        _Kind("Service", "v1", "/api/v1/services", True),
        _Kind("EndpointSlice", "discovery.k8s.io/v1", "/apis/discovery.k8s.io/v1/endpointslices", True),
        _Kind("Node", "v1", "/api/v1/nodes", False),
    )
}
_BY_PATH = {k.path: k for k in KINDS.values()}


@dataclass(frozen=True)
class _Event:
    rv: int
    kind: str
    type: str  # ADDED, MODIFIED or DELETED (before selector filtering)
    old: Obj | None
    new: Obj  # for DELETED: the last state, with the deletion's resourceVersion


def status(code: int, reason: str, message: str) -> Obj:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def matches_labels(obj: Obj, selector: str) -> bool:
    """Equality/existence label selectors: `k`, `!k`, `k=v`, `k==v`, `k!=v`, comma-separated."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for req in filter(None, (r.strip() for r in selector.split(","))):
        if "!=" in req:
            k, v = req.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "=" in req:
            k, v = req.replace("==", "=").split("=", 1)
            if labels.get(k.strip()) != v.strip():
                return False
        elif req.startswith("!"):
            if req[1:].strip() in labels:
                return False
        elif req not in labels:
            return False
    return True


def matches_fields(obj: Obj, selector: str) -> bool:
    """Field selectors on metadata.name / metadata.namespace with `=`, `==`, `!=`."""
    meta = obj.get("metadata") or {}
    for req in filter(None, (r.strip() for r in selector.split(","))):
        neg = "!=" in req
        k, v = req.replace("!=", "=").replace("==", "=").split("=", 1)
        field = k.strip().removeprefix("metadata.")
        if field not in ("name", "namespace"):
            raise ValueError(f"field label not supported: {k}")
        if (meta.get(field, "") == v.strip()) == neg:
            return False
    return True


class FakeAPIServer:
    """In-memory API server on 127.0.0.1; state survives stop()/start() on the same port."""

    def __init__(self, bookmark_interval: float | None = 0.2, gone_mode: str = "event",
                 watch_cache: bool = True) -> None:
        self.bookmark_interval = bookmark_interval
        self.gone_mode = gone_mode  # "event": 200 + ERROR event; "http": HTTP 410
        # as the API server's watch cache: a list at a resourceVersion ("0", or "not older than" a
        # version seen) is answered whole from memory, its `limit` ignored; without it (or with
        # resourceVersion unset) lists are paginated, and a paginated list at an exact version
        # already compacted is 410 Expired, as from etcd
        self.watch_cache = watch_cache
        self.expire_watches = False  # every watch is answered 410 Gone at once
        self.throttled: dict[str, int] = {}  # kind -> how many of its next requests get 429 ...
        self.retry_after = 1  # ... with this Retry-After (seconds)
        # watches from these resourceVersions are refused with an ERROR event (504 "Too large
        # resource version", as after etcd was restored from a backup)
        self.refused_rvs: set[str] = set()
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.authorizations: list[str | None] = []  # each GET's Authorization header
        self.recorded_events: list[Obj] = []  # events.k8s.io/v1 Events created (POST)
        # Called (kind, query) when a list page is ready, before it is sent (e.g. to compact).
        self.on_list_page: Callable[[str, dict[str, str]], None] | None = None
        self.port = 0
        self._cond = threading.Condition()
        self._rv = 100
        self._compacted = 0
        self._objects: dict[str, dict[tuple[str, str], Obj]] = {k: {} for k in KINDS}
        self._events: list[_Event] = []
        self._dropped: dict[str, int] = {}  # newest compacted-away event per kind
        self._snapshots: dict[str, tuple[int, list[Obj]]] = {}
        self._snap_ids = itertools.count(1)
        self._holds: dict[str, threading.Event] = {}
        self._watch_gen = 0
        self._epoch = 0
        self._conns: set[socket.socket] = set()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeAPIServer:
        """Listen (again) on 127.0.0.1, on the same port after the first start."""
        handler = type("Handler", (_Handler,), {"api": self})
        httpd = ThreadingHTTPServer(("127.0.0.1", self.port), handler)
        httpd.daemon_threads = True
        self.port = httpd.server_address[1]
        with self._cond:
            self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Go away: stop listening and cut every open connection (watches included)."""
        with self._cond:
            httpd, self._httpd = self._httpd, None
            self._epoch += 1
            conns = list(self._conns)
            for ev in self._holds.values():
                ev.set()
            self._cond.notify_all()
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def restart(self, down_for: float = 0.0) -> None:
        self.stop()
        time.sleep(down_for)
        self.start()

    def __enter__(self) -> FakeAPIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- test hooks ----------------------------------------------------------------------

    @property
    def resource_version(self) -> int:
        with self._cond:
            return self._rv

    def create(self, obj: Obj) -> Obj:
        return self._write(obj, must_exist=False)

    def update(self, obj: Obj) -> Obj:
        return self._write(obj, must_exist=True)

    def delete(self, kind: str, namespace: str, name: str) -> None:
        with self._cond:
            old = self._objects[kind].pop((namespace if KINDS[kind].namespaced else "", name))
            self._rv += 1
            gone = copy.deepcopy(old)
            gone["metadata"]["resourceVersion"] = str(self._rv)
            self._events.append(_Event(self._rv, kind, "DELETED", old, gone))
            self._cond.notify_all()

    def get(self, kind: str, namespace: str, name: str) -> Obj:
        with self._cond:
            return copy.deepcopy(self._objects[kind][(namespace, name)])

    def compact(self) -> int:
        """Forget history up to now: older resourceVersions and continue tokens give 410."""
        with self._cond:
            self._compacted = self._rv
            for e in self._events:
                self._dropped[e.kind] = max(self._dropped.get(e.kind, 0), e.rv)
            self._events = []
            return self._compacted

    def close_watches(self) -> None:
        """End every open watch stream cleanly (like a server-side watch timeout)."""
        with self._cond:
            self._watch_gen += 1
            self._cond.notify_all()

    def hold_lists(self, kind: str) -> None:
        """Make list requests for `kind` block until release_lists(kind)."""
        with self._cond:
            self._holds[kind] = threading.Event()

    def release_lists(self, kind: str) -> None:
        with self._cond:
            ev = self._holds.pop(kind, None)
        if ev is not None:
            ev.set()

    def list_requests(self, kind: str) -> list[dict[str, str]]:
        with self._cond:
            return [q for p, q in self.requests if p == KINDS[kind].path and q.get("watch") != "true"]

    def watch_requests(self, kind: str) -> list[dict[str, str]]:
        with self._cond:
            return [q for p, q in self.requests if p == KINDS[kind].path and q.get("watch") == "true"]

    # -- internals -----------------------------------------------------------------------

    def _write(self, obj: Obj, must_exist: bool) -> Obj:
        k = KINDS[obj["kind"]]
        obj = copy.deepcopy(obj)
        obj["apiVersion"] = k.api_version
        meta = obj.setdefault("metadata", {})
        if k.namespaced:
            meta.setdefault("namespace", "default")
        else:
            meta.pop("namespace", None)
        key = (meta.get("namespace", ""), meta["name"])
        with self._cond:
            old = self._objects[k.kind].get(key)
            if must_exist != (old is not None):
                raise KeyError(f"{k.kind} {key}: {'not found' if must_exist else 'already exists'}")
            self._rv += 1
            meta["resourceVersion"] = str(self._rv)
            meta["uid"] = old["metadata"]["uid"] if old else str(uuid.uuid4())
            meta.setdefault("creationTimestamp", "2024-01-01T00:00:00Z")
            self._objects[k.kind][key] = obj
            self._events.append(_Event(self._rv, k.kind, "MODIFIED" if old else "ADDED", old, obj))
            self._cond.notify_all()
            return copy.deepcopy(obj)

    def _register(self, conn: socket.socket, add: bool) -> None:
        with self._cond:
            (self._conns.add if add else self._conns.discard)(conn)



class _Handler(BaseHTTPRequestHandler):
    api: FakeAPIServer
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        self.api._register(self.connection, True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.api._register(self.connection, False)

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        api = self.api
        url = urlsplit(self.path)
        q = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        with api._cond:
            if self.server is not api._httpd:  # accepted just before stop(): go away too
                self.close_connection = True
                return
            api.requests.append((url.path, q))
            api.authorizations.append(self.headers.get("Authorization"))
        kind = _BY_PATH.get(url.path)
        try:
            with api._cond:
                throttled = kind is not None and api.throttled.get(kind.kind, 0) > 0
                if throttled:
                    api.throttled[kind.kind] -= 1
            if kind is None:
                self._json(404, status(404, "NotFound", f"the server could not find {url.path}"))
            elif throttled:  # (API Priority and Fairness rejecting a request)
                self._json(429, status(429, "TooManyRequests", "Too many requests, please try again later."),
                           {"Retry-After": str(api.retry_after)})
            elif q.get("watch") in ("true", "1"):
                self._watch(kind, q)
            else:
                self._list(kind, q)
        except ValueError as exc:
            self._json(400, status(400, "BadRequest", str(exc)))
        except OSError:
            self.close_connection = True

    def do_POST(self) -> None:
        """Create an events.k8s.io/v1 Event, checked as the API server validates one."""
        api = self.api
        path = urlsplit(self.path).path
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        prefix, suffix = "/apis/events.k8s.io/v1/namespaces/", "/events"
        if not (path.startswith(prefix) and path.endswith(suffix)):
            return self._json(404, status(404, "NotFound", f"the server could not find {path}"))
        namespace = path[len(prefix):-len(suffix)]
        meta = body.get("metadata") or {}
        problems = [f for f in ("eventTime", "reportingController", "reportingInstance", "action", "reason",
                                "regarding") if not body.get(f)]
        if body.get("type") not in ("Normal", "Warning"):
            problems.append("type")
        if not re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}(Z|[+-]\d\d:\d\d)", str(body.get("eventTime"))):
            problems.append("eventTime")  # (metav1.MicroTime: RFC 3339 with exactly six fraction digits)
        if len(body.get("reportingInstance", "")) > 128:
            problems.append("reportingInstance")
        if len(body.get("note", "")) > 1024 or meta.get("namespace", namespace) != namespace or not meta.get("name"):
            problems.append("note/metadata")
        if problems:
            return self._json(422, status(422, "Invalid", f"Event is invalid: {problems}"))
        with api._cond:
            api.recorded_events.append(body)
        self._json(201, body)

    def _list(self, kind: _Kind, q: dict[str, str]) -> None:
        api = self.api
        with api._cond:
            hold = api._holds.get(kind.kind)
        if hold is not None:
            hold.wait(10)
        labels, fields = q.get("labelSelector", ""), q.get("fieldSelector", "")
        limit = int(q.get("limit") or 0)
        at = q.get("resourceVersion", "")
        if at and q.get("continue"):
            return self._json(400, status(400, "BadRequest",
                                          "specifying resource version is not allowed when using continue"))
        with api._cond:
            if at not in ("", "0") and int(at) > api._rv:
                too_large = status(504, "Timeout", f"Too large resource version: {at}, current: {api._rv}")
                too_large["details"] = {"causes": [{"reason": "ResourceVersionTooLarge",
                                                    "message": "Too large resource version"}], "retryAfterSeconds": 1}
                return self._json(504, too_large)
            if at and api.watch_cache:
                limit = 0
            elif at not in ("", "0") and limit and int(at) < api._compacted:
                return self._json(410, status(410, "Expired", f"too old resource version: {at} ({api._compacted})"))
            if q.get("continue"):
                snap_id, start = json.loads(base64.urlsafe_b64decode(q["continue"]))
                rv, items = api._snapshots.get(snap_id, (-1, []))
                if rv < api._compacted:
                    msg = "The provided continue parameter is too old to display a consistent list result."
                    return self._json(410, status(410, "Expired", msg))
            else:
                snap_id, start, rv = None, 0, api._rv
                items = [
                    {k: v for k, v in copy.deepcopy(o).items() if k not in ("kind", "apiVersion")}
                    for _, o in sorted(api._objects[kind.kind].items())
                    if matches_labels(o, labels) and matches_fields(o, fields)
                ]
            end = start + limit if limit else len(items)
            meta: Obj = {"resourceVersion": str(rv)}
            if end < len(items):
                if snap_id is None:
                    snap_id = str(next(api._snap_ids))
                    api._snapshots[snap_id] = (rv, items)
                meta["continue"] = base64.urlsafe_b64encode(json.dumps([snap_id, end]).encode()).decode()
                meta["remainingItemCount"] = len(items) - end
        body = {"kind": f"{kind.kind}List", "apiVersion": kind.api_version, "metadata": meta,
                "items": items[start:end]}
        if api.on_list_page is not None:
            api.on_list_page(kind.kind, q)
        self._json(200, body)

    def _watch(self, kind: _Kind, q: dict[str, str]) -> None:
        api = self.api
        labels, fields = q.get("labelSelector", ""), q.get("fieldSelector", "")
        matches_labels({}, labels), matches_fields({}, fields)  # validate before answering
        interval = api.bookmark_interval if q.get("allowWatchBookmarks") in ("true", "1") else None
        deadline = time.monotonic() + float(q.get("timeoutSeconds") or 1800)
        with api._cond:
            epoch, gen = api._epoch, api._watch_gen
            rv = q.get("resourceVersion", "")
            last = int(rv) if rv not in ("", "0") else api._rv
            too_old, compacted = last < api._compacted or api.expire_watches, api._compacted
        gone = status(410, "Expired", f"too old resource version: {last} ({compacted})")
        if rv in api.refused_rvs:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self._chunk({"type": "ERROR", "object": status(504, "Timeout", f"Too large resource version: {rv}")})
            return self._chunk(None)
        if too_old and api.gone_mode == "http":
            return self._json(410, gone)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if too_old:
            self._chunk({"type": "ERROR", "object": gone})
            return self._chunk(None)
        next_bookmark = time.monotonic() + interval if interval else float("inf")
        while True:
            with api._cond:
                while True:
                    if api._epoch != epoch:  # server stopped: stop() cuts the connection
                        self.close_connection = True
                        return
                    lost = api._dropped.get(kind.kind, 0) > last  # compacted before we sent it
                    pending = pending_of(api, kind, last)
                    now = time.monotonic()
                    if lost or pending or api._watch_gen != gen or now >= min(deadline, next_bookmark):
                        break
                    last = api._rv  # nothing for this kind up to now
                    api._cond.wait(min(deadline, next_bookmark) - now)
                cur, closed, compacted = api._rv, api._watch_gen != gen, api._compacted
            if lost:
                msg = f"too old resource version: {last} ({compacted})"
                self._chunk({"type": "ERROR", "object": status(410, "Expired", msg)})
                return self._chunk(None)
            for e in pending:
                event = translate(e, labels, fields)
                if event is not None:
                    self._chunk(event)
            last = cur
            if closed or now >= deadline:
                return self._chunk(None)
            if now >= next_bookmark:
                meta = {"resourceVersion": str(cur)}
                self._chunk({"type": "BOOKMARK", "object": {"kind": kind.kind, "apiVersion": kind.api_version,
                                                            "metadata": meta}})
                next_bookmark = now + (interval or 0.0)

    def _chunk(self, event: Obj | None) -> None:
        """Write one JSON line as one HTTP chunk; None writes the terminating chunk."""
        data = b"" if event is None else json.dumps(event).encode() + b"\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _json(self, code: int, body: Obj, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def pending_of(api: FakeAPIServer, kind: _Kind, after: int) -> list[_Event]:
    return [e for e in api._events if e.rv > after and e.kind == kind.kind]


def translate(e: _Event, labels: str, fields: str) -> Obj | None:
    """Event as a selector-filtered watcher sees it: leaving the selection is a DELETED."""
    def sel(o: Obj | None) -> bool:
        return o is not None and matches_labels(o, labels) and matches_fields(o, fields)

    was, now = sel(e.old), sel(e.new) and e.type != "DELETED"
    if e.type == "DELETED":
        etype = "DELETED" if was else None
    else:
        etype = "MODIFIED" if was and now else "ADDED" if now else "DELETED" if was else None
    return None if etype is None else {"type": etype, "object": copy.deepcopy(e.new)}


# -- object builders --------------------------------------------------------------------


def service(name: str, namespace: str = "default", labels: dict[str, str] | None = None,
            cluster_ip: str = "10.96.0.10", port: int = 80) -> Obj:
    return {
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels or {})},
        "spec": {"type": "ClusterIP", "clusterIP": cluster_ip, "clusterIPs": [cluster_ip],
                 "ports": [{"name": "http", "port": port, "protocol": "TCP", "targetPort": port}]},
    }


def endpoint_slice(name: str, service_name: str, addresses: list[str], namespace: str = "default",
                   port: int = 80, labels: dict[str, str] | None = None) -> Obj:
    return {
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": {"kubernetes.io/service-name": service_name, **(labels or {})}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [a], "conditions": {"ready": True}} for a in addresses],
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
    }


def node(name: str, labels: dict[str, str] | None = None) -> Obj:
    return {
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}},
        "spec": {"podCIDR": "10.244.0.0/24"},
    }
