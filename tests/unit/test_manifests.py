"""Loading a manifest directory: formats, locations of errors, duplicates, skipped kinds."""

from __future__ import annotations

import json
import os

import pytest
from helpers import STATE_DIR

from reconciler.sources.manifests import load_directory
from reconciler.sources.objects import InputErrors


def write(root, rel: str, text: str) -> None:
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        fh.write(text)


SVC = """apiVersion: v1
kind: Service
metadata:
  name: {name}
  namespace: default
spec:
  clusterIP: 10.96.0.{n}
  ports:
    - name: http
      port: {port}
"""


def test_example_state_loads():
    result = load_directory(STATE_DIR)
    kinds = sorted({o.kind for o in result.objects})
    assert kinds == ["EndpointSlice", "Node", "Service"]
    assert result.warnings == []


def test_formats_lists_nested_dirs_and_other_files(tmp_path):
    write(tmp_path, "a/b/svc.yml", SVC.format(name="a", n=1, port=80) + "---\n" + SVC.format(name="b", n=2, port=80))
    lst = {"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "c"}, "spec": {"clusterIP": "10.96.0.3",
                                                                                   "ports": [{"port": 1}]}}]}
    write(tmp_path, "c.json", json.dumps(lst))
    write(tmp_path, "README.md", "not a manifest: {{{")
    write(tmp_path, ".hidden/x.yaml", "::: broken")
    result = load_directory(tmp_path)
    assert sorted(o.name for o in result.objects) == ["a", "b", "c"]
    assert all(o.namespace == "default" for o in result.objects)


def test_unknown_kind_is_a_warning_with_place(tmp_path):
    write(tmp_path, "cm.yaml", "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: x\n")
    result = load_directory(tmp_path)
    assert result.objects == []
    assert len(result.warnings) == 1 and "cm.yaml:1:1" in result.warnings[0] and "ConfigMap" in result.warnings[0]


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    write(tmp_path, "bad.yaml", "apiVersion: v1\nkind: Service\nmetadata:\n  name: [oops\n")
    with pytest.raises(InputErrors) as exc:
        load_directory(tmp_path)
    msg = str(exc.value)
    assert "bad.yaml:" in msg and "invalid YAML" in msg


def test_duplicates_name_both_places(tmp_path):
    write(tmp_path, "one.yaml", SVC.format(name="web", n=1, port=80))
    write(tmp_path, "two/again.yaml", "# comment\n" + SVC.format(name="web", n=1, port=80))
    with pytest.raises(InputErrors) as exc:
        load_directory(tmp_path)
    msg = str(exc.value)
    assert "duplicate Service default/web" in msg
    assert "one.yaml:1:1" in msg and "again.yaml:2:1" in msg
