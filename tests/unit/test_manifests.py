"""Loading a manifest directory: formats, locations of errors, duplicates, skipped kinds."""

from __future__ import annotations

import json
import os
import time

import pytest
from helpers import STATE_DIR

from reconciler.config import Options
from reconciler.desired import build_desired_state
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


def test_typed_list_items_take_the_list_s_kind(tmp_path):
    """`kubectl get --raw /api/v1/services` (or the API via curl) serves a ServiceList whose items
    carry no apiVersion or kind: they are Services all the same, with their places in the file."""
    items = [{"metadata": {"name": "raw", "namespace": "shop"}, "spec": {"clusterIP": "10.96.0.9", "ports": [{"port": 80}]}},
             {"metadata": {"name": "bad"}, "spec": {"clusterIP": "10.96.0.8", "ports": [{"port": "x"}]}}]
    write(tmp_path, "svcs.yaml", "apiVersion: v1\nkind: ServiceList\nmetadata: {}\nitems:\n"
          + "".join("- " + json.dumps(i) + "\n" for i in items))
    write(tmp_path, "eps.json", json.dumps({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                                            "items": [{"metadata": {"name": "raw-1", "namespace": "shop"},
                                                       "addressType": "IPv4", "endpoints": []}]}))
    result = load_directory(tmp_path)
    assert sorted((o.kind, o.namespace, o.name) for o in result.objects) == [
        ("EndpointSlice", "shop", "raw-1"), ("Service", "default", "bad"), ("Service", "shop", "raw")]
    assert result.warnings == []
    with pytest.raises(InputErrors) as exc:  # the fields of an item are found at their lines
        build_desired_state(result.objects, Options(node_name="n").build_options())
    assert "svcs.yaml:6:" in str(exc.value) and "port" in str(exc.value)


def test_unknown_kind_is_a_warning_with_place(tmp_path):
    write(tmp_path, "cm.yaml", "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: x\n")
    result = load_directory(tmp_path)
    assert result.objects == []
    assert len(result.warnings) == 1 and "cm.yaml:1:1" in result.warnings[0] and "ConfigMap" in result.warnings[0]
    # a YAML document of something else (a compose file) is not "kind None/None"
    write(tmp_path, "cm.yaml", "services:\n  web: {image: nginx}\n")
    assert load_directory(tmp_path).warnings == [
        f"{tmp_path / 'cm.yaml'}:1:1: skipping a document without apiVersion and kind (no Kubernetes object)"]


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


def _many(root, n: int) -> None:
    for i in range(n):
        write(root, f"d{i % 3}/s{i:03d}.yaml", SVC.format(name=f"s{i}", n=i % 250 + 1, port=80 + i))
    write(root, "d1/s040.yaml", "apiVersion: v1\nkind: Service\nmetadata: {name: s40\n")  # broken
    write(root, "d2/j.json", json.dumps({"apiVersion": "v1", "kind": "Service",
                                         "metadata": {"name": "j"}, "spec": {"clusterIP": "None"}}))
    write(root, "d2/t.yaml", "apiVersion: v1\nkind: Service\nmetadata: {name: !!str t}\n")  # fast path declines


def _loaded(root, pool=None):
    try:
        result = load_directory(root, pool)
    except InputErrors as exc:
        return [str(e) for e in exc.errors]
    return [(o.kind, o.namespace, o.name, o.body, str(o.where(("spec", "ports", 0, "port")))) for o in result.objects]


def test_parsing_in_worker_processes_gives_what_parsing_here_gives(tmp_path, monkeypatch):
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from reconciler.sources import manifests

    monkeypatch.setattr(manifests, "PARALLEL_MIN_FILES", 8)
    monkeypatch.setattr(manifests, "PARALLEL_CHUNK", 7)
    _many(tmp_path, 60)
    here = _loaded(tmp_path)
    assert len(here) == 1 and "s040.yaml:4:1: invalid YAML" in here[0]  # the broken file, by line
    os.remove(tmp_path / "d1" / "s040.yaml")
    here = _loaded(tmp_path)
    assert len(here) == 61 and ":10:" in here[0][4]  # spec.ports[0].port is on line 10
    given = []
    real = manifests.load_file

    def recording(path, docs=None, **kw):
        given.append(docs is not None)
        if len(given) <= 30:
            time.sleep(0.005)  # the workers start their chunks meanwhile
        return real(path, docs, **kw)

    monkeypatch.setattr(manifests, "load_file", recording)
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork")) as pool:
        pool.submit(os.getpid).result()  # the workers are up
        assert _loaded(tmp_path, pool) == here
    assert not any(given[:len(given) // 2]) and any(given)  # part of the second half: parsed by a worker
    _many(tmp_path, 60)  # the broken file again: its error comes out the same
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork")) as pool:
        errors = _loaded(tmp_path, pool)
    assert len(errors) == 1 and "s040.yaml:4:1: invalid YAML" in errors[0]


def test_parsing_falls_back_here_when_the_workers_fail(tmp_path, monkeypatch):
    from concurrent.futures import Future

    from reconciler.sources import manifests

    class Dead:
        def submit(self, *args):
            f: Future = Future()
            f.set_running_or_notify_cancel()
            f.set_exception(RuntimeError("worker died"))
            return f

    class Gone:  # (the worker died before anything was given to it)
        def submit(self, *args):
            from concurrent.futures.process import BrokenProcessPool
            raise BrokenProcessPool("A child process terminated abruptly")

    monkeypatch.setattr(manifests, "PARALLEL_MIN_FILES", 8)
    monkeypatch.setattr(manifests, "PARALLEL_CHUNK", 7)
    _many(tmp_path, 30)
    os.remove(tmp_path / "d1" / "s040.yaml")
    assert _loaded(tmp_path, Dead()) == _loaded(tmp_path)
    assert _loaded(tmp_path, Gone()) == _loaded(tmp_path)


def test_the_worker_is_given_chunks_only_once_its_kernel_read_is_done_and_only_those_not_reached(
        tmp_path, monkeypatch):
    """A chunk queued behind a long kernel read would be parsed for nothing (this process gets
    there first) and waited for at the end: chunks are given once the read (`after`) is done,
    and only those ahead of where this process is."""
    from concurrent.futures import Future

    from reconciler.sources import manifests

    class Recording:
        def __init__(self) -> None:
            self.given: list[int] = []

        def submit(self, fn, paths):
            self.given.append(files.index(paths[0]))
            return Future()  # (never done: parsed here)

    monkeypatch.setattr(manifests, "PARALLEL_MIN_FILES", 8)
    monkeypatch.setattr(manifests, "PARALLEL_CHUNK", 7)
    _many(tmp_path, 70)
    os.remove(tmp_path / "d1" / "s040.yaml")
    files = manifests.manifest_files(tmp_path)
    read: Future = Future()
    real, seen = manifests.load_file, []

    def loading(path, docs=None, **kw):
        seen.append(path)
        if len(seen) == 20:
            read.set_result("model")  # (the kernel read ends while the 20th file loads)
        return real(path, docs, **kw)

    monkeypatch.setattr(manifests, "load_file", loading)
    pool = Recording()
    result = manifests.load_directory(tmp_path, pool, read)
    assert len(result.objects) == len(files) == 71
    half = len(files) // 2
    assert pool.given == [s for s in reversed(range(half, len(files), 7)) if s > 32]  # (looked at every 32 files)
    pool, read = Recording(), Future()
    manifests.load_directory(tmp_path, pool, read)  # (a read that outlasts the loading: nothing given)
    assert pool.given == []
