"""Validation errors name file:line:column and the field path."""

from __future__ import annotations

import os

import pytest

from reconciler.desired import BuildOptions, build_desired_state
from reconciler.sources.manifests import load_directory
from reconciler.sources.objects import InputErrors


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
    assert "zzz.yaml:10:7: spec.ports[0].port: 10.96.0.1:80/TCP already used by default/web:http/TCP" in msg


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


def test_what_the_api_server_refuses_is_refused_here_too(tmp_path):
    base = BASE.format(ip="10.96.0.1", port=80, proto="TCP")
    msg = errors_for(tmp_path, base.replace("      protocol: TCP", "      protocol: TCP\n      nodePort: 30080"))
    assert "svc.yaml:12:7: spec.ports[0].nodePort: a ClusterIP Service has no nodePort" in msg
    msg = errors_for(tmp_path, base.replace("  clusterIP: 10.96.0.1", "  clusterIP: 10.96.0.1\n  clusterIPs: [10.96.0.2]"))
    assert "svc.yaml:7:3: spec.clusterIP: '10.96.0.1' is not clusterIPs[0] ('10.96.0.2')" in msg
    msg = errors_for(tmp_path, base.replace("name: web", "name: 123"))
    assert "svc.yaml:4:3: metadata.name: expected string, got int" in msg
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
