"""Kubernetes API source: list+watch informers for Services, EndpointSlices and this Node.

Each resource runs its own informer thread (like client-go's reflector): a list, then a watch
from the list's resourceVersion with bookmarks. As the reflector lists, so that hundreds of nodes
starting or relisting at once are answered from the API server's watch cache, not from etcd: the
first list at resourceVersion "0", a relist at the last resourceVersion seen (unpaged), and only
when the server no longer has that version (410, or "too large" after etcd was restored) a
consistent list (resourceVersion unset, paginated; a continue token that expires mid-list ends
in one unpaged list). A 410 Gone from the watch (HTTP or ERROR event) relists and replaces that
resource's cache, after a pause (when an API server restarts every node's watch gets its 410 at
once); connection errors reconnect and re-watch from the last resourceVersion seen. Every wait is
capped exponential backoff with client-go's jitter (each delay d to 2d; a 429's Retry-After is
waited by urllib3's own retries, up to 3 times, before it counts as a failure), and each watch asks for a timeout between 1 and 2 times the configured one, so that nodes
which reconnected together drift apart. All HTTP goes through the official client's REST layer
(`_preload_content=False`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import threading
import time
from dataclasses import dataclass, field
from sys import intern
from typing import Any, Callable, Container, Iterator

import kubernetes.client
import kubernetes.config
import urllib3
from kubernetes.client.exceptions import ApiException
from kubernetes.utils.keepalive import tcp_keepalive_socket_options

from ..desired import SERVICE_NAME_LABEL
from ..metrics import TRIGGER_TIME_ANNOTATION, trigger_time
from .objects import KINDS, Location, SourceObject

log = logging.getLogger(__name__)

# kube-proxy's informer selector (cmd/kube-proxy/app/server.go: labels.NewSelector().Add(
# noProxyName, noHeadlessEndpoints).String(), requirements sorted by key).
PROXY_LABEL_SELECTOR = "!service.kubernetes.io/headless,!service.kubernetes.io/service-proxy-name"

Key = tuple[str, str]


class _Gone(Exception):
    """The resourceVersion (or continue token) is too old: relist."""


class _Refused(Exception):
    """The server refused the watch with an error of its own (an ERROR event, or an HTTP error
    other than 410 and 429: e.g. "Too large resource version" after etcd was restored from a
    backup): back off, then list again, as client-go's reflector does (re-watching from the same
    resourceVersion could be refused for ever)."""


class _TooLarge(_Refused):
    """The server has not reached the resourceVersion asked for (504 "Too large resource version",
    as after etcd was restored from a backup): list without one."""


class _ShortWatch(Exception):
    """The watch closed at once without any event; treated as an error (client-go does too)."""


@dataclass
class ChangeLog:
    """Service and EndpointSlice changes as kube-proxy's change trackers count them.

    `services` / `endpoint_slices`: every event (sync_proxy_rules_*_changes_total); the pending
    figures (sync_proxy_rules_*_changes_pending) and the trigger times (network programming
    latency) are what no snapshot has taken yet.
    """

    services: int = 0
    endpoint_slices: int = 0
    pending_services: set[Key] = field(default_factory=set)  # distinct Services with a change
    pending_slices: int = 0  # EndpointSlice events that changed the cache
    # the Service of a slice -> its slices' last-change-trigger-time annotations, one per event
    # (a deleted slice drops its Service's, as kube-proxy's endpoints change tracker does)
    trigger_times: dict[Key, list[str]] = field(default_factory=dict)
    dropped_triggers: set[Key] = field(default_factory=set)

    def record(self, kind: str, key: Key, old: dict[str, Any] | None, new: dict[str, Any] | None,
               changed: bool | None = None) -> None:
        """One event of `kind` for `key` (old/new: the cached bodies before and after; equal
        when the event changed nothing)."""
        if changed is None:  # (the caller may know: a released body's fingerprint is not made twice)
            changed = not _same(old, new)
        if kind == "Service":
            self.services += 1
            if changed:
                self.pending_services.add(key)
        elif kind == "EndpointSlice":
            self.endpoint_slices += 1
            if not changed:
                return
            self.pending_slices += 1
            service = (key[0], _service_name(new or old))
            if new is None:
                self.trigger_times.pop(service, None)
                self.dropped_triggers.add(service)
                return
            value = trigger_time(new)
            if value is not None:
                self.trigger_times.setdefault(service, []).append(value)

    def take(self) -> tuple[dict[Key, list[str]], set[Key]]:
        """Trigger times and the Services whose slices were deleted since the last take; the
        pending figures start again from 0."""
        taken = self.trigger_times, self.dropped_triggers
        self.pending_services, self.pending_slices = set(), 0
        self.trigger_times, self.dropped_triggers = {}, set()
        return taken


def _service_name(body: dict[str, Any] | None) -> str:
    """The name of an EndpointSlice's Service (its label; a released body's own field)."""
    if body is not None and _FINGERPRINT in body:
        return str(body.get(_SERVICE) or "")
    labels = ((body or {}).get("metadata") or {}).get("labels")
    return (labels.get(SERVICE_NAME_LABEL) if isinstance(labels, dict) else None) or ""


@dataclass
class _Informer:
    kind: str
    api_version: str
    call: Callable[..., Any]
    label_selector: str | None = None
    field_selector: str | None = None
    cache: dict[Key, dict[str, Any]] = field(default_factory=dict)
    order: list[Key] | None = None  # the cache's keys, sorted (None: to sort again, after an add or delete)
    touched: set[Key] = field(default_factory=set)  # keys whose body changed since the last snapshot
    resource_version: str = ""
    synced: bool = False
    # the server no longer has (or has not reached) resource_version: the next list is a
    # consistent one (client-go's isLastSyncResourceVersionUnavailable)
    version_unavailable: bool = False
    # the server paginated a list at resourceVersion "0" (its watch cache is off): relists at a
    # version are paginated too, as client-go's reflector keeps its page size then
    paginated: bool = False
    thread: threading.Thread | None = None
    # (monotonic) when its requests began to fail, since it last reached the API server (None: they
    # do not), and the last of those failures, described
    failing_since: float | None = None
    last_error: str = ""


def _api_error(exc: ApiException) -> str:
    """An API error in one line, with the server's own message (a 403 names the account and the
    verb it lacks, as client-go logs it): "HTTP 403 Forbidden: endpointslices.discovery.k8s.io is
    forbidden: User ...". (str() of the client's exception is several lines, headers included.)"""
    body = exc.body.decode("utf-8", "replace") if isinstance(exc.body, bytes) else str(exc.body or "")
    try:
        message = json.loads(body).get("message") if body.lstrip().startswith("{") else body
    except (ValueError, AttributeError):
        message = body
    message = " ".join(str(message or "").split())[:300]
    head = f"HTTP {exc.status} {exc.reason or ''}".rstrip() if exc.status else str(exc.reason or "API error")
    return f"{head}: {message}" if message else head


def _described(exc: object) -> str:
    """An error for the log: urllib3's own retries exhausted ("HTTPConnectionPool(...): Max retries
    exceeded with url: ... (Caused by NewConnectionError(...))", ~500 characters, though we retry)
    as the reason alone: "cannot reach the API server at 127.0.0.1:6443: [Errno 111] Connection refused"."""
    reason = getattr(exc, "reason", None)
    pool = getattr(exc, "pool", None)
    if isinstance(exc, urllib3.exceptions.MaxRetryError) and reason is not None:
        where = f" at {pool.host}:{pool.port}" if pool is not None else ""
        text = str(reason)
        if text.startswith(("<", "HTTP")) and ": " in text:  # ("HTTPConnection(host=..., port=...): ...")
            text = text.split(": ", 1)[1]
        return f"cannot reach the API server{where}: {text}"
    if isinstance(exc, ApiException):
        return _api_error(exc)
    return str(exc)


# TCP keepalive on the API connections (idle seconds, probe interval, probes): a watch whose
# connection died without a reset (the API server's host lost, a load balancer's failover that
# drops flows) would otherwise be noticed only when its read times out (330 s), every change
# meanwhile unseen; so it is found in ~45 s, as client-go's HTTP/2 pings find it (30 s idle, then
# 15 s), and the informer watches again on a new connection.
API_KEEPALIVE = (30, 5, 3)


def load_api_client(kubeconfig: str | None = None,
                    keepalive: tuple[int, int, int] = API_KEEPALIVE) -> kubernetes.client.ApiClient:
    """ApiClient from the in-cluster service account (None) or from a kubeconfig file."""
    cfg = kubernetes.client.Configuration()
    cfg.socket_options = tcp_keepalive_socket_options(*keepalive)
    if kubeconfig is None:
        kubernetes.config.load_incluster_config(client_configuration=cfg)
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        if host and host == os.environ.get("KUBERNETES_PORT_443_TCP_ADDR"):  # (the kubelet sets both so)
            log.warning("reaching the API server through the `kubernetes` Service's ClusterIP %s, which this "
                        "proxy programs itself: a node without its rules (new, or rebooted) cannot reach it; "
                        "set KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT to the API server's own "
                        "address (deploy/kubernetes/configmap.yaml), or give a kubeconfig", host)
    else:
        kubernetes.config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        token_file = _token_file(kubeconfig)
        if token_file is not None:
            _reread_token_file(cfg, token_file)
    return kubernetes.client.ApiClient(cfg)


TOKEN_FILE_PERIOD = 60.0  # seconds between reads of a kubeconfig's tokenFile (client-go: one minute)


def _token_file(kubeconfig: str) -> str | None:
    """The current user's tokenFile (relative to the kubeconfig's folder), when that user has no
    exec plugin or auth provider of its own (their tokens are refreshed by the client)."""
    loader = kubernetes.config.kube_config.KubeConfigLoader(
        config_dict=kubernetes.config.kube_config.KubeConfigMerger(kubeconfig).config)
    user = loader._user  # (the current context's user, as load_kube_config read it)
    if user is None or "tokenFile" not in user or "exec" in user or "auth-provider" in user:
        return None
    source = getattr(user, "path", None) or kubeconfig  # (the file of KUBECONFIG's list that named the user)
    return os.path.join(os.path.dirname(os.path.abspath(source)), str(user["tokenFile"]))


def _reread_token_file(cfg: kubernetes.client.Configuration, path: str) -> None:
    """Read `path` again at most every TOKEN_FILE_PERIOD seconds, as client-go reads a
    kubeconfig's tokenFile (kubeadm's kube-proxy kubeconfig names the pod's projected service
    account token, which the kubelet rotates; the client read it once only). A read that fails
    keeps the last token. The file's content is stripped as client-go strips it (the client sent
    a final newline along, which no HTTP header may hold). It replaces the client's own hook, which
    only reloads expiring credentials (an exec plugin's; not with a tokenFile) and sets the token
    read at start again."""
    read_at: list[float | None] = [None]
    token = [(cfg.api_key.get("BearerToken") or "").strip() or None]
    # (the client asks the hook only for a key it has: a file empty at start is read again too)
    cfg.api_key.setdefault("BearerToken", "")

    def refresh(c: kubernetes.client.Configuration) -> None:
        now = time.monotonic()
        if read_at[0] is None or now - read_at[0] >= TOKEN_FILE_PERIOD:
            read_at[0] = now
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read().strip()
            except (OSError, UnicodeError) as exc:
                log.warning("cannot read the kubeconfig's tokenFile %s again (%s): keeping the token read before",
                            path, exc)
            else:
                if text:
                    token[0] = f"Bearer {text}"
        c.api_key["BearerToken"] = token[0] or ""

    cfg.refresh_api_key_hook = refresh


class KubernetesSource:
    """Informer-style cache of Services, EndpointSlices and the named Node; thread-safe.

    `on_change` is called (from a worker thread, never concurrently with itself) once when
    every initial list has completed, then after each cache change.
    """

    def __init__(
        self,
        api_client: kubernetes.client.ApiClient,
        node_name: str,
        on_change: Callable[[], None] | None = None,
        backoff_max: float = 30.0,
        *,
        backoff_initial: float = 0.8,
        page_size: int = 500,
        watch_timeout: int = 300,
        connect_timeout: float = 10.0,
    ) -> None:
        core = kubernetes.client.CoreV1Api(api_client)
        discovery = kubernetes.client.DiscoveryV1Api(api_client)
        self._informers = [
            _Informer("Service", "v1", core.list_service_for_all_namespaces, PROXY_LABEL_SELECTOR),
            _Informer(
                "EndpointSlice",
                "discovery.k8s.io/v1",
                discovery.list_endpoint_slice_for_all_namespaces,
                PROXY_LABEL_SELECTOR,
            ),
            _Informer("Node", "v1", core.list_node, field_selector=f"metadata.name={node_name}"),
        ]
        assert tuple(inf.kind for inf in self._informers) == KINDS  # (snapshot()'s order)
        self._on_change = on_change
        self._backoff_initial = min(backoff_initial, backoff_max)
        self._backoff_max = backoff_max
        self._page_size = page_size
        self._watch_timeout = watch_timeout
        self._connect_timeout = connect_timeout
        self._lock = threading.Lock()
        self._memo: dict[tuple[str, str, str], SourceObject] = {}  # snapshot objects, reused while unchanged
        # snapshot objects made since the last release_bodies(), the newest of each (while builds
        # fail, objects that change again do not pile up)
        self._unreleased: dict[tuple[str, str, str], SourceObject] = {}
        self._last: list[SourceObject] | None = None  # the last snapshot ...
        self._index: dict[tuple[str, str, str], int] = {}  # ... and where each object is in it
        self._notify_lock = threading.Lock()
        self._stop = threading.Event()
        self._synced = threading.Event()
        self._streams: set[Any] = set()
        self._started = False
        self._counters: dict[str, int] = dict.fromkeys(
            ("events", "bookmarks", "lists", "relists", "errors"), 0
        )
        self._requests: dict[str, int] = {}  # HTTP status code (or "<error>") -> requests
        self.host = urllib3.util.parse_url(api_client.configuration.host).netloc or ""
        self._changes = ChangeLog()

    # -- public API ------------------------------------------------------------------

    def start(self) -> None:
        """Start one informer thread per resource."""
        with self._lock:
            if self._started:
                raise RuntimeError("KubernetesSource already started")
            self._started = True
        for inf in self._informers:
            inf.thread = threading.Thread(
                target=self._run, args=(inf,), name=f"k8s-informer-{inf.kind}", daemon=True
            )
            inf.thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the informers: abort open watch streams and join the threads (bounded)."""
        self._stop.set()
        with self._lock:
            streams = list(self._streams)
        for resp in streams:
            _abort(resp)
        deadline = time.monotonic() + timeout
        for inf in self._informers:
            if inf.thread is not None and inf.thread is not threading.current_thread():
                inf.thread.join(max(0.0, deadline - time.monotonic()))

    FAILING_AFTER = 10.0  # seconds: a relist, a watch closed at once, one reset are retried sooner

    @property
    def failing(self) -> str | None:
        """Why the API server cannot be read now: the first informer whose requests have failed for
        FAILING_AFTER seconds or more since it last reached it, and its last error (None: none)."""
        now = time.monotonic()
        for inf in self._informers:
            since = inf.failing_since
            if since is not None and now - since >= self.FAILING_AFTER:
                return f"source: the API server cannot be read ({inf.kind} informer: {inf.last_error}); retrying"
        return None

    def wait_synced(self, timeout: float | None = None) -> bool:
        """True once every initial list (services, endpointslices, node) has completed."""
        return self._synced.wait(timeout)

    def snapshot(self) -> list[SourceObject]:
        """The whole cache, consistent, ordered by kind, namespace, name.

        Bodies are shared, not copied: the informers replace a body on every change and never
        mutate one, so callers must treat them as read-only. An unchanged object comes back as the
        very same SourceObject, which lets the run loop's caches skip it (O(changes) per sync).
        """
        with self._lock:  # (the informers are in KINDS' order; an endpoint change keeps each one's order)
            whole = self._last is None or any(inf.order is None for inf in self._informers)
            items = []
            for inf in self._informers:
                if whole:
                    if inf.order is None:
                        inf.order = sorted(inf.cache)
                    cache = inf.cache
                    items += [(inf.kind, key, cache[key]) for key in inf.order]
                else:  # (the same objects as last time: only those changed are looked at, O(changes))
                    items += [(inf.kind, key, inf.cache[key]) for key in inf.touched]
                inf.touched = set()
        if not whole:
            assert self._last is not None
            out = list(self._last)
            for kind, (ns, name), body in items:
                at = self._index[(kind, ns, name)]
                if out[at].body is not body:
                    out[at] = obj = SourceObject(kind, ns, name, body, Location(f"kubernetes:{kind}/{ns}/{name}"))
                    self._memo[(kind, ns, name)] = obj
                    if kind != "Node":
                        self._unreleased[(kind, ns, name)] = obj
            self._last = out
            return list(out)
        out, memo = [], {}
        for kind, (ns, name), body in items:
            obj = self._memo.get((kind, ns, name))
            if obj is None or obj.body is not body:
                obj = SourceObject(kind, ns, name, body, Location(f"kubernetes:{kind}/{ns}/{name}"))
                if kind != "Node":
                    self._unreleased[(kind, ns, name)] = obj
            memo[(kind, ns, name)] = obj
            out.append(obj)
        self._memo = memo
        self._unreleased = {k: o for k, o in self._unreleased.items() if k in memo}  # (not those deleted)
        self._last, self._index = out, {key: i for i, key in enumerate(memo)}
        return list(out)

    def release_bodies(self, built: Container[int]) -> None:
        """The caller has built the snapshot objects whose id() is in `built` (its build cache
        keeps what it parsed, by object identity): their bodies are cut down to what the change
        log reads (an EndpointSlice's Service) and a fingerprint of the whole, which tells an
        unchanged body from the server at a relist. In the informer cache too,
        unless a newer body has replaced it meanwhile. The others (not built yet, or refused) stay
        whole. O(objects made since the last call); Node bodies stay (the run loop reads them)."""
        pending, self._unreleased = self._unreleased, {}
        for key, obj in pending.items():
            if id(obj) not in built:
                if self._memo.get(key) is obj:  # (still current: built later, or never)
                    self._unreleased[key] = obj
                continue
            whole = obj.body
            if _FINGERPRINT in whole:
                continue
            reduced = _released(whole)
            inf = self._informer(obj.kind)
            with self._lock:
                if inf.cache.get((obj.namespace, obj.name)) is whole:
                    inf.cache[(obj.namespace, obj.name)] = reduced
            object.__setattr__(obj, "body", reduced)

    def changes(self) -> tuple[int, int, int, int]:
        """(Service events, EndpointSlice events, pending Services, pending EndpointSlice
        events): see ChangeLog."""
        with self._lock:
            c = self._changes
            return c.services, c.endpoint_slices, len(c.pending_services), c.pending_slices

    def take_changes(self) -> tuple[dict[Key, list[str]], set[Key]]:
        """What changed since the last take, as the sync about to read a snapshot takes it
        (ChangeLog.take); call it just before snapshot()."""
        with self._lock:
            return self._changes.take()

    @property
    def counters(self) -> dict[str, int]:
        """Copy of the metrics counters.

        events (ADDED/MODIFIED/DELETED), bookmarks, lists (all completed lists), relists
        (lists after a resource's first one), errors (failures that caused a backoff).
        """
        with self._lock:
            return dict(self._counters)

    @property
    def requests(self) -> dict[str, int]:
        """Requests to the API server so far, by the HTTP status code they got ("<error>": none,
        the connection failed), as client-go's rest_client_requests_total counts them."""
        with self._lock:
            return dict(self._requests)

    def _count_request(self, code: str) -> None:
        with self._lock:
            self._requests[code] = self._requests.get(code, 0) + 1

    def resource_version(self, kind: str) -> str:
        """Last resourceVersion seen for `kind` (from a list, event or bookmark)."""
        with self._lock:
            return self._informer(kind).resource_version

    # -- informer loop ---------------------------------------------------------------

    def _informer(self, kind: str) -> _Informer:
        for inf in self._informers:
            if inf.kind == kind:
                return inf
        raise KeyError(kind)

    def _run(self, inf: _Informer) -> None:
        need_list = True
        # backoff steps taken since a watch last brought an event or was answered (a list that
        # succeeds does not reset them: a server whose every watch fails right after the list is
        # relisted less and less often)
        failures = 0
        short = 0  # watches in a row that the server opened, then closed at once (backed off too)
        while not self._stop.is_set():
            progressed = [False, False]  # (an event came; the server answered the watch)
            try:
                if need_list:
                    self._list(inf)
                    need_list = False
                self._watch(inf, progressed)
                failures, short = 0, 0
            except _Gone:
                if self._stop.is_set():
                    break
                if need_list:  # (the list itself)
                    failures = self._error(inf, "list expired", failures)
                    continue
                need_list = True
                failures = 0 if progressed[0] else failures
                delay = self._delay(failures)
                log.info("%s: resourceVersion %s too old, relisting in %.2fs", inf.kind, inf.resource_version, delay)
                self._stop.wait(delay)
                failures += 1
            except _Refused as exc:
                if self._stop.is_set():
                    break
                need_list = True
                failures = self._error(inf, f"{exc}; relisting", 0 if progressed[0] else failures)
            except Exception as exc:  # noqa: BLE001 - any failure: back off and retry
                if self._stop.is_set():
                    break
                if progressed[0]:
                    failures = short = 0
                elif progressed[1]:  # the server answered: an outage before it is over, not counted
                    # (a server that closes every watch at once is backed off all the same)
                    failures, short = (short, short + 1) if isinstance(exc, _ShortWatch) else (0, 0)
                failures = self._error(inf, exc, failures)

    def _delay(self, failures: int) -> float:
        """The wait after `failures` backoff steps: doubling from the initial delay up to the cap,
        then spread over [d, 2d) as client-go's reflector spreads it (jitter 1.0)."""
        doubled = self._backoff_initial * 2 ** min(failures, 30)  # (an outage of days: no overflow)
        return min(self._backoff_max, doubled) * random.uniform(1.0, 2.0)

    def _error(self, inf: _Informer, exc: object, failures: int) -> int:
        with self._lock:
            self._counters["errors"] += 1
        delay = self._delay(failures)
        inf.last_error = _described(exc)
        if inf.failing_since is None:
            inf.failing_since = time.monotonic()
        log.warning("%s informer: %s; keeping what it has, retrying in %.2fs", inf.kind, inf.last_error, delay)
        self._stop.wait(delay)
        return failures + 1

    def _request(self, inf: _Informer, read_timeout: float, **params: Any) -> Any:
        if inf.label_selector:
            params["label_selector"] = inf.label_selector
        if inf.field_selector:
            params["field_selector"] = inf.field_selector
        try:
            resp = inf.call(
                _preload_content=False,
                _request_timeout=(self._connect_timeout, read_timeout),
                **params,
            )
        except ApiException as exc:
            self._count_request(str(exc.status) if exc.status else "<error>")
            if exc.status == 410:
                raise _Gone(_api_error(exc)) from exc
            if exc.status == 504 and "ResourceVersionTooLarge" in str(exc.body or ""):
                raise _TooLarge(f"HTTP {exc.status}: too large resource version") from exc
            if exc.status not in (None, 0, 429, 500, 503, 504):  # (overloaded or failing server: watch again)
                raise _Refused(_api_error(exc)) from exc
            raise
        except Exception:
            self._count_request("<error>")
            raise
        self._count_request(str(getattr(resp, "status", 200)))
        return resp

    def _list(self, inf: _Informer) -> None:
        """List as client-go's reflector does (relistResourceVersion): "0" first, then the last
        resourceVersion seen, and without one only once the server has lost that version."""
        version = "" if inf.version_unavailable else (inf.resource_version or "0")
        try:
            self._list_pages(inf, version)
        except (_Gone, _TooLarge) as exc:
            if not version:
                raise
            log.info("%s: cannot list at resourceVersion %s (%s): listing the current state", inf.kind, version, exc)
            inf.version_unavailable = True
            self._list_pages(inf, "")
        inf.version_unavailable = False

    def _list_pages(self, inf: _Informer, version: str) -> None:
        items: dict[Key, dict[str, Any]] = {}
        params: dict[str, Any] = {}
        if version:
            params["resource_version"] = version
        if version in ("", "0") or inf.paginated:  # (at a version: one answer from the watch cache)
            params["limit"] = self._page_size
        while True:
            try:
                resp = self._request(inf, 60.0, **params)
            except _Gone as exc:
                if "_continue" not in params:
                    raise
                # the snapshot expired between pages: one list without pages (client-go's pager,
                # FullListIfExpired), which paging again could not make sure of
                log.info("%s: list expired between pages (%s): listing again, whole", inf.kind, exc)
                params = {}
                items = {}
                continue
            def take(obj: Any) -> None:
                if isinstance(obj, dict):
                    body = self._normalize(inf, obj)
                    items[_key(body)] = body

            try:  # (read, not resp.data: that keeps the bytes beside their text while the items are parsed)
                text = resp.read().decode("utf-8-sig")
            finally:
                resp.release_conn()
            meta = _list_body(text, take)
            del text
            if not meta.get("continue"):
                break
            if version == "0" and "_continue" not in params:
                inf.paginated = True
            params.pop("resource_version", None)  # (not allowed beside a continue token)
            params["_continue"] = meta["continue"]
        self._replace(inf, items, str(meta.get("resourceVersion", "")))

    def _watch(self, inf: _Informer, progressed: list[bool]) -> None:
        with self._lock:
            rv = inf.resource_version
        started = time.monotonic()
        timeout = int(self._watch_timeout * random.uniform(1.0, 2.0))  # (client-go: 5 to 10 minutes)
        resp = self._request(
            inf,
            timeout + 30.0,
            watch=True,
            resource_version=rv,
            allow_watch_bookmarks=True,
            timeout_seconds=timeout,
        )
        progressed[1] = True
        if inf.failing_since is not None:
            inf.failing_since = None
            log.info("%s informer: the API server answers again; watching from resourceVersion %s", inf.kind, rv)
        with self._lock:
            self._streams.add(resp)
        clean = False
        try:
            if self._stop.is_set():
                return
            for line in _lines(resp):
                if self._stop.is_set():
                    return
                if line.strip():
                    self._handle(inf, json.loads(line))
                    progressed[0] = True
            clean = True
        finally:
            with self._lock:
                self._streams.discard(resp)
            if not clean:
                resp.close()  # don't reuse a half-read connection
            resp.release_conn()
        if not progressed[0] and time.monotonic() - started < 1.0:
            raise _ShortWatch(f"{inf.kind} watch closed immediately without events")

    def _handle(self, inf: _Informer, event: dict[str, Any]) -> None:
        etype = event.get("type")
        obj = event.get("object") or {}
        if etype == "ERROR":
            message = str(obj.get("message", ""))
            if obj.get("code") == 410 or "too old resource version" in message:
                raise _Gone(message or "410 Gone")
            raise _Refused(f"watch error: {obj.get('code')} {message}")
        rv = str((obj.get("metadata") or {}).get("resourceVersion", ""))
        if etype == "BOOKMARK":
            with self._lock:
                self._counters["bookmarks"] += 1
                if rv:
                    inf.resource_version = rv
            return
        if etype not in ("ADDED", "MODIFIED", "DELETED"):
            raise RuntimeError(f"unexpected watch event type {etype!r}")
        body = self._normalize(inf, obj)
        key = _key(body)
        with self._lock:
            self._counters["events"] += 1
            if rv:
                inf.resource_version = rv
            old = inf.cache.get(key)
            if etype == "DELETED" and inf.kind == "Node" and old is not None:
                inf.cache[key] = _deleted_node(old)
                changed = inf.cache[key] != old
                inf.touched.add(key)
            elif etype == "DELETED":
                changed = inf.cache.pop(key, None) is not None
                if changed:
                    inf.order = None
                self._changes.record(inf.kind, key, old, None)
            else:
                changed = not _same(old, body)
                if changed:  # (an equal body keeps the old one: the same SourceObject, nothing to rebuild)
                    if old is None:
                        inf.order = None
                    inf.cache[key] = body
                    inf.touched.add(key)
                self._changes.record(inf.kind, key, old, body, changed)
            notify = changed and self._synced.is_set()
        if notify:
            self._notify()

    def _replace(self, inf: _Informer, items: dict[Key, dict[str, Any]], rv: str) -> None:
        # what the list left as it was, worked out without the lock (a relist of 10k Services
        # fingerprints each body: the run loop's snapshot would wait); only this thread changes
        # the cache's state meanwhile (release_bodies swaps a body for its released form)
        with self._lock:
            cached = dict(inf.cache)
        same = {k for k, v in items.items() if _same(cached.get(k), v)}
        with self._lock:
            self._counters["lists"] += 1
            if inf.synced:
                self._counters["relists"] += 1
            # keep the old body object where nothing changed, so snapshots stay identical
            items = {k: (inf.cache[k] if k in same else v) for k, v in items.items()}
            if inf.kind == "Node":  # (a Node deleted meanwhile: see _deleted_node)
                items.update({k: _deleted_node(v) for k, v in inf.cache.items() if k not in items})
            changed = inf.cache != items
            for k in inf.cache.keys() | items.keys():  # each object listed, or gone, is an event (client-go's
                self._changes.record(inf.kind, k, inf.cache.get(k), items.get(k))  # Replace updates them all)
            if inf.cache.keys() != items.keys():
                inf.order = None
            else:
                inf.touched.update(k for k, v in items.items() if inf.cache[k] is not v)
            inf.cache = items
            inf.resource_version = rv
            inf.synced = True
            first_sync = not self._synced.is_set() and all(i.synced for i in self._informers)
            if first_sync:
                self._synced.set()
            notify = first_sync or (changed and self._synced.is_set())
        if notify:
            self._notify()

    def _notify(self) -> None:
        if self._on_change is None:
            return
        with self._notify_lock:
            try:
                self._on_change()
            except Exception:  # noqa: BLE001 - a bad callback must not kill the informer
                log.exception("on_change callback failed")

    @staticmethod
    def _normalize(inf: _Informer, obj: dict[str, Any]) -> dict[str, Any]:
        """List items lack apiVersion/kind; add them like `kubectl get -o json` does. Of a Node
        only what the proxy reads is kept (its name, labels and addresses; its deletion and
        taints for /healthz's node eligibility): its status changes every few seconds, and
        kube-proxy too syncs on a Node's labels changing only. Of Services and EndpointSlices
        what no proxy reads goes too (see _stripped): at 10k Services, managedFields alone
        were half the cache."""
        if inf.kind in _KEPT:
            obj = _stripped(obj, _KEPT[inf.kind])
        elif inf.kind == "Node":
            meta = obj.get("metadata") or {}
            kept = {"name": meta.get("name"), "labels": meta.get("labels") or {}}
            if meta.get("deletionTimestamp"):
                kept["deletionTimestamp"] = meta["deletionTimestamp"]
            obj = {"metadata": kept, "spec": {"taints": (obj.get("spec") or {}).get("taints") or []},
                   "status": {"addresses": (obj.get("status") or {}).get("addresses") or []}}
        return {"apiVersion": inf.api_version, "kind": inf.kind, **obj}


# What the proxy reads of each kind (its desired state, its change metrics), as trees of the
# fields kept: None keeps a field whole; a dict keeps those of its fields (of each item of a list).
_METADATA = {"name": None, "namespace": None, "labels": None,
             "annotations": {TRIGGER_TIME_ANNOTATION: None}}  # (network programming latency)
_KEPT: dict[str, dict[str, Any]] = {
    "Service": {"metadata": _METADATA, "spec": None, "status": {"loadBalancer": None}},
    "EndpointSlice": {"metadata": _METADATA, "addressType": None, "ports": None,
                      "endpoints": {"addresses": None, "conditions": None, "nodeName": None, "zone": None,
                                    "hints": None}},
}


_FINGERPRINT = "fingerprint"  # (a released body's fields: see release_bodies)
_SERVICE = "service"


def _fingerprint(body: Any) -> bytes:
    return hashlib.blake2b(json.dumps(body, separators=(",", ":")).encode(), digest_size=16).digest()


def _released(body: dict[str, Any]) -> dict[str, Any]:
    """What a built body keeps: the fingerprint of the whole and, of an EndpointSlice, the name
    of its Service (the change log's, when the slice is deleted). Nothing else of it is read
    again: 10k Services, their metadata kept was ~12 MiB."""
    reduced: dict[str, Any] = {_FINGERPRINT: _fingerprint(body)}
    if body.get("kind") == "EndpointSlice":
        reduced[_SERVICE] = _service_name(body)
    return reduced


def _same(old: Any, new: Any) -> bool:
    """Whether a cached body and one from the server are the same object state (a released
    body by its fingerprint; the server's bodies are never released ones)."""
    if old is new:
        return True
    if old is None or new is None:
        return False
    fingerprint = old.get(_FINGERPRINT) if isinstance(old, dict) else None
    if fingerprint is not None and not (isinstance(new, dict) and _FINGERPRINT in new):
        return bool(fingerprint == _fingerprint(new))
    return bool(old == new)


def _stripped(value: Any, kept: dict[str, Any]) -> Any:
    """value with only the fields of `kept` (managedFields, the last-applied annotation, status
    conditions, an endpoint's targetRef go), shared (see _shared); a value of another shape stays
    as it is, for the build to report."""
    if isinstance(value, list):
        return [_stripped(item, kept) for item in value]
    if not isinstance(value, dict):
        return value
    return {intern(k): (_shared(v, k) if kept[k] is None else _stripped(v, kept[k]))
            for k, v in value.items() if k in kept}


# fields whose values a cluster has few of (node names, zones, namespaces, protocols, policies)
_FEW_VALUES = frozenset({"namespace", "nodeName", "zone", "protocol", "appProtocol", "addressType", "type",
                         "sessionAffinity", "ipFamilies", "ipFamilyPolicy", "internalTrafficPolicy",
                         "externalTrafficPolicy", "ipMode"})
_STRINGS: dict[str, str] = {}  # their values, one string each
STRINGS_MAX = 1 << 16  # (then it starts again: a cluster whose nodes come and go never grows it for ever)


def _shared(value: Any, field: str) -> Any:
    """value (of `field`) with each mapping key as the one interned string of its text, and the
    values of the _FEW_VALUES fields as one string each. The JSON decoder makes new strings for
    every item: 10k Services and their slices held ~40 MiB of copies of the same keys, node
    names, zones, namespaces and protocols. (Values are not interned: an interned string lives
    for ever on some Pythons, and pod IPs, names and times come and go.)"""
    kind = type(value)
    if kind is dict:
        return {intern(k) if type(k) is str else k: _shared(v, k) for k, v in value.items()}
    if kind is list:
        return [_shared(v, field) for v in value]
    if kind is str and field in _FEW_VALUES:
        one = _STRINGS.get(value)
        if one is None:
            if len(_STRINGS) >= STRINGS_MAX:
                _STRINGS.clear()
            one = _STRINGS.setdefault(value, value)
        return one
    return value


_WHITESPACE = re.compile(r"[ \t\n\r]*")


def _list_body(text: str, take: Callable[[Any], None]) -> dict[str, Any]:
    """A list response: each of its items given to `take` as soon as it is parsed, one at a time
    (a 10k-Service cluster's EndpointSlice list answered from the watch cache is one ~60 MB
    body: parsed whole, its tree peaked at ~300 MiB before anything was stripped); returns its
    metadata. ValueError when it is no JSON object (as json.loads reads one: strict)."""
    decode = json.JSONDecoder().raw_decode
    meta: dict[str, Any] = {}

    def skip(i: int) -> int:
        return _WHITESPACE.match(text, i).end()  # type: ignore[union-attr]

    def expect(i: int, char: str) -> int:
        if text[i:i + 1] != char:
            raise ValueError(f"expected {char!r} at character {i} of the list")
        return skip(i + 1)

    def comma(i: int, close: str) -> int:  # (after a member or an item: ',' and another, or the close)
        if text[i:i + 1] == ",":
            i = skip(i + 1)
            if text[i:i + 1] == close:
                raise ValueError(f"unexpected {close!r} after ',' at character {i} of the list")
        elif text[i:i + 1] != close:
            raise ValueError(f"expected ',' or {close!r} at character {i} of the list")
        return i

    i = expect(skip(0), "{")
    while text[i:i + 1] != "}":
        if text[i:i + 1] != '"':
            raise ValueError(f"expected a member name at character {i} of the list")
        key, i = decode(text, i)
        i = expect(skip(i), ":")
        if key == "items" and text[i:i + 1] == "[":
            i = skip(i + 1)
            while text[i:i + 1] != "]":
                item, i = decode(text, i)
                take(item)
                i = comma(skip(i), "]")
            i += 1
        else:
            value, i = decode(text, i)
            if key == "metadata" and isinstance(value, dict):
                meta = value
        i = comma(skip(i), "}")
    if skip(i + 1) != len(text):
        raise ValueError(f"unexpected text after the list at character {skip(i + 1)}")
    return meta


def _deleted_node(body: dict[str, Any]) -> dict[str, Any]:
    """This node's Node once deleted: kept as last seen, marked deleted. kube-proxy keeps the zone
    and node IPs it had (its topology handler ignores deletes; its NodeManager exits, leaving the
    rules in place), so routing stays as it was; /healthz reports the node ineligible."""
    meta = body.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return body
    log.warning("Node %s was deleted: keeping its last labels and addresses; /healthz reports it ineligible",
                meta.get("name"))
    return {**body, "metadata": {**meta, "deletionTimestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}}


def _key(body: dict[str, Any]) -> Key:
    meta = body.get("metadata") or {}
    return (meta.get("namespace") or "", meta.get("name") or "")


def _lines(resp: Any) -> Iterator[str]:
    """Split a streamed (chunked) watch response into JSON lines."""
    buf = b""
    for chunk in resp.stream(amt=None, decode_content=False):
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            yield line.decode("utf-8", errors="replace")
    if buf.strip():
        yield buf.decode("utf-8", errors="replace")


def _abort(resp: Any) -> None:
    """Interrupt a blocking read on a streaming urllib3 response from another thread."""
    try:
        resp.shutdown()
    except Exception:  # noqa: BLE001 - already released or closed
        pass
