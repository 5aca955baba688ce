"""Validation errors name file:line:column and the field path."""

from __future__ import annotations

import os

import pytest

from reconciler.desired import BuildOptions, build_desired_state
from reconciler.sources.manifests import load_directory, load_file
from reconciler.sources.objects import InputError, InputErrors, Location, SourceObject, in_place_order


def errors_for(tmp_path, text: str) -> str:
    path = os.path.join(tmp_path, "svc.yaml")
    with open(path, "w") as fh:
        fh.write(text)
    with pytest.raises(InputErrors) as exc:
        build_desired_state(load_directory(tmp_path).objects, BuildOptions("node-a"))
    return str(exc.value)


BASE = """apiVersion: v1
kind: Service
metadata:
  name: web
  namespace: default
spec:
  clusterIP: {ip}
  ports:
    - name: http
      port: {port}
      protocol: {proto}
"""


def test_port_out_of_range(tmp_path):
    msg = errors_for(tmp_path, BASE.format(ip="10.96.0.1", port=70000, proto="TCP"))
    assert "svc.yaml:10:7: spec.ports[0].port: port 70000 out of range" in msg


def test_bad_protocol(tmp_path):
    msg = errors_for(tmp_path, BASE.format(ip="10.96.0.1", port=80, proto="ICMP"))
    assert "svc.yaml:11:7: spec.ports[0].protocol: must be one of TCP, UDP, SCTP" in msg


def test_bad_cluster_ip(tmp_path):
    msg = errors_for(tmp_path, BASE.format(ip="10.96.0.300", port=80, proto="TCP"))
    assert "svc.yaml:7:3: spec.clusterIP: invalid IP address '10.96.0.300'" in msg


def test_port_as_string(tmp_path):
    msg = errors_for(tmp_path, BASE.format(ip="10.96.0.1", port='"80"', proto="TCP"))
    assert "spec.ports[0].port: expected integer, got string" in msg


def test_slice_endpoint_family_mismatch(tmp_path):
    text = """apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-1
  labels: {kubernetes.io/service-name: web}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints:
  - addresses: ["fd00::1"]
"""
    msg = errors_for(tmp_path, text)
    assert "svc.yaml:9:17: endpoints[0].addresses[0]: fd00::1 is not an IPv4 address" in msg


def test_all_errors_reported_together(tmp_path):
    text = BASE.format(ip="bogus", port=80, proto="TCP") + "---\n" + BASE.format(
        ip="10.96.0.2", port=0, proto="TCP").replace("name: web", "name: web2")
    msg = errors_for(tmp_path, text)
    assert "invalid IP address 'bogus'" in msg and "port 0 out of range" in msg


def test_names_the_kernel_would_see_must_be_dns_labels(tmp_path):
    """Names become parts of chain names and rule comments: a quote or a newline in one must be
    refused at its place, never written into a kernel transaction."""
    evil = '"a\\"\\n-I PREROUTING 1 -j ACCEPT"'
    text = BASE.format(ip="10.96.0.1", port=80, proto="TCP").replace("name: web", f"name: {evil}")
    msg = errors_for(tmp_path, text)
    assert "svc.yaml:4:3: metadata.name: invalid Service name" in msg
    msg = errors_for(tmp_path, BASE.format(ip="10.96.0.1", port=80, proto="TCP").replace("name: http", 'name: "web app"'))
    assert "svc.yaml:9:7: spec.ports[0].name: invalid port name 'web app'" in msg
    msg = errors_for(tmp_path, BASE.format(ip="10.96.0.1", port=80, proto="TCP").replace("namespace: default",
                                                                                          "namespace: Shop"))
    assert "svc.yaml:5:3: metadata.namespace: invalid namespace 'Shop'" in msg


def test_one_cluster_ip_port_is_one_service_port(tmp_path):
    two_ports = BASE.format(ip="10.96.0.1", port=80, proto="TCP") + "    - name: http2\n      port: 80\n"
    assert "svc.yaml:13:7: spec.ports[1].port: duplicate port 80/TCP" in errors_for(tmp_path, two_ports)
    other = BASE.format(ip="10.96.0.1", port=80, proto="TCP").replace("name: web", "name: zzz")
    with open(os.path.join(tmp_path, "zzz.yaml"), "w") as fh:
        fh.write(other)
    msg = errors_for(tmp_path, BASE.format(ip="10.96.0.1", port=80, proto="TCP"))
    assert "zzz.yaml:10:7: spec.ports[0].port: 10.96.0.1:80/TCP already used by default/web:http/TCP " \
           f"({os.path.join(tmp_path, 'svc.yaml')}:10:7)" in msg  # (the other one's place too)


def test_a_conflict_with_a_service_built_before_names_its_place(tmp_path):
    """The run loop's build cache keeps what it built: a Service arriving later on the same nodePort
    is refused with the place of the one that has it."""
    from reconciler.desired import BuildCache
    web = BASE.format(ip="10.96.0.1", port=80, proto="TCP").replace("clusterIP:", "type: NodePort\n  clusterIP:")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "web.yaml").write_text(web + "      nodePort: 30080\n")
    (tmp_path / "b" / "zzz.yaml").write_text(web.replace("name: web", "name: zzz").replace("10.96.0.1", "10.96.0.2")
                                             + "      nodePort: 30080\n")
    cache = BuildCache()
    cache.update(load_directory(tmp_path / "a").objects, [], BuildOptions("node-a"))
    with pytest.raises(InputErrors) as exc:
        cache.update(load_directory(tmp_path / "b").objects, [], BuildOptions("node-a"))
    assert str(exc.value) == (f"{tmp_path}/b/zzz.yaml:13:7: spec.ports[0].nodePort: nodePort 30080/TCP already used "
                              f"by default/web:http/TCP ({tmp_path}/a/web.yaml:13:7)")


def _np(name: str | None, port: int, node_port: int) -> dict:
    return {"port": port, "protocol": "TCP", "nodePort": node_port, **({"name": name} if name else {})}


@pytest.mark.parametrize("before, after, newcomer, newcomer_ip", [
    ([_np("http", 80, 30080)], [_np("http", 80, 30080)], [_np("http", 80, 30080)], "10.96.0.11"),  # (rebuilt)
    ([_np("http", 80, 30080)], [_np("web", 80, 30080)], [_np("http", 80, 30080)], "10.96.0.11"),  # renamed
    ([_np(None, 80, 30080)], [_np(None, 81, 30080)], [_np(None, 80, 30080)], "10.96.0.11"),  # renumbered
    ([_np("http", 80, 30080)], [_np("web", 80, 30080)], [_np("http", 80, 30099)], "10.96.0.10"),  # its ClusterIP
], ids=["rebuilt", "port-renamed", "unnamed-port-renumbered", "cluster-ip-and-port"])
def test_a_claim_built_before_stays_with_its_service_against_a_newcomer(before, after, newcomer, newcomer_ip):
    """A Service changed in the batch that brings a newcomer on its nodePort (or ClusterIP and
    port) keeps what it had, whatever its port is called now; the newcomer is refused, though its
    name sorts first (the run loop's API source would drop the older one from the kernel)."""
    from reconciler.desired import BuildCache
    from helpers import node, service

    cache, opts = BuildCache(), BuildOptions("node-a")
    old = service("zzz", "10.96.0.10", before, type="NodePort")
    cache.update([old, node()], [], opts)
    with pytest.raises(InputErrors) as exc:
        cache.update([service("zzz", "10.96.0.10", after, type="NodePort"),
                      service("aaa", newcomer_ip, newcomer, type="NodePort")], [old], opts)
    assert [e.location for e in exc.value.errors] == [Location("mem:default/aaa")]
    assert "already used by default/zzz:" in str(exc.value)


def test_odd_shapes_are_errors_at_their_place_not_crashes(tmp_path):
    slice_ = """apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-1
  namespace: default
  labels: {{kubernetes.io/service-name: {svc}}}
addressType: IPv4
endpoints:
  - addresses: [10.244.1.5]
    hints: {hints}
"""
    assert "svc.yaml:10:5: endpoints[0].hints: expected a mapping" in errors_for(
        tmp_path, slice_.format(svc="web", hints="[zone-a]"))
    assert "labels.kubernetes.io/service-name: expected string, got list" in errors_for(
        tmp_path, slice_.format(svc="[web]", hints="{}"))
    msg = errors_for(tmp_path, BASE.format(ip="10.96.0.1", port=80, proto="TCP").replace("kind: Service",
                                                                                          "kind: [Service]"))
    assert "svc.yaml:2:1: kind: expected string, got list" in msg


def test_lists_inside_lists_are_read(tmp_path):
    inner = BASE.format(ip="10.96.0.1", port=70000, proto="TCP").replace("\n", "\n      ")
    text = f"apiVersion: v1\nkind: List\nitems:\n  - apiVersion: v1\n    kind: List\n    items:\n    - {inner}"
    assert "spec.ports[0].port: port 70000 out of range" in errors_for(tmp_path, text)


def test_a_duplicate_key_is_an_error_at_its_line(tmp_path):
    text = BASE.format(ip="10.96.0.1", port=80, proto="TCP") + "      port: 8080\n"
    assert 'svc.yaml:12:7: invalid YAML: found duplicate key "port"' in errors_for(tmp_path, text)


def all_errors(tmp_path) -> str:
    """Every error of the directory, as `validate` reports them (files that do not parse too)."""
    try:
        loaded = load_directory(tmp_path)
    except InputErrors as exc:
        return str(exc)
    with pytest.raises(InputErrors) as exc:
        build_desired_state(loaded.objects, BuildOptions("node-a"))
    return str(exc.value)


SLICE = """---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: default, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints:
  - addresses: [10.244.1.5]
    hints: {forZones: [zone-a]}
"""


def test_shapes_found_by_fuzzing_are_errors_at_their_place(tmp_path):
    """Each of these was read without a word (or with a traceback): what the API server refuses
    is an error naming its place, and nothing is silently dropped."""
    base = BASE.format(ip="10.96.0.1", port=80, proto="TCP")
    # an endpoint's hints that are not {name: ...}: dropping them changed which endpoints are used
    msg = errors_for(tmp_path, base + SLICE)
    assert "svc.yaml:20:24: endpoints[0].hints.forZones[0]: expected {name: <a string>}" in msg
    # addresses the API server refuses as endpoints and externalIPs (ValidateNonSpecialIP)
    for ip, reason in (("127.0.0.1", "in the loopback range"), ("0.0.0.0", "unspecified"),
                       ("169.254.1.1", "in the link-local range"), ("224.0.0.5", "in the link-local multicast range")):
        msg = errors_for(tmp_path, base + SLICE.replace("10.244.1.5", ip).replace("    hints: {forZones: [zone-a]}\n", ""))
        assert f"svc.yaml:19:17: endpoints[0].addresses[0]: {ip} may not be {reason}" in msg, ip
        msg = errors_for(tmp_path, base.replace("spec:\n", f"spec:\n  externalIPs: [{ip}]\n"))
        assert f"svc.yaml:7:17: spec.externalIPs[0]: {ip} may not be {reason}" in msg, ip
    v6 = BASE.format(ip="'fd00::1'", port=80, proto="TCP")
    for ip, ok in (("ff12::1", False), ("ff02::1", False), ("ff05::1", True), ("fe00::1", True)):
        text = v6.replace("spec:\n", f"spec:\n  externalIPs: ['{ip}']\n")
        if ok:
            build_warnings(tmp_path, text)
        else:
            assert f"spec.externalIPs[0]: {ip} may not be in the link-local multicast range" in errors_for(tmp_path, text)
    # conditions or hints that are falsy but no mapping (0, "", []): errors, not "none given" (ready)
    for value in ("0", "''", "[]"):
        msg = errors_for(tmp_path, base + SLICE.replace("hints: {forZones: [zone-a]}", f"conditions: {value}"))
        assert "svc.yaml:20:5: endpoints[0].conditions: expected a mapping" in msg, value
        msg = errors_for(tmp_path, base + SLICE.replace("hints: {forZones: [zone-a]}", f"hints: {value}"))
        assert "svc.yaml:20:5: endpoints[0].hints: expected a mapping" in msg, value
    # a load balancer status of another shape: its IPs were dropped
    lb = base.replace("spec:\n", "spec:\n  type: LoadBalancer\n").replace("      protocol: TCP", "      protocol: TCP\n      nodePort: 30080")
    msg = errors_for(tmp_path, lb + 'status: {loadBalancer: {ingress: ["172.30.1.10"]}}\n')
    assert "svc.yaml:14:35: status.loadBalancer.ingress[0]: expected a mapping (ip, hostname, ipMode, ports)" in msg
    assert "status: expected mapping, got string" in errors_for(tmp_path, lb + "status: up\n")
    # a label that is no string (the Node's zone label became the zone "['a']")
    node = ("apiVersion: v1\nkind: Node\nmetadata:\n  name: node-a\n  labels:\n"
            "    topology.kubernetes.io/zone: [a]\n")
    msg = errors_for(tmp_path, base + "---\n" + node)
    assert "metadata.labels.topology.kubernetes.io/zone: expected string, got list" in msg
    # nesting deeper than the locating re-read goes: the error, without its line (it was a traceback)
    deep = base.replace("spec:\n", "spec:\n  selector: {app: " + "[" * 300 + "]" * 300 + "}\n")
    assert "svc.yaml: spec.ports[0].port: port 70000 out of range" in errors_for(tmp_path, deep.replace("port: 80", "port: 70000"))
    # metadata of another shape, and type names as the input speaks of them
    assert "svc.yaml:3:1: metadata: expected a mapping, got string" in errors_for(tmp_path, base.replace(
        "metadata:\n  name: web\n  namespace: default\n", "metadata: web\n"))
    # a kind in the wrong case: the API server refuses it (it was skipped with a warning)
    with open(os.path.join(tmp_path, "svc.yaml"), "w") as fh:
        fh.write(base.replace("kind: Service", "kind: service"))
    msg = all_errors(tmp_path)
    assert "svc.yaml:2:1: kind: unknown kind 'service': kinds are case-sensitive (did you mean Service?)" in msg
    os.unlink(os.path.join(tmp_path, "svc.yaml"))
    # a JSON object with a key twice: refused at its place, as in YAML (json kept the last one)
    with open(os.path.join(tmp_path, "svc.json"), "w") as fh:
        fh.write('{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},\n'
                 ' "spec": {"clusterIP": "10.96.0.1", "ports": [{"name": "http", "port": 80, "port": 81}]}}\n')
    assert 'svc.json:2:76: invalid JSON: found duplicate key "port"' in all_errors(tmp_path)
    os.unlink(os.path.join(tmp_path, "svc.json"))
    # bytes that are no UTF-8: named by line and column, not by a codec's offset
    with open(os.path.join(tmp_path, "svc.yaml"), "wb") as fh:
        fh.write(b"apiVersion: v1\nkind: Service\nmetadata: {name: w\xffb}\n")
    assert "svc.yaml:3:19: not UTF-8 text (byte 0xff)" in all_errors(tmp_path)
    # UTF-16 with a byte order mark (PowerShell's `>`) is read, as kubectl reads it
    with open(os.path.join(tmp_path, "svc.yaml"), "wb") as fh:
        fh.write(base.encode("utf-16"))
    assert [o.name for o in load_directory(tmp_path).objects] == ["web"]
    # ... and its errors are placed in it as in UTF-8 (the locator read UTF-8 only: no line)
    with open(os.path.join(tmp_path, "svc.yaml"), "wb") as fh:
        fh.write(base.replace("port: 80", "port: 70000", 1).encode("utf-16"))
    with open(os.path.join(tmp_path, "utf8.yaml.txt"), "w") as fh:  # (the same in UTF-8, not read: the place)
        fh.write(base.replace("port: 80", "port: 70000", 1))
    utf16 = all_errors(tmp_path)
    assert "svc.yaml:" in utf16 and "port 70000 out of range" in utf16
    os.replace(os.path.join(tmp_path, "utf8.yaml.txt"), os.path.join(tmp_path, "svc.yaml"))
    assert all_errors(tmp_path) == utf16
    # a custom resource named like one of ours (Knative's Service) is skipped, not an error
    with open(os.path.join(tmp_path, "svc.yaml"), "w") as fh:
        fh.write(base + "---\napiVersion: serving.knative.dev/v1\nkind: Service\nmetadata: {name: hello}\n")
    loaded = load_directory(tmp_path)
    assert [(o.kind, o.name) for o in loaded.objects] == [("Service", "web")]
    assert [w.replace(f"{tmp_path}/", "") for w in loaded.warnings] == [
        "svc.yaml:13:1: skipping serving.knative.dev/v1 Service: not the Kubernetes Service"]
    # hints whose zone name is empty (a valid label value) are no error
    build_warnings(tmp_path, base + SLICE.replace("[zone-a]", "[{name: ''}, {}]"))


def test_an_error_deep_in_a_big_file_is_placed_right(tmp_path):
    """A big file's error is placed by re-reading just its document (split at its `---` lines;
    the pure-Python re-read of the whole file took 18 s for 2.7 MB): the same line as a whole
    re-read gives, also past a `---` that is a block scalar's text, not a document marker."""
    docs = [BASE.format(ip=f"10.96.{i // 250}.{i % 250 + 1}", port=80, proto="TCP").replace("name: web", f"name: s{i}")
            for i in range(400)]  # ~70 KB
    docs[300] = docs[300].replace("port: 80", "port: 70000")
    msg = errors_for(tmp_path, "---\n" + "---\n".join(docs))
    line = 1 + 300 * 12 + 1 + 9  # the leading ---, 300 documents of 11 lines and a --- each, then the port's line
    assert f"svc.yaml:{line}:7: spec.ports[0].port: port 70000 out of range" in msg
    docs[100] = docs[100].replace("spec:\n", "  annotations:\n    note: |\n      ---\n      a note\nspec:\n")
    msg = errors_for(tmp_path, "---\n" + "---\n".join(docs))
    assert f"svc.yaml:{line + 4}:7: spec.ports[0].port: port 70000 out of range" in msg
    # what comes before the first `---` (a comment, a directive) or `...` ends, and an object of
    # another kind with the same name as the one whose error it is (a Deployment and its Service)
    deployment = "apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: s300\n  namespace: default\nspec: {}\n"
    with_deployment = "---\n".join([*docs[:300], deployment, *docs[300:]])  # (right before its Service)
    for head in ("# Source: chart/all.yaml\n---\n", "%YAML 1.2\n---\n", "kind: Note\n...\n"):
        text = head + with_deployment
        at = text.split("\n").index("      port: 70000") + 1
        msg = errors_for(tmp_path, text)
        assert f"svc.yaml:{at}:7: spec.ports[0].port: port 70000 out of range" in msg, head


@pytest.mark.parametrize("target,ok", [("8080", True), ("http", True), ("dns-tcp", True), ("a1", True),
                                       ("0", True), ("''", True),  # (the API server defaults both to port)
                                       ("-1", False), ("70000", False), ("'8080'", False),
                                       ("HTTP", False), ("h_p", False), ("a--b", False), ("-http", False),
                                       ("sixteen-chars-xx", False)])
def test_target_ports_are_what_the_api_server_takes(tmp_path, target, ok):
    text = BASE.format(ip="10.96.0.1", port=80, proto="TCP") + f"      targetPort: {target}\n"
    if ok:
        build_warnings(tmp_path, text)
    else:
        assert "svc.yaml:12:7: spec.ports[0].targetPort: " in errors_for(tmp_path, text)


def test_ip_family_policy_is_what_the_api_server_takes(tmp_path):
    base = BASE.format(ip="10.96.0.1", port=80, proto="TCP")
    msg = errors_for(tmp_path, base.replace("spec:\n", "spec:\n  ipFamilyPolicy: Sometimes\n"))
    assert "spec.ipFamilyPolicy: must be one of SingleStack, PreferDualStack, RequireDualStack, got 'Sometimes'" in msg
    dual = base.replace("  clusterIP: 10.96.0.1", "  clusterIPs: [10.96.0.1, 'fd00::1']\n  ipFamilyPolicy: SingleStack")
    assert "spec.ipFamilyPolicy: SingleStack, with a clusterIP of each family" in errors_for(tmp_path, dual)
    _, warnings = build_warnings(tmp_path, base.replace("spec:\n", "spec:\n  externalTrafficPolicy: Local\n"))
    assert any("spec.externalTrafficPolicy: set on a Service with no external address" in w for w in warnings)
    # a family listed without its clusterIP (written by hand: the API server would allocate one)
    _, warnings = build_warnings(tmp_path, base.replace("  clusterIP: 10.96.0.1", "  clusterIP: 10.96.0.1\n"
                                                        "  ipFamilyPolicy: PreferDualStack\n  ipFamilies: [IPv4, IPv6]"))
    assert [w for w in warnings if "ipFamilies" in w] == [
        "svc.yaml:9:22: spec.ipFamilies[1]: IPv6 has no clusterIP (clusterIPs[1]): nothing is programmed "
        "for it (the API server allocates one)"]


def test_what_the_api_server_refuses_is_refused_here_too(tmp_path):
    base = BASE.format(ip="10.96.0.1", port=80, proto="TCP")
    msg = errors_for(tmp_path, base.replace("      protocol: TCP", "      protocol: TCP\n      nodePort: 30080"))
    assert "svc.yaml:12:7: spec.ports[0].nodePort: a ClusterIP Service has no nodePort" in msg
    msg = errors_for(tmp_path, base.replace("  clusterIP: 10.96.0.1", "  clusterIP: 10.96.0.1\n  clusterIPs: [10.96.0.2]"))
    assert "svc.yaml:7:3: spec.clusterIP: '10.96.0.1' is not clusterIPs[0] ('10.96.0.2')" in msg
    msg = errors_for(tmp_path, base.replace("  clusterIP: 10.96.0.1", "  clusterIP: 10.96.0.999\n  clusterIPs: [10.96.0.2]"))
    assert "svc.yaml:7:3: spec.clusterIP: invalid IP address '10.96.0.999'" in msg  # (not "is not clusterIPs[0]")
    # ipFamilies names the family of each clusterIP, in order (kube-proxy reads them by index)
    msg = errors_for(tmp_path, base.replace("  clusterIP: 10.96.0.1", "  clusterIP: 10.96.0.1\n  ipFamilies: [IPv6]"))
    assert "svc.yaml:8:16: spec.ipFamilies[0]: IPv6 is not the family of clusterIPs[0] (10.96.0.1)" in msg
    dual = base.replace("  clusterIP: 10.96.0.1", "  clusterIPs: [10.96.0.1, 'fd00::1']\n  ipFamilies: [IPv4, IPv4]")
    assert "spec.ipFamilies[1]: IPv4 is listed twice" in errors_for(tmp_path, dual)
    msg = errors_for(tmp_path, base.replace("  clusterIP: 10.96.0.1", "  clusterIP: 10.96.0.1\n  ipFamilies: [IPv5]"))
    assert "spec.ipFamilies[0]: must be one of IPv4, IPv6, got 'IPv5'" in msg
    msg = errors_for(tmp_path, base.replace("name: web", "name: 123"))
    assert "svc.yaml:4:3: metadata.name: expected string, got int" in msg
    # fields no proxy reads are typed all the same ("false" would be read as unset)
    msg = errors_for(tmp_path, base.replace("spec:\n", "spec:\n  allocateLoadBalancerNodePorts: 'false'\n"
                                            "  trafficDistribution: [PreferClose]\n"))
    assert "svc.yaml:7:3: spec.allocateLoadBalancerNodePorts: expected boolean, got string" in msg
    assert "svc.yaml:8:3: spec.trafficDistribution: expected string, got list" in msg
    eps = """apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: default, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
endpoints:
  - addresses: [10.244.1.5, "fd00::5"]
"""
    assert "svc.yaml:6:29: endpoints[0].addresses[1]: fd00::5 is not an IPv4 address" in errors_for(tmp_path, eps)


def test_a_json_file_may_start_with_a_byte_order_mark(tmp_path):
    with open(os.path.join(tmp_path, "svc.json"), "w", encoding="utf-8-sig") as fh:
        fh.write('{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": "default"},'
                 ' "spec": {"clusterIP": "10.96.0.1", "ports": [{"name": "http", "port": 80}]}}')
    state = build_desired_state(load_directory(tmp_path).objects, BuildOptions("node-a"))
    assert [s.id for s in state.services] == ["default/web:http/TCP"]


def test_messages_say_what_is_wrong(tmp_path):
    eps = """apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: default, labels: {kubernetes.io/service-name: web}}
ADDRESS_TYPE
endpoints:
  - addresses: 10.244.1.5
"""
    assert "endpoints[0].addresses: expected a list of addresses, got string" in errors_for(
        tmp_path, eps.replace("ADDRESS_TYPE", "addressType: IPv4"))
    assert "addressType: is required (IPv4, IPv6 or FQDN)" in errors_for(tmp_path, eps.replace("ADDRESS_TYPE\n", ""))


def test_a_syntax_error_in_one_file_does_not_hide_the_errors_of_the_others(tmp_path):
    from reconciler.config import Options
    from reconciler.reconcile import load_desired

    with open(os.path.join(tmp_path, "a.yaml"), "w") as fh:
        fh.write("apiVersion: v1\nkind: Service\nmetadata: {name: [\n")
    with open(os.path.join(tmp_path, "b.yaml"), "w") as fh:
        fh.write(BASE.format(ip="10.96.0.1", port=70000, proto="TCP"))
    with pytest.raises(InputErrors) as exc:
        load_desired(str(tmp_path), Options(node_name="node-a"))
    assert [e.location.origin.rsplit("/", 1)[1] for e in exc.value.errors] == ["a.yaml", "b.yaml"]


def test_an_integer_with_a_leading_zero_is_refused_not_guessed(tmp_path):
    """kubectl (YAML 1.1) reads `0120` as octal 80, YAML 1.2 as 120: the same file must not mean
    one port in the cluster and another on an edge node."""
    msg = errors_for(tmp_path, BASE.format(ip="10.96.0.1", port="0120", proto="TCP"))
    assert "svc.yaml:10:13: invalid YAML: 0120 is 80 to YAML 1.1 readers such as kubectl and 120 in YAML 1.2" in msg
    for spelled in (" 0120", "+0120", "\n        0120"):  # two blanks, a sign, on the next line
        assert "0120 is 80 to YAML 1.1" in errors_for(tmp_path, BASE.format(ip="10.96.0.1", port=spelled, proto="TCP"))


# netutils.ParseIPSloppy / ParseCIDRSloppy (k8s.io/utils/net), with the cases of its ips_test.go:
# Go's parser, then leading zeros of a dotted quad (and of a prefix length after it) dropped and
# read as decimal; an IPv4-mapped IPv6 address is IPv4 (Go's To4)
GOOD_IPS = {
    "192.168.0.5": "192.168.0.5", "192.168.000.005": "192.168.0.5", "000.000.000.000": "0.0.0.0",
    "010.0.0.5": "10.0.0.5", "0010.0.0.1": "10.0.0.1",  # decimal: 010 is 10, not octal 8
    "2001:0db8::0005": "2001:db8::5", "2001:DB8::5": "2001:db8::5",
    "0000:0000:0000:0000:0000:0000:0000:0001": "::1", "1:2:3:4:5:6:01.02.03.04": "1:2:3:4:5:6:102:304",
    "::ffff:192.168.0.5": "192.168.0.5", "::ffff:0192.0168.0000.0005": "192.168.0.5", "::FFFF:c0a8:5": "192.168.0.5",
}
BAD_IPS = [
    "", "bad ip", "www.example.com", "1.2.3.400", "1.2..4", "1.2.3", "1.2.3.4.5", "1:2::12345", "1::2::3", "1:2:::3",
    "1:2:3", "1:2:3:4:5:6:7:8:9", "1:2:3:4::6:7:8:9", "1.2.3.4:80", "[2001:db8::5]", "[2001:db8::5]:80",
    "169.254.169.254%eth0", "fe80::1234%eth0", "1.2.3.0/24", "2001:db8::/64", " 1.2.3.4", "1.2.3.4 ", "010.0.0.5\n",
    "0x0a.0.0.5", "0xa.0.0.5", "0x.0.0.5", "0377.0.0.1", "0256.0.0.1", "1:2:3:4:5:6:7:08.0.0.1", "a:01.2.3.4",
]
GOOD_CIDRS = {
    "1.2.3.0/24": "1.2.3.0/24", "1.2.3.4/24": "1.2.3.0/24", "000.000.000.000/000": "0.0.0.0/0",
    "010.0.0.0/08": "10.0.0.0/8", "10.0.0.0/008": "10.0.0.0/8", "2001:DB8::1/064": "2001:db8::/64", "::/0": "::/0",
    "::ffff:1.1.1.0/120": "1.1.1.0/24", "::ffff:01.01.01.00/0120": "1.1.1.0/24",
    "::ffff:1.2.3.4/96": "0.0.0.0/0", "::ffff:1.2.3.4/95": "::fffe:0:0/95",  # (what Go's IPNet prints)
}
BAD_CIDRS = [
    "", "bad cidr", "1.2.300.0/24", "2001:db8000::/64", "1.2.3.4/64", "2001:db8::5/192", "1.2.3.0/-8", "1.2.3.0/+24",
    "www.example.com/24", "192.168.0.1/0/99", "1.2.3.4", "2001:db8::1", " 1.2.3.0/24", "1.2.3.0/24 ", "10.0.0.0/",
    "10.0.0.0/255.0.0.0", "10.0.0.0/0.255.255.255", "fe80::%eth0/64", "1.2.3.0/\uff12\uff14", "0x0a.0.0.0/8",
]


def test_addresses_and_ranges_are_parsed_as_kube_proxy_parses_them():
    from reconciler.desired import _read_cidr, _read_ip, normalize_ip

    assert {s: normalize_ip(s) for s in GOOD_IPS} == GOOD_IPS
    assert [s for s in BAD_IPS if normalize_ip(s) is not None] == []
    assert {s: (_read_cidr(s) or ("",))[0] for s in GOOD_CIDRS} == GOOD_CIDRS
    assert [s for s in BAD_CIDRS if _read_cidr(s) is not None] == []
    # what was read loosely says why; a strict spelling, even one not canonical, says nothing
    assert [_read_ip(s)[1] for s in ("192.168.0.5", "2001:DB8::5")] == ["", ""]
    assert "leading zeros are decimal" in _read_ip("010.0.0.5")[1]
    assert "IPv4-mapped" in _read_ip("::ffff:10.0.0.5")[1] and "IPv4-mapped" in _read_cidr("::ffff:10.0.0.0/104")[1]


def by_line(warnings: list[str]) -> list[str]:
    """Warnings as the build orders them: by file, line and column ("svc.yaml:9:3" before "svc.yaml:10:1")."""
    return sorted(warnings, key=lambda w: (w.split(":")[0], *(int(x) for x in w.split(":")[1:3]), w))


def build_warnings(tmp_path, text: str):
    with open(os.path.join(tmp_path, "svc.yaml"), "w") as fh:
        fh.write(text)
    state = build_desired_state(load_directory(tmp_path).objects, BuildOptions("node-a"))
    return state, [w.replace(f"{tmp_path}/", "") for w in state.warnings]


IGNORED = """apiVersion: v1
kind: Service
metadata: {name: lb, namespace: default}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.1
  ports: [{name: http, port: 80, nodePort: 30080}]
  loadBalancerSourceRanges: [10.0.0.0/33, " 192.168.0.0/16 ", "", 10.1.0.0]
status:
  loadBalancer:
    ingress: [{ip: ""}, {ip: 172.30.1.13}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: lb-1, namespace: default, labels: {kubernetes.io/service-name: lb}}
addressType: IPv4
ports: [{name: http, port: 8080}, {name: metrics, port: 0}, {name: admin}]
endpoints:
  - addresses: []
  - addresses: [10.244.1.5]
  - nodeName: node-a
"""


def test_entries_kube_proxy_ignores_are_skipped_with_a_warning_at_their_place(tmp_path):
    """kube-proxy drops the entry, not the object: a source range that is no CIDR
    (MapCIDRsByIPFamily), an endpoint without addresses and a slice port without a number or 0
    (endpointslicecache.go); an ingress ip "" is no ip (Go cannot tell it from an absent one)."""
    state, warnings = build_warnings(tmp_path, IGNORED)
    ignored = "ignored, as kube-proxy ignores it"
    assert warnings == by_line([
        f"svc.yaml:8:30: spec.loadBalancerSourceRanges[0]: invalid CIDR '10.0.0.0/33'; {ignored}",
        f"svc.yaml:8:63: spec.loadBalancerSourceRanges[2]: invalid CIDR ''; {ignored}",
        f"svc.yaml:8:67: spec.loadBalancerSourceRanges[3]: invalid CIDR '10.1.0.0'; {ignored}",  # (a CIDR needs a /)
        f"svc.yaml:17:51: ports[1].port: port 0; {ignored}",
        f"svc.yaml:17:61: ports[2].port: no port number; {ignored}",
        f"svc.yaml:19:5: endpoints[0].addresses: no address; {ignored}",
        f"svc.yaml:21:5: endpoints[2].addresses: no address; {ignored}",
    ])
    blk = state.by_id()["default/lb:http/TCP"].family("ipv4")
    assert blk.loadBalancerSourceRanges == ("192.168.0.0/16",) and blk.loadBalancerIPs == ("172.30.1.13",)
    assert [str(e) for e in blk.internal.endpoints] == ["10.244.1.5:8080"]
    # no valid range left: open to every source, as kube-proxy leaves it, and said so
    state, warnings = build_warnings(tmp_path, IGNORED.replace('" 192.168.0.0/16 "', "x"))
    assert state.by_id()["default/lb:http/TCP"].family("ipv4").loadBalancerSourceRanges == ()
    assert ("svc.yaml:8:3: spec.loadBalancerSourceRanges: no valid range: every source may reach the load "
            "balancer IPs, as with kube-proxy") in warnings


def test_addresses_of_a_family_the_service_does_not_have_are_skipped_with_a_warning(tmp_path):
    """A single-stack Service's externalIPs and LB IPs of the other family: kube-proxy programs
    them in no family (only a V(4) log); here they are said to be left out, at their place."""
    text = IGNORED.replace("clusterIP: 10.96.0.1", "clusterIP: 10.96.0.1\n  externalIPs: [192.0.2.7, 'fd00:30::81']")
    state, warnings = build_warnings(tmp_path, text.replace("{ip: 172.30.1.13}", "{ip: 172.30.1.13}, {ip: 'fd00:31::13'}"))
    other = "is of a family this Service has no clusterIP of (IPv4 only): not programmed, as kube-proxy does not"
    assert f"svc.yaml:7:28: spec.externalIPs[1]: fd00:30::81 {other}" in warnings
    assert f"svc.yaml:12:45: status.loadBalancer.ingress[2].ip: fd00:31::13 {other}" in warnings
    sp = state.by_id()["default/lb:http/TCP"]
    assert [blk.family for blk in sp.families] == ["ipv4"]
    assert (sp.family("ipv4").externalIPs, sp.family("ipv4").loadBalancerIPs) == (("192.0.2.7",), ("172.30.1.13",))


def test_loosely_written_addresses_are_read_with_a_warning_at_their_place(tmp_path):
    text = IGNORED.replace("clusterIP: 10.96.0.1", 'clusterIP: 010.096.000.001\n  externalIPs: ["::ffff:192.0.2.7"]')
    state, warnings = build_warnings(tmp_path, text.replace("[10.244.1.5]", "[010.244.001.005]"))
    zeros = "(leading zeros are decimal to kube-proxy, octal to some other tools)"
    assert f"svc.yaml:6:3: spec.clusterIP: '010.096.000.001' is read as 10.96.0.1 {zeros}" in warnings
    assert ("svc.yaml:7:17: spec.externalIPs[0]: '::ffff:192.0.2.7' is read as 192.0.2.7 (an IPv4-mapped IPv6 "
            "address is IPv4 to kube-proxy)") in warnings
    assert f"svc.yaml:21:17: endpoints[1].addresses[0]: '010.244.001.005' is read as 10.244.1.5 {zeros}" in warnings
    blk = state.by_id()["default/lb:http/TCP"].family("ipv4")
    assert (blk.clusterIP, blk.externalIPs, [str(e) for e in blk.internal.endpoints]) == (
        "10.96.0.1", ("192.0.2.7",), ["10.244.1.5:8080"])


def test_what_the_api_server_refuses_and_kube_proxy_cannot_use_stays_refused(tmp_path):
    assert "svc.yaml:11:26: status.loadBalancer.ingress[1].ip: invalid IP address '172.30.1.300'" in errors_for(
        tmp_path, IGNORED.replace("ip: 172.30.1.13", "ip: 172.30.1.300"))
    assert "spec.loadBalancerSourceRanges[0]: expected string, got int" in errors_for(
        tmp_path, IGNORED.replace("[10.0.0.0/33,", "[5,"))
    assert "svc.yaml:6:3: spec.clusterIP: invalid IP address '0x0a.96.0.1'" in errors_for(
        tmp_path, IGNORED.replace("clusterIP: 10.96.0.1", "clusterIP: 0x0a.96.0.1"))
    v6 = IGNORED.replace("addressType: IPv4", "addressType: IPv6").replace(
        "[10.244.1.5]", '["fd00::5", "::ffff:10.244.1.5"]')  # (the API server refuses it there too)
    assert ("svc.yaml:20:28: endpoints[1].addresses[1]: '::ffff:10.244.1.5', read as 10.244.1.5, is not an IPv6 "
            "address") in errors_for(tmp_path, v6)


MISSPELT = """apiVersion: v1
kind: Service
metadata: {name: cart, namespace: shop, lables: {app: cart}, annotations: {any/thing: x}}
spec:
  clusterIP: 10.96.20.40
  selector: {app: cart, anyKey: x}
  ports:
    - {name: http, port: 80, targetPrt: 8080}
  sessionAfinity: ClientIP
  sessionAffinityConfig: {clientIP: {timeoutSecond: 600}}
status:
  loadBalancer: {ingress: [{ip: 192.0.2.7, ports: [{port: 80, protocl: TCP}]}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: cart-1
  namespace: shop
  labels: {kubernetes.io/service-name: cart, anyKey: x}
addressType: IPv4
ports: [{name: http, port: 8080, appProtocl: http}]
endpoints:
  - addresses: [10.244.1.31]
    conditions: {ready: true}
    nodename: node-a
  - addresses: [10.244.1.32]
    conditions: {ready: true, servng: true}
    nodeName: node-a
  - addresses: [10.244.1.33]
    nodeName: node-b
    hints: {forZones: [{name: zone-b, weight: 1}], forNodes: [{name: node-b}]}
  - addresses: [10.244.1.34]
    targetRef: {kind: Pod, name: cart-4, namspace: shop}
  - addresses: [10.244.1.35]
    conditions: {ready: true}
    hostname: cart-5
    targetRef: {kind: Pod, name: cart-5, namespace: shop, uid: "1234"}
    zone: zone-a
---
apiVersion: v1
kind: Node
metadata: {name: node-a, lables: {topology.kubernetes.io/zone: zone-a}}
spec: {podCIDR: 10.244.1.0/24, anyField: x}
stauts: {}
"""


def test_a_field_the_api_type_does_not_have_is_warned_at_its_place_and_ignored(tmp_path):
    """As kubectl's strict field validation finds them (Kubernetes v1.36's types), in Services,
    EndpointSlices (each shape of endpoint) and a Node's top level and metadata; free-form maps
    (labels, annotations, selector) and a Node's spec are not looked into."""
    state, warnings = build_warnings(tmp_path, MISSPELT)
    tail = "kubectl's strict field validation would refuse it"
    assert warnings == by_line([
        f"svc.yaml:3:41: metadata.lables: unknown field of ObjectMeta, ignored (did you mean labels?); {tail}",
        f"svc.yaml:8:30: spec.ports[0].targetPrt: unknown field of ServicePort, ignored (did you mean "
        f"targetPort?); {tail}",
        f"svc.yaml:9:3: spec.sessionAfinity: unknown field of ServiceSpec, ignored (did you mean "
        f"sessionAffinity?); {tail}",
        f"svc.yaml:10:38: spec.sessionAffinityConfig.clientIP.timeoutSecond: unknown field of ClientIPConfig, "
        f"ignored (did you mean timeoutSeconds?); {tail}",
        "svc.yaml:10:3: spec.sessionAffinityConfig: set while sessionAffinity is None: ignored (the API server "
        "refuses it)",  # (sessionAfinity misspelt)
        "svc.yaml:12:18: status.loadBalancer.ingress: ignored: a ClusterIP Service's load balancer IPs are not "
        "programmed (the API server clears this status on any type but LoadBalancer since v1.29; kube-proxy "
        "would program them)",
        f"svc.yaml:12:63: status.loadBalancer.ingress[0].ports[0].protocl: unknown field of PortStatus, ignored "
        f"(did you mean protocol?); {tail}",
        f"svc.yaml:21:34: ports[0].appProtocl: unknown field of EndpointPort, ignored (did you mean "
        f"appProtocol?); {tail}",
        f"svc.yaml:25:5: endpoints[0].nodename: unknown field of Endpoint, ignored (did you mean nodeName?); {tail}",
        f"svc.yaml:27:31: endpoints[1].conditions.servng: unknown field of EndpointConditions, ignored (did you "
        f"mean serving?); {tail}",
        f"svc.yaml:31:39: endpoints[2].hints.forZones[0].weight: unknown field of ForZone, ignored; {tail}",
        f"svc.yaml:33:42: endpoints[3].targetRef.namspace: unknown field of ObjectReference, ignored (did you "
        f"mean namespace?); {tail}",
        f"svc.yaml:42:26: metadata.lables: unknown field of ObjectMeta, ignored (did you mean labels?); {tail}",
        f"svc.yaml:44:1: stauts: unknown field of Node, ignored (did you mean status?); {tail}",
    ])
    sp = state.by_id()["shop/cart:http/TCP"]
    assert sp.affinityTimeoutSeconds is None  # (what the misspelling costs: no sticky sessions)
    assert state.node.zone is None  # (the Node's labels were misspelt too)
    assert len(sp.family("ipv4").internal.endpoints) == 5  # (every shape of endpoint read as usual)
    # the endpoint whose nodeName is misspelt is not local to node-a
    state, _ = build_warnings(tmp_path, MISSPELT.replace("sessionAfinity: ClientIP", "internalTrafficPolicy: Local"))
    assert [str(e) for e in state.by_id()["shop/cart:http/TCP"].family("ipv4").internal.endpoints] == [
        "10.244.1.32:8080"]


def test_objects_the_api_server_served_are_not_checked_for_unknown_fields(tmp_path):
    """It drops unknown fields as it decodes an object: any it serves are of a newer Kubernetes."""
    with open(os.path.join(tmp_path, "svc.yaml"), "w") as fh:
        fh.write(MISSPELT)
    objects = [SourceObject(o.kind, o.namespace, o.name, o.body, Location(f"kubernetes:{o.kind}/{o.name}"))
               for o in load_directory(tmp_path).objects]
    assert build_desired_state(objects, BuildOptions("node-a")).warnings == ()


def test_a_service_without_a_cluster_ip_is_checked_before_it_is_skipped(tmp_path):
    """A hand-written manifest may leave clusterIP to the API server: the Service is skipped with
    a warning, and what is wrong with the rest of it is still an error at its place."""
    text = BASE.replace("  clusterIP: {ip}\n", "").format(port=70000, proto="TCP")
    assert "svc.yaml:9:7: spec.ports[0].port: port 70000 out of range" in errors_for(tmp_path, text)
    with open(os.path.join(tmp_path, "svc.yaml"), "w") as fh:
        fh.write(BASE.replace("  clusterIP: {ip}\n", "").format(port=80, proto="TCP"))
    state = build_desired_state(load_directory(tmp_path).objects, BuildOptions("node-a"))
    assert state.services == ()
    assert any("svc.yaml:6:1: Service default/web has no clusterIP; skipped" in w for w in state.warnings)


def test_what_the_api_server_refuses_but_changes_nothing_here_is_warned_about(tmp_path):
    """sessionAffinityConfig without ClientIP affinity, a healthCheckNodePort on anything but a
    LoadBalancer with externalTrafficPolicy Local: never stored by the API server, ignored here."""
    (tmp_path / "svc.yaml").write_text(BASE.format(ip="10.96.0.1", port=80, proto="TCP").replace(
        "  clusterIP:", "  healthCheckNodePort: 32000\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}\n"
                        "  clusterIP:"))
    desired = build_desired_state(load_directory(tmp_path).objects, BuildOptions("node-a"))
    assert [w.split(": ", 2)[1:] for w in desired.warnings] == [
        ["spec.healthCheckNodePort", "set but not served: only a LoadBalancer with externalTrafficPolicy Local has one "
                                     "(the API server refuses it otherwise)"],
        ["spec.sessionAffinityConfig", "set while sessionAffinity is None: ignored (the API server refuses it)"]]
    assert desired.healthChecks == () and desired.services[0].affinityTimeoutSeconds is None


@pytest.mark.parametrize("ip, reason", [
    ("127.0.0.53", "in the loopback range"), ("::1", "in the loopback range"), ("0.0.0.0", "unspecified"),
    ("169.254.169.254", "in the link-local range"), ("224.0.0.251", "in the link-local multicast range"),
    ("239.1.2.3", "multicast"), ("ff05::1", "multicast"),
])
def test_a_cluster_ip_that_would_take_the_nodes_own_traffic_is_refused(tmp_path, ip, reason):
    """Every packet to a clusterIP is DNATed, the node's own too: 127.0.0.53 would take over the
    node's local resolver. No service CIDR holds such an address (also without --service-cidr)."""
    msg = errors_for(tmp_path, BASE.format(ip=ip, port=53, proto="UDP"))
    assert f"svc.yaml:7:3: spec.clusterIP: {ip} may not be {reason}" in msg
    two = BASE.format(ip="10.96.0.1", port=53, proto="UDP").replace("  clusterIP: 10.96.0.1",
                                                                     f"  clusterIPs: [10.96.0.1, '{ip}']")
    assert "spec.clusterIPs[1]: " in errors_for(tmp_path, two)


def test_an_ordinary_cluster_ip_is_taken(tmp_path):
    for ip in ("10.96.0.10", "fd00:96::a", "192.168.3.4"):
        build_warnings(tmp_path, BASE.format(ip=ip, port=53, proto="UDP"))


def test_an_error_in_a_big_crlf_file_is_placed_by_its_document_alone(tmp_path, monkeypatch):
    """A big file with CRLF line breaks (PowerShell's): its error is placed by re-reading just its
    document, as in a LF file (the whole-file re-read takes ~7 s a MB)."""
    from reconciler.sources import manifests

    docs = [BASE.format(ip=f"10.96.{i // 250}.{i % 250 + 1}", port=80, proto="TCP").replace("name: web", f"name: s{i}")
            for i in range(400)]  # ~70 KB
    docs[300] = docs[300].replace("port: 80", "port: 70000")

    def whole_file(self):  # type: ignore[no-untyped-def]
        raise AssertionError("the whole file was parsed again")

    monkeypatch.setattr(manifests._FileLocator, "docs", whole_file)
    msg = errors_for(tmp_path, ("---\n" + "---\n".join(docs)).replace("\n", "\r\n"))
    line = 1 + 300 * 12 + 1 + 9
    assert f"svc.yaml:{line}:7: spec.ports[0].port: port 70000 out of range" in msg


def test_an_object_we_cannot_read_hides_no_other_object_of_its_file(tmp_path):
    """A document whose apiVersion, kind or name we cannot take is an error of its own: the
    file's other documents are read and checked all the same (it hid them: one error per file),
    in the order of their lines. The watched directory still holds such a file back whole."""
    text = ("apiVersion: v1\nkind: Service\nmetadata: {name: a}\nspec:\n  clusterIP: 10.96.0.5\n"
            "  ports: [{port: 70000}]\n---\n"
            "apiVersion: v2\nkind: Service\nmetadata: {name: b}\nspec: {clusterIP: 10.96.0.6, ports: [{port: 80}]}\n---\n"
            "apiVersion: v1\nkind: Service\nmetadata: {namespace: default}\nspec: {clusterIP: 10.96.0.7}\n")
    with open(os.path.join(tmp_path, "m.yaml"), "w") as fh:
        fh.write(text)
    from reconciler.config import Options
    from reconciler.reconcile import load_desired

    with pytest.raises(InputErrors) as exc:  # (as validate, plan and apply read a directory)
        load_desired(str(tmp_path), Options(node_name="node-a"))
    msg = "\n".join(map(str, in_place_order(exc.value.errors)))
    at = [msg.index(s) for s in ("m.yaml:6:", "m.yaml:8:1: apiVersion: unsupported apiVersion 'v2'",
                                 "m.yaml:15:1: metadata.name: is required")]
    assert at == sorted(at), msg
    with pytest.raises(InputError):  # (one object's error is the file's, read alone: the watcher's way)
        load_file(os.path.join(tmp_path, "m.yaml"))


def test_a_loose_spelling_of_this_nodes_ip_is_warned_about(tmp_path):
    """This node's status.addresses decide nodePortAddresses [primary] and the source ranges'
    exception: a spelling kube-proxy reads otherwise than it looks gets the warning every other
    address gets (an IPv4-mapped one was read as IPv4 without a word)."""
    with open(os.path.join(tmp_path, "node.yaml"), "w") as fh:
        fh.write("apiVersion: v1\nkind: Node\nmetadata: {name: node-a}\nstatus:\n  addresses:\n"
                 "  - {type: InternalIP, address: '::ffff:172.30.0.2'}\n  - {type: Hostname, address: '010.0.0.5'}\n")
    desired = build_desired_state(load_directory(tmp_path).objects, BuildOptions("node-a"))
    assert [w.replace(f"{tmp_path}/", "") for w in desired.warnings] == [
        "node.yaml:6:24: status.addresses[0].address: '::ffff:172.30.0.2' is read as 172.30.0.2 (an IPv4-mapped "
        "IPv6 address is IPv4 to kube-proxy)"]
    assert desired.node.addresses == ("172.30.0.2",)
