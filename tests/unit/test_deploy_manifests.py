"""Static checks for the deployment artefacts under deploy/ and the Containerfile.

Every Kubernetes manifest is validated offline, in strict mode (unknown fields
fail), against the OpenAPI-derived JSON schemas shipped inside the
``kubernetes-validate`` package. No cluster and no network are needed; a
fixture makes any socket connect attempt fail to prove it.
"""

from __future__ import annotations

import json
import re
import shlex
import socket
from pathlib import Path

import jsonschema
import pytest
import yaml

try:
    import kubernetes_validate
    from kubernetes_validate import utils as kv_utils
except ImportError:  # pragma: no cover - reported by the test itself
    kubernetes_validate = None
    kv_utils = None

ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = ROOT / "deploy" / "kubernetes"
EDGE_DIR = ROOT / "deploy" / "edge"
CONTAINERFILE = ROOT / "Containerfile"

# Oldest Kubernetes minor we support; the newest schema the installed
# kubernetes-validate ships is checked as well.
MIN_K8S_VERSION = "1.30.0"

NAMESPACE = "kube-system"
NAME = "service-reconciler"
IMAGE = "ghcr.io/service-reconciler/service-reconciler:0.1.0"
CONFIG_PATH = "/var/lib/reconciler/config.conf"
HEALTHZ_PORT = 10256
HEALTHZ_PORT_NAME = "healthz"
SYSCTL_MOUNT = "/host/proc/sys/net/netfilter"

# `reconciler run` flags (the CLI contract the manifests and units rely on).
RUN_FLAGS = {
    "--source",
    "--kubeconfig",
    "--config",
    "--mode",
    "--node-name",
    "--cluster-cidr",
    "--nodeport-addresses",
    "--masquerade-all",
    "--service-cidr",
    "--min-sync-period",
    "--sync-period",
    "--healthz-bind-address",
    "--metrics-bind-address",
    "--log-format",
    "--conntrack-max-per-core",
    "--conntrack-min",
    "--conntrack-tcp-timeout-established",
    "--conntrack-tcp-timeout-close-wait",
    "--conntrack-tcp-be-liberal",
    "--conntrack-udp-timeout",
    "--conntrack-udp-timeout-stream",
    "--conntrack-sysctl-dir",
}

EXPECTED_RBAC = {
    ("", "services", frozenset({"list", "watch"})),
    ("discovery.k8s.io", "endpointslices", frozenset({"list", "watch"})),
    ("", "nodes", frozenset({"list", "watch"})),
    ("events.k8s.io", "events", frozenset({"create"})),
}

# Not Kubernetes API objects: no OpenAPI schema exists for them.
NON_API_KINDS = {("kustomize.config.k8s.io/v1beta1", "Kustomization")}


# --------------------------------------------------------------- helpers ----


def _manifest_files() -> list[Path]:
    return sorted(p for p in K8S_DIR.rglob("*") if p.suffix in {".yaml", ".yml"})


def _load_docs(path: Path) -> list[dict]:
    with path.open() as fh:
        return [d for d in yaml.safe_load_all(fh) if d is not None]


def _all_docs() -> list[tuple[Path, dict]]:
    return [(p, d) for p in _manifest_files() for d in _load_docs(p)]


def _one(kind: str) -> dict:
    found = [d for _, d in _all_docs() if d.get("kind") == kind]
    assert len(found) == 1, f"expected exactly one {kind}, found {len(found)}"
    return found[0]


def _schema_versions() -> list[str]:
    if kv_utils is None:
        return [MIN_K8S_VERSION]
    latest = kv_utils.latest_version()
    return sorted({MIN_K8S_VERSION, latest}, key=lambda v: tuple(map(int, v.split("."))))


def _parse_unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """Minimal systemd unit parser: keeps repeated keys, joins continuations."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    logical: list[str] = []
    buf = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith(("#", ";"))):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        logical.append(buf + line)
        buf = ""
    assert not buf, f"{path}: dangling line continuation"
    for line in logical:
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1]
            sections.setdefault(current, [])
            continue
        assert current is not None, f"{path}: key outside a section: {line!r}"
        key, sep, value = line.partition("=")
        assert sep, f"{path}: not a key=value line: {line!r}"
        sections[current].append((key.strip(), value.strip()))
    return sections


def _values(unit: dict, section: str, key: str) -> list[str]:
    return [v for k, v in unit.get(section, []) if k == key]


def _value(unit: dict, section: str, key: str) -> str:
    vals = _values(unit, section, key)
    assert vals, f"[{section}] {key}= missing"
    return vals[-1]


def _flags(argv: list[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in argv if a.startswith("--")}


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("schema validation tried to use the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


# ------------------------------------------------------ schema validation ----


def test_manifests_exist():
    names = {p.name for p in _manifest_files()}
    assert {
        "serviceaccount.yaml",
        "clusterrole.yaml",
        "clusterrolebinding.yaml",
        "configmap.yaml",
        "daemonset.yaml",
        "kustomization.yaml",
    } <= names


@pytest.mark.parametrize("k8s_version", _schema_versions())
@pytest.mark.parametrize(
    "path", _manifest_files(), ids=lambda p: str(p.relative_to(K8S_DIR))
)
def test_manifest_validates_against_k8s_schema(path, k8s_version, no_network):
    if kubernetes_validate is None:
        pytest.fail("kubernetes-validate is not installed (pip install -e '.[test]')")
    assert k8s_version in kv_utils.all_versions(), (
        f"kubernetes-validate {kubernetes_validate.__version__} ships no {k8s_version} schemas"
    )
    docs = _load_docs(path)
    assert docs, f"{path} is empty"
    for doc in docs:
        assert isinstance(doc, dict) and "apiVersion" in doc and "kind" in doc, path
        if (doc["apiVersion"], doc["kind"]) in NON_API_KINDS:
            continue
        error = None
        try:
            validated = kubernetes_validate.validate(doc, k8s_version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            error = f"{doc['kind']} invalid for k8s {k8s_version} at {where}: {exc.message}"
        except kubernetes_validate.SchemaNotFoundError as exc:
            error = exc.message
        if error:  # fail outside `except` so the (huge) schema isn't dumped
            pytest.fail(f"{path.name}: {error}", pytrace=False)
        assert validated == kv_utils.major_minor(k8s_version)


def test_strict_validation_rejects_unknown_fields(no_network):
    """Guard: strict mode really catches typos in nested pod spec fields."""
    if kubernetes_validate is None:
        pytest.fail("kubernetes-validate is not installed")
    ds = _one("DaemonSet")
    bad = yaml.safe_load(yaml.safe_dump(ds))
    bad["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, MIN_K8S_VERSION, strict=True)


# ------------------------------------------------------------- DaemonSet ----


@pytest.fixture
def daemonset() -> dict:
    return _one("DaemonSet")


@pytest.fixture
def pod_spec(daemonset) -> dict:
    return daemonset["spec"]["template"]["spec"]


@pytest.fixture
def container(pod_spec) -> dict:
    containers = pod_spec["containers"]
    assert len(containers) == 1
    return containers[0]


def test_namespaced_objects_live_in_kube_system():
    for path, doc in _all_docs():
        if doc["kind"] in {"ServiceAccount", "ConfigMap", "DaemonSet"}:
            assert doc["metadata"].get("namespace") == NAMESPACE, path.name
        if doc["kind"] in {"ClusterRole", "ClusterRoleBinding", "Kustomization"}:
            assert "namespace" not in doc.get("metadata", {}), path.name


def test_daemonset_pod_basics(daemonset, pod_spec, container):
    assert pod_spec["hostNetwork"] is True
    # the node's resolver: cluster DNS answers through the rules this pod programs
    assert pod_spec["dnsPolicy"] == "Default"
    assert pod_spec["priorityClassName"] == "system-node-critical"
    assert {"operator": "Exists"} in pod_spec["tolerations"]
    assert pod_spec["serviceAccountName"] == _one("ServiceAccount")["metadata"]["name"]
    assert container["image"] == IMAGE
    selector = daemonset["spec"]["selector"]["matchLabels"]
    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items()


def test_daemonset_update_strategy(daemonset):
    strategy = daemonset["spec"]["updateStrategy"]
    assert strategy["type"] == "RollingUpdate"
    assert strategy["rollingUpdate"]["maxUnavailable"] == "10%"


def test_daemonset_security_context(container, pod_spec):
    sc = container["securityContext"]
    assert sc.get("privileged") is False
    assert sc.get("allowPrivilegeEscalation") is False
    assert {"NET_ADMIN", "NET_RAW", "NET_BIND_SERVICE"} <= set(sc["capabilities"]["add"])
    assert "SYS_ADMIN" not in sc["capabilities"]["add"]
    assert pod_spec.get("securityContext", {}).get("privileged") is not True


def test_daemonset_args_and_env(container):
    assert "command" not in container, "rely on the image ENTRYPOINT [reconciler]"
    args = container["args"]
    assert args == [
        "run",
        "--source",
        "kubernetes",
        "--config",
        CONFIG_PATH,
        "--node-name",
        "$(NODE_NAME)",
        "--conntrack-sysctl-dir",
        SYSCTL_MOUNT,
    ]
    assert _flags(args) <= RUN_FLAGS
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"


def test_api_server_address_is_required_from_the_config_map(container):
    """In-cluster config would reach the API server through the `kubernetes` ClusterIP, which
    this pod programs: a node with no rules yet could never connect. Both variables come from
    keys of our ConfigMap, not optional (the pod does not start without them)."""
    env = {e["name"]: e for e in container["env"]}
    cm = _one("ConfigMap")["metadata"]["name"]
    for name in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
        ref = env[name]["valueFrom"]["configMapKeyRef"]
        assert ref == {"name": cm, "key": name}, name  # (optional unset: required)
    text = (K8S_DIR / "configmap.yaml").read_text()
    assert "# KUBERNETES_SERVICE_HOST:" in text and "# KUBERNETES_SERVICE_PORT:" in text  # to be set


def test_daemonset_probes(container):
    live = container["livenessProbe"]["httpGet"]
    ready = container["readinessProbe"]["httpGet"]
    assert (live["path"], live["port"]) == ("/livez", HEALTHZ_PORT_NAME)
    # /readyz: not before the kernel is programmed (/healthz answers 503 for a node being
    # deleted or drained: no reason to be unready)
    assert (ready["path"], ready["port"]) == ("/readyz", HEALTHZ_PORT_NAME)
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    assert ports[HEALTHZ_PORT_NAME] == HEALTHZ_PORT


def test_daemonset_resources(container):
    requests = container["resources"]["requests"]
    assert requests.get("cpu") and requests.get("memory")


def _mounts_by_volume(pod_spec, container):
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert set(mounts) <= set(volumes), "mount of an undeclared volume"
    return volumes, mounts


def test_xtables_lock_mount(pod_spec, container):
    volumes, mounts = _mounts_by_volume(pod_spec, container)
    [name] = [n for n, v in volumes.items() if v.get("hostPath", {}).get("path") == "/run/xtables.lock"]
    assert volumes[name]["hostPath"]["type"] == "FileOrCreate"
    assert mounts[name]["mountPath"] == "/run/xtables.lock"
    assert not mounts[name].get("readOnly", False)


def test_lib_modules_mount_read_only(pod_spec, container):
    volumes, mounts = _mounts_by_volume(pod_spec, container)
    [name] = [n for n, v in volumes.items() if v.get("hostPath", {}).get("path") == "/lib/modules"]
    assert mounts[name]["mountPath"] == "/lib/modules"
    assert mounts[name]["readOnly"] is True


def test_host_netfilter_sysctls_mounted_writable_for_the_conntrack_sysctls(pod_spec, container):
    """A non-privileged container's /proc/sys is read-only: the host's net.netfilter is mounted
    read-write elsewhere, where --conntrack-sysctl-dir points (nothing else of /proc or /sys)."""
    volumes, mounts = _mounts_by_volume(pod_spec, container)
    [name] = [n for n, v in volumes.items() if v.get("hostPath", {}).get("path", "").startswith(("/proc", "/sys"))]
    assert volumes[name]["hostPath"] == {"path": "/proc/sys/net/netfilter", "type": "Directory"}
    assert mounts[name]["mountPath"] == SYSCTL_MOUNT
    assert not mounts[name].get("readOnly", False)
    assert pod_spec["hostNetwork"] is True  # (the writes apply to the writer's network namespace)


def test_config_map_mounted_at_config_path(pod_spec, container):
    cm = _one("ConfigMap")
    volumes, mounts = _mounts_by_volume(pod_spec, container)
    [name] = [n for n, v in volumes.items() if v.get("configMap", {}).get("name") == cm["metadata"]["name"]]
    source = volumes[name]["configMap"]
    items = source.get("items") or [{"key": k, "path": k} for k in cm["data"]]
    files = {f"{mounts[name]['mountPath'].rstrip('/')}/{i['path']}": i["key"] for i in items}
    assert CONFIG_PATH in files
    assert files[CONFIG_PATH] in cm["data"]


# ------------------------------------------------------------------ RBAC ----


def test_cluster_role_is_exactly_least_privilege():
    role = _one("ClusterRole")
    granted = set()
    for rule in role["rules"]:
        assert "nonResourceURLs" not in rule and "resourceNames" not in rule, rule
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[field], f"wildcard in {field}: {rule}"
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.add((group, resource, frozenset(rule["verbs"])))
    assert "aggregationRule" not in role
    # Normalise: one (group, resource) -> union of verbs.
    merged: dict[tuple[str, str], set[str]] = {}
    for group, resource, verbs in granted:
        merged.setdefault((group, resource), set()).update(verbs)
    assert {(g, r, frozenset(v)) for (g, r), v in merged.items()} == EXPECTED_RBAC


def test_cluster_role_binding_wires_sa_to_role():
    binding = _one("ClusterRoleBinding")
    role = _one("ClusterRole")
    sa = _one("ServiceAccount")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": sa["metadata"]["namespace"]}
    ]


# ------------------------------------------------------------- ConfigMap ----


def test_configmap_holds_kube_proxy_configuration():
    cm = _one("ConfigMap")
    key = Path(CONFIG_PATH).name
    config = yaml.safe_load(cm["data"][key])
    assert config["apiVersion"] == "kubeproxy.config.k8s.io/v1alpha1"
    assert config["kind"] == "KubeProxyConfiguration"
    assert config["mode"] == "nftables"
    assert config["clusterCIDR"] == "10.244.0.0/16"
    assert config["nftables"] == {"syncPeriod": "30s", "minSyncPeriod": "1s"}  # (top-level: not a field)
    assert config["healthzBindAddress"] == f"0.0.0.0:{HEALTHZ_PORT}"
    assert config["metricsBindAddress"] == "127.0.0.1:10249"
    assert config["conntrack"] == {  # kube-proxy's defaults, spelled out
        "maxPerCore": 32768, "min": 131072, "tcpEstablishedTimeout": "24h0m0s", "tcpCloseWaitTimeout": "1h0m0s",
        "tcpBeLiberal": False, "udpTimeout": "0s", "udpStreamTimeout": "0s"}
    with open(ROOT / "schemas" / "kube-proxy-config.schema.json") as fh:
        jsonschema.Draft202012Validator(json.load(fh)).validate(config)


def test_configmap_is_read_as_the_defaults(tmp_path, caplog):
    from reconciler.config import Options, load_kube_proxy_config, merge

    path = tmp_path / "config.conf"
    path.write_text(_one("ConfigMap")["data"][Path(CONFIG_PATH).name])
    with caplog.at_level("WARNING"):
        opts = merge(Options(node_name="n"), load_kube_proxy_config(str(path)))
    assert caplog.text == ""  # nothing in it is ignored or read otherwise than kube-proxy reads it
    assert (opts.sync_period, opts.min_sync_period) == (30, 1)
    assert opts.nodeport_cidrs == ("primary",)  # (kube-proxy's nftables mode's default)
    assert {k: v for k, v in vars(opts).items() if k.startswith("conntrack_")} == {
        k: v for k, v in vars(Options(node_name="n")).items() if k.startswith("conntrack_")}


# --------------------------------------------------------- kustomization ----


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert kustomization["kind"] == "Kustomization"
    resources = kustomization["resources"]
    assert len(resources) == len(set(resources)), "duplicate resources"
    expected = {
        str(p.relative_to(K8S_DIR)) for p in _manifest_files() if p.name != "kustomization.yaml"
    }
    assert set(resources) == expected


def test_pod_monitor_scrapes_the_pods_as_kube_prometheus_scrapes_kube_proxy(pod_spec, container):
    """kube-prometheus's kube-proxy PodMonitor gives job="kube-proxy", instance=<node>: the
    kubernetes-mixin alerts and dashboard select on them."""
    docs = _load_docs(ROOT / "deploy" / "monitoring" / "podmonitor.yaml")
    assert [d["kind"] for d in docs] == ["PodMonitor"]
    spec = docs[0]["spec"]
    ds = _one("DaemonSet")
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= pod_labels.items()
    assert spec["namespaceSelector"]["matchNames"] == [ds["metadata"]["namespace"]]
    (endpoint,) = spec["podMetricsEndpoints"]
    assert endpoint["port"] in {p["name"] for p in container["ports"]}
    relabel = {r["targetLabel"]: r for r in endpoint["relabelings"]}
    assert relabel["job"]["replacement"] == "kube-proxy"
    assert relabel["instance"]["sourceLabels"] == ["__meta_kubernetes_pod_node_name"]
    kustomization = yaml.safe_load((ROOT / "deploy" / "monitoring" / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["podmonitor.yaml"]


# -------------------------------------------------------------- edge/systemd --


def test_edge_files_exist():
    for name in ("service-reconciler.service", "environment", "README.md", "state-sync.service", "state-sync.timer"):
        assert (EDGE_DIR / name).is_file(), name


def test_systemd_unit():
    unit = _parse_unit(EDGE_DIR / "service-reconciler.service")
    svc = "Service"
    assert _value(unit, svc, "Type") == "notify"  # (see reconciler/sdnotify.py)
    assert _value(unit, svc, "NotifyAccess") == "main"  # (its kernel tools are not heard)
    assert _value(unit, svc, "WatchdogSec") == "3min"
    assert _value(unit, svc, "Restart") == "always"
    assert _value(unit, svc, "KillSignal") == "SIGTERM"
    assert _value(unit, svc, "KillMode") == "mixed"  # (the sync under way finishes: its nft child is not killed)
    assert _value(unit, svc, "ExecReload") == "/bin/kill -HUP $MAINPID"  # (run: a full resync now)
    assert _value(unit, svc, "NoNewPrivileges") == "yes"
    assert _value(unit, svc, "ProtectSystem") == "strict"
    assert "/run" in _value(unit, svc, "ReadWritePaths").split()
    caps = set(_value(unit, svc, "AmbientCapabilities").split())
    assert caps == {"CAP_NET_ADMIN", "CAP_NET_RAW", "CAP_NET_BIND_SERVICE"}
    assert set(_value(unit, svc, "CapabilityBoundingSet").split()) == caps
    assert _value(unit, "Install", "WantedBy") == "multi-user.target"

    [exec_start] = _values(unit, svc, "ExecStart")
    argv = shlex.split(exec_start)
    assert argv[0] == "/usr/local/bin/reconciler"
    assert argv[1:3] == ["run", "--source"]
    assert "run --source /var/lib/reconciler/state" in " ".join(argv)
    assert argv[argv.index("--node-name") + 1] == "%H"
    assert _flags(argv) <= RUN_FLAGS


def test_systemd_unit_env_vars_documented_in_example():
    unit = _parse_unit(EDGE_DIR / "service-reconciler.service")
    [exec_start] = _values(unit, "Service", "ExecStart")
    used = set(re.findall(r"\$\{?([A-Z_][A-Z0-9_]*)\}?", exec_start))
    defaults = {v.split("=", 1)[0] for v in _values(unit, "Service", "Environment")}
    example = {
        line.split("=", 1)[0]
        for line in (EDGE_DIR / "environment").read_text().splitlines()
        if line and not line.startswith("#") and "=" in line
    }
    assert used, "expected ExecStart to use the environment"
    assert used <= defaults, f"no default for {used - defaults}"
    assert used <= example, f"not in environment example: {used - example}"
    assert _value(unit, "Service", "EnvironmentFile").lstrip("-") == "/etc/default/service-reconciler"


def test_state_sync_units():
    svc = _parse_unit(EDGE_DIR / "state-sync.service")
    assert _value(svc, "Service", "Type") == "oneshot"
    argv = shlex.split(_value(svc, "Service", "ExecStart"))
    assert argv[0].endswith("/git")
    assert argv[1:3] == ["-C", "/var/lib/reconciler/state"]
    assert "pull" in argv and "--ff-only" in argv
    timer = _parse_unit(EDGE_DIR / "state-sync.timer")
    assert _value(timer, "Timer", "Unit") == "state-sync.service"
    assert _values(timer, "Timer", "OnUnitActiveSec")
    assert _value(timer, "Install", "WantedBy") == "timers.target"
    readme = (EDGE_DIR / "README.md").read_text()
    assert "state-sync.timer" in readme and "--ff-only" in readme


# ---------------------------------------------------------- Containerfile ----


def test_containerfile():
    text = CONTAINERFILE.read_text()
    instructions = [
        line.strip() for line in re.sub(r"\\\n", " ", text).splitlines() if line.strip() and not line.lstrip().startswith("#")
    ]
    froms = [i for i in instructions if i.upper().startswith("FROM ")]
    assert len(froms) >= 2, "expected a multi-stage build"
    assert any(" AS " in f.upper() for f in froms)
    assert 'ENTRYPOINT ["reconciler"]' in instructions
    assert any(i.startswith("LABEL ") and "org.opencontainers.image.source" in i for i in instructions)
    apt = [i for i in instructions if "apt-get install" in i]
    assert apt, "runtime tools must come from apt"
    for line in apt:
        assert "--no-install-recommends" in line and "-y" in line
        assert "rm -rf /var/lib/apt/lists/*" in line
        for pkg in ("nftables", "iptables", "conntrack", "iproute2"):
            assert re.search(rf"\b{pkg}\b", line), pkg
    assert "DEBIAN_FRONTEND=noninteractive" in text
    # Never copy the whole context (it contains .venv and .git).
    assert not any(re.match(r"COPY\s+\.\s", i) for i in instructions)
