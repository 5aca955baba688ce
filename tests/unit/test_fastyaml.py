"""The fast YAML paths give what ruamel.yaml's YAML 1.2 loader (the reference) gives on the YAML
that manifests use, and decline (None / Unsupported) what they would read differently."""

from __future__ import annotations

import glob
import os

import pytest
from helpers import STATE_DIR
from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError

from reconciler.sources import fastyaml
from reconciler.sources.manifests import _load_yaml


def reference(text: str) -> list:
    return list(YAML(typ="safe", pure=True).load_all(text))


SLICE = """\
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-abc   # a comment
  namespace: "shop"
  labels: {kubernetes.io/service-name: web, 'app.kubernetes.io/part-of': "x: y"}
addressType: IPv6
ports: [{name: http, port: 8080, protocol: TCP}, {name: '', port: 53, protocol: UDP}]
endpoints:
  - addresses: [fd00::1, "fd00::2"]
    conditions: {ready: true, serving: True, terminating: false}
    hints:
      forZones: [{name: zone-a}]
  - addresses:
      - fd00::3
    conditions: {ready: null, serving: ~}
    nodeName: node-b
    zone:
"""

MANAGED = """\
apiVersion: v1
kind: Service
metadata:
  annotations:
    kubectl.kubernetes.io/last-applied-configuration: |
      {"apiVersion":"v1","kind":"Service","metadata":{"name":"web"},"spec":{"ports":[{"port":80}]}}
  creationTimestamp: "2024-05-01T10:00:00Z"
  managedFields:
  - apiVersion: v1
    fieldsType: FieldsV1
    fieldsV1:
      f:spec:
        f:ports:
          .: {}
          k:{"port":80,"protocol":"TCP"}:
            .: {}
            f:port: {}
    manager: kubectl-client-side-apply
    time: "2024-05-01T10:00:00Z"
  name: web
  uid: 7f1c2d3e-aaaa-bbbb-cccc-123456789abc
spec: {clusterIP: 10.96.0.10, ports: [{port: 80, protocol: TCP, targetPort: 8080}]}
"""

CASES = {
    "one document": "apiVersion: v1\nkind: Service\nmetadata: {name: a}\n",
    "a stream": "a: 1\n---\nb: [1, 2]\n--- # second\nc: {d: e}\n",
    "empty documents": "---\n---\na: 1\n---\n",
    "comments before the first marker": "# header\n\n---\na: 1\n",
    "no documents": "# nothing here\n",
    "empty text": "",
    "a null document first": "null\n---\na: 1\n",
    "block scalar holding a marker-like line": "a: |\n  ---\n  x\nb: >-\n  folded\n  text\n",
    "anchors and aliases": "a: &p {port: 80}\nb: *p\nc: [*p, *p]\n",
    "scalars": "i: 10\nneg: -5\nf: 1.5\ne: 1e3\nb: true\nn: ~\ns: yes\no: on\nq: '010'\nu: 8_080\n"
               "ip: 10.0.0.1\nv6: 2001:db8::1\ncidr: 10.0.0.0/8\nport: '80'\nname: svc-0x\n",
    "a top-level sequence document": "---\n- {a: 1}\n- {b: 2}\n",
    "a slice": SLICE,
    "a slice after a service": "kind: Service\nspec: {clusterIP: None}\n---\n" + SLICE,
    "a byte order mark": "\ufeffapiVersion: v1\nkind: Service\n",
    "kubectl output with managed fields": MANAGED,
    "a byte order mark before a stream": "\ufeff---\na: 1\n---\nb: 2\n",
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_compiled_path_reads_manifests_as_the_reference_does(name: str) -> None:
    assert fastyaml.yaml_rs is not None  # a dependency: the fast path must be there
    text = CASES[name]
    got = fastyaml._load_all_compiled(text)
    assert got is not None, "declined"
    assert got == reference(text)
    try:
        events = fastyaml._load_all_events(text)
    except (fastyaml.Unsupported, YAMLError):
        return  # it declines this one (libyaml is YAML 1.1: no ':' in flow scalars such as fd00::1)
    assert events == got  # the slower fast path agrees where it reads the text at all


def test_both_paths_read_the_example_state_as_the_reference_does() -> None:
    files = sorted(glob.glob(os.path.join(STATE_DIR, "**", "*.y*ml"), recursive=True))
    assert files
    for path in files:
        with open(path) as fh:
            text = fh.read()
        assert fastyaml._load_all_compiled(text) == reference(text) == fastyaml._load_all_events(text), path


def test_timestamps_stay_strings() -> None:
    # as in the event path: no field we read is a timestamp, and a datetime would not match a schema string
    text = "metadata: {creationTimestamp: 2024-05-01T10:00:00Z}\n"
    assert fastyaml._load_all_compiled(text) == [{"metadata": {"creationTimestamp": "2024-05-01T10:00:00Z"}}]


@pytest.mark.parametrize("text", [
    "a: !!str 5\n",                       # an explicit tag (yaml-rs drops unknown ones silently)
    "a: !custom x\n",
    "base: &b {x: 1}\nm:\n  <<: *b\n",   # a merge key (yaml-rs keeps "<<" as a key)
    "--- {a: 1}\n",                       # content on the marker line
    "a: 1\n...\n---\nb: 2\n",             # a document end marker
    "%YAML 1.2\n---\na: 1\n",             # a directive
    "a: 1\na: 2\n",                       # a duplicate key: the reference names its place
    "a: [1, 2\n",                         # a syntax error: likewise
    "a: 1\n---\n\ufeffb: 2\n",              # a byte order mark past the start
    "a: 1\r\n---\r\nb: 2\r\n",              # carriage returns (manifests._parse makes them \n)
    "a: 1\r---\rb: 2\r",
    "a: x\x00\nb: 2\n",                    # NUL: yaml-rs stops there without a word
    "a: \x07\n", "a: x\x85y\n",             # not allowed / a line break to YAML
    "\ta: 1\n",                            # a tab as indentation
    "a: 1\n---#c\nb: 2\n",                  # no marker: "---" needs a space before a comment
    "{a: 1}: c\n", "? a\n: 1\n", "- [a, b]: c\n", "x: {[a]: 1}\n",  # complex keys
    "a: _1\n", "a: 0X10\n", "a: 0B1\n", "a: .Nan\n", "a: 0x1F\n", "a: [-0o17]\n",  # loose numbers
])
def test_the_compiled_path_declines_what_it_would_read_differently(text: str) -> None:
    assert fastyaml._load_all_compiled(text) is None


@pytest.mark.parametrize("text", ["a: !!str 5\n", "base: &b {x: 1}\nm:\n  <<: *b\n", "--- {a: 1}\n",
                                  "a: 1\n...\n---\nb: 2\n", "%YAML 1.2\n---\na: 1\n", "a: _1\n", "a: 0X10\n",
                                  "a: .Nan\n", "a: 0x1F\nb: 0o17\n", "a: x\x85y\n"])
def test_declined_texts_still_load_as_the_reference_loads_them(text: str) -> None:
    assert _load_yaml(text) == reference(text)


@pytest.mark.parametrize("text", ["a: 8_080\n", "b: +0x10\n", "c: -0o17\n", "d: 1_000.5\n", "e: [0B1]\n"])
def test_the_event_path_leaves_other_number_notations_to_the_reference(text: str) -> None:
    # the daemon's path (share_keys) and the one-shot commands' must read the same numbers
    assert _load_yaml(text, share_keys=True) == _load_yaml(text) == reference(text)


@pytest.mark.parametrize("text", ["a: x\x00\nb: 2\n", "\ta: 1\n", "{a: 1}: c\n", "a: 1\n---#c\nb: 2\n"])
def test_what_the_reference_rejects_is_rejected(text: str) -> None:
    from ruamel.yaml.constructor import ConstructorError
    with pytest.raises((YAMLError, ConstructorError)):
        reference(text)
    with pytest.raises((YAMLError, ConstructorError)):
        _load_yaml(text)


def test_files_with_carriage_returns_load_as_before(tmp_path) -> None:
    from reconciler.sources.manifests import load_directory

    node = "apiVersion: v1\nkind: Node\nmetadata: {{name: {}}}\n"
    (tmp_path / "crlf.yaml").write_bytes((node.format("a") + "---\n" + node.format("b")).replace("\n", "\r\n").encode())
    (tmp_path / "cr.yaml").write_bytes((node.format("c") + "---\n" + node.format("d")).replace("\n", "\r").encode())
    assert sorted(o.name for o in load_directory(tmp_path).objects) == ["a", "b", "c", "d"]


def test_shared_keys_are_one_string_each_and_the_data_is_the_same() -> None:
    text = "apiVersion: v1\nkind: Service\nmetadata: {name: a}\n---\n" + SLICE.replace("fd00::1", '"fd00::1"')
    shared = fastyaml.load_all(text, share_keys=True)
    assert shared == fastyaml.load_all(text) == reference(text)
    first, second = shared
    assert next(iter(first)) is next(iter(second))  # "apiVersion": one string for both


def test_shared_keys_of_a_deeply_nested_document() -> None:
    text = "a: " + "[" * 250 + "{k: v}" + "]" * 250 + "\nb: {c: 1}\n"  # about as deep as yaml-rs goes
    assert fastyaml._load_all_compiled(text) is not None
    assert fastyaml.load_all(text, share_keys=True) == fastyaml.load_all(text) == reference(text)


def test_the_daemon_keeps_its_bodies_with_shared_keys(tmp_path) -> None:
    from reconciler.sources.watch import DirectorySource

    for name in ("a", "b"):
        (tmp_path / f"{name}.yaml").write_text(f"apiVersion: v1\nkind: Service\nmetadata: {{name: {name}}}\n"
                                               "spec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}\n")
    a, b = DirectorySource(str(tmp_path)).snapshot().objects
    assert a.body == {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "a"},
                      "spec": {"clusterIP": "10.96.0.1", "ports": [{"port": 80}]}}
    assert next(iter(a.body["spec"])) is next(iter(b.body["spec"]))  # across files too
