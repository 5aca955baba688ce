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
