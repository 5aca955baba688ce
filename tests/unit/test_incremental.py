"""The run loop's O(changes) paths give exactly what a from-scratch pass gives: the build cache fed
deltas, the renderer reusing untouched tables, directory snapshots reporting their changes."""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import signal
from pathlib import Path

import pytest

from helpers import endpoint, endpoint_slice, node, service

from reconciler.backends.iptables.render import render as iptables_render
from reconciler.backends.nftables.diff import diff
from reconciler.backends.nftables.render import Renderer, render, shard_of
from reconciler.desired import BuildCache, BuildOptions, build_desired_state
from reconciler.sources.watch import DirectorySource
from reconciler.state import PortChanges

OPTS = BuildOptions("node-a", ("10.244.0.0/16",))
HTTP = [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}]


def svc_objects(i: int, version: int = 0) -> list:
    eps = [endpoint(f"10.244.{i % 250}.{k + 1 + version}", node="node-a" if k == 0 else "node-b") for k in range(3)]
    return [service(f"s{i}", f"10.96.{i // 200}.{i % 200 + 1}", HTTP, type="NodePort" if i % 5 == 0 else "ClusterIP"),
            endpoint_slice(f"s{i}", eps)]


def random_edits(rng: random.Random, current: dict, ids: range, n: int, version: int) -> tuple[list, list]:
    """Remove (30%) or add/replace n random services of `current` in place: (added, removed) objects."""
    added: list = []
    removed: list = []
    for i in rng.sample(ids, n):
        if i in current and rng.random() < 0.3:
            removed += current.pop(i)
        else:
            removed += current.get(i, [])
            current[i] = svc_objects(i, version=version)
            added += current[i]
    return added, removed


def test_build_cache_fed_deltas_equals_a_fresh_build():
    rng = random.Random(7)
    current = {i: svc_objects(i) for i in range(60)}
    cache = BuildCache()
    cache.update([o for objs in current.values() for o in objs], [], OPTS)
    for step in range(25):
        added, removed = random_edits(rng, current, range(80), 4, version=step + 1)
        if step == 10:  # the Node arrives: every service's topology is looked at again
            current[-1] = [node("node-a", zone="z1")]
            added += current[-1]
        got = cache.update(added, removed, OPTS)
        want = build_desired_state([o for objs in current.values() for o in objs], OPTS)
        assert got == want
        assert set(cache.objects) == {id(o) for objs in current.values() for o in objs}  # nothing stale kept
        assert cache.last_added == sorted(added, key=lambda o: (o.kind, o.namespace, o.name))


def test_renderer_reuses_untouched_tables_and_matches_a_fresh_render():
    objs = {i: svc_objects(i) for i in range(120)}
    renderer = Renderer()
    cache = BuildCache()
    before = renderer.render(cache.build([o for v in objs.values() for o in v], OPTS))
    objs[7] = svc_objects(7, version=1)  # one endpoint set changes
    del objs[8]  # one service goes
    objs[500] = svc_objects(500)  # one arrives
    desired = cache.build([o for v in objs.values() for o in v], OPTS)
    after = renderer.render(desired)
    assert after == render(desired)  # same content as rendering from scratch
    assert diff(after, render(desired)) == []
    touched = {t for t, table in after.tables.items() if before.tables.get(t) is not table}
    assert 1 <= len(touched) <= 4  # the main table and the shards of the three service ports
    assert {op.service for op in diff(after, before) if op.service} == {
        "default/s7:http/TCP", "default/s8:http/TCP", "default/s500:http/TCP"}


def test_port_changes_by_identity():
    cache = BuildCache()
    objs = {i: svc_objects(i) for i in range(10)}
    tracker = PortChanges()
    first = cache.build([o for v in objs.values() for o in v], OPTS)
    gone, new = tracker.update(first)
    assert gone == [] and new == list(first.services)
    objs[3] = svc_objects(3, version=2)
    second = cache.build([o for v in objs.values() for o in v], OPTS)
    gone, new = tracker.update(second)
    assert [sp.id for sp in gone] == [sp.id for sp in new] == ["default/s3:http/TCP"]
    assert tracker.update(second) == ([], [])


def test_port_changes_from_the_builders_delta_equal_an_identity_comparison():
    rng = random.Random(11)
    current = {i: svc_objects(i) for i in range(40)}
    cache = BuildCache()
    with_delta, by_identity = PortChanges(), PortChanges()
    opts = OPTS
    for step in range(30):
        added, removed = random_edits(rng, current, range(50), 3, version=step + 1)
        if step == 12:
            current[-1] = [node("node-a", zone="z1")]  # touches every service
            added += current[-1]
        if step == 20:
            opts = BuildOptions("node-a", ("10.244.0.0/16", "fd00::/64"))  # the cache starts over
        desired = cache.update(added, removed, opts)
        assert desired.changes is not None and desired.changes.since == (None if step in (0, 20) else desired.serial - 1)
        got = with_delta.update(desired)
        want = by_identity.update(dataclasses.replace(desired, serial=None, changes=None))
        assert [[id(sp) for sp in side] for side in got] == [[id(sp) for sp in side] for side in want]
        if step == 5:
            assert with_delta.update(desired) == ([], [])  # the same document again: nothing changed
        if step == 25:  # a document the trackers never see: the next delta is not relative to
            # what with_delta saw, so it compares by identity (and must agree with by_identity)
            cache.update(svc_objects(45, version=99), current.pop(45, []), opts)
            current[45] = svc_objects(45, version=99)

SVC = """apiVersion: v1
kind: Service
metadata: {{name: {name}}}
spec: {{clusterIP: {ip}, ports: [{{name: http, port: 80}}]}}
"""


def test_directory_snapshot_reports_its_changes(tmp_path: Path):
    (tmp_path / "a.yaml").write_text(SVC.format(name="a", ip="10.96.0.1"))
    (tmp_path / "b.yaml").write_text(SVC.format(name="b", ip="10.96.0.2"))
    src = DirectorySource(str(tmp_path))
    first = src.snapshot(objects=False)
    assert first.objects == [] and sorted(o.name for o in first.added_objects) == ["a", "b"]
    assert first.removed_objects == []
    a_obj = next(o for o in first.added_objects if o.name == "a")
    (tmp_path / "a.yaml").write_text(SVC.format(name="a", ip="10.96.0.9"))
    (tmp_path / "c.yaml").write_text(SVC.format(name="b", ip="10.96.0.3"))  # b defined twice
    src._dirty |= {str(tmp_path / "a.yaml"), str(tmp_path / "c.yaml")}
    second = src.snapshot(objects=False)
    assert [o.name for o in second.removed_objects] == ["a"] and second.removed_objects[0] is a_obj
    assert sorted(o.name for o in second.added_objects) == ["a", "b"]
    assert len(second.errors) == 1 and "duplicate Service default/b" in str(second.errors[0])
    (tmp_path / "c.yaml").unlink()
    (tmp_path / "d.yaml").write_text("kind: [")
    src._dirty |= {str(tmp_path / "c.yaml"), str(tmp_path / "d.yaml")}
    third = src.snapshot(objects=False)
    assert [o.name for o in third.removed_objects] == ["b"] and third.added_objects == []
    assert len(third.errors) == 1 and str(third.errors[0]).startswith(f"{tmp_path}/d.yaml:")


def test_released_bodies_keep_identity_and_node(tmp_path: Path):
    (tmp_path / "a.yaml").write_text(SVC.format(name="a", ip="10.96.0.1"))
    (tmp_path / "n.yaml").write_text("apiVersion: v1\nkind: Node\nmetadata: {name: node-a, labels: {x: y}}\n")
    src = DirectorySource(str(tmp_path))
    snap = src.snapshot()
    cache = BuildCache()
    before = cache.build(snap.objects, OPTS)
    src.release_bodies()
    svc = next(o for o in snap.objects if o.kind == "Service")
    assert svc.body == {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "a"}}
    assert src.node("node-a") == {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a", "labels": {"x": "y"}}}
    assert cache.build(src.snapshot().objects, OPTS) == before  # the same objects: nothing re-parsed


def test_iptables_renderer_reuses_fragments_and_matches_a_fresh_render():
    from reconciler.backends.iptables.backend import service_view as ipt_view
    from reconciler.backends.iptables.diff import diff as ipt_diff
    from reconciler.backends.iptables.render import Renderer as IptRenderer, render as ipt_render

    objs = {i: svc_objects(i) for i in range(80)}
    cache, renderer = BuildCache(), IptRenderer()
    first = cache.build([o for v in objs.values() for o in v], OPTS)
    before = renderer.render(first)
    objs[7] = svc_objects(7, version=1)
    del objs[8]
    objs[500] = svc_objects(500)
    desired = cache.build([o for v in objs.values() for o in v], OPTS)
    after = renderer.render(desired)
    assert after == ipt_render(desired)
    assert ipt_diff(after, ipt_render(desired)) == []
    changed = {"default/s7:http/TCP", "default/s8:http/TCP", "default/s500:http/TCP"}
    assert ipt_diff(after, before) == ipt_diff(ipt_render(desired), ipt_render(first))  # same plan as without memory
    untouched = "default/s9:http/TCP"
    assert ipt_view(after, {untouched} | changed) == {
        k: v for k, v in ipt_view(after).items() if k in {untouched} | changed}
    assert ipt_view(after, {untouched})[untouched]["endpoints"]  # its DNATs are found by chain name


class DyingChildBackend:
    """observe() kills the process it runs in unless that is the one that made the backend."""

    mode = "fake"
    observe_in = "process"

    def __init__(self) -> None:
        self.parent = os.getpid()

    def observe(self, beside_work: bool = False) -> dict:
        if os.getpid() != self.parent:
            os.kill(os.getpid(), signal.SIGKILL)  # the forked reader dies
        return {"read": "in the parent"}

    def generation(self) -> None:
        return None

    def render(self, desired) -> dict:
        return {}

    def before_diff(self, desired) -> None:
        pass

    def diff(self, want, have) -> list:
        return []

    def service_view(self, model, only=None) -> dict:
        return {}

    def removed_unnamed(self, observed, operations) -> set:  # (every operation names its service port)
        return set()


def test_plan_reads_the_kernel_here_when_the_child_dies(tmp_path: Path, monkeypatch):
    """plan_against_kernel forks a child to read the kernel; if it dies, the read happens in-process."""
    from reconciler import reconcile
    from reconciler.config import Options

    (tmp_path / "a.yaml").write_text(SVC.format(name="a", ip="10.96.0.1"))
    monkeypatch.setattr(reconcile.threading, "active_count", lambda: 1)  # pytest may run threads
    planned = reconcile.plan_against_kernel(DyingChildBackend(), str(tmp_path), Options(node_name="node-a"))
    assert planned.observed_model == {"read": "in the parent"}


class ToldBackend(DyingChildBackend):
    """observe() tells where it ran and what it was told."""

    def observe(self, beside_work: bool = False) -> dict:
        return {"child": os.getpid() != self.parent, "beside_work": beside_work}


@pytest.mark.parametrize("threads", [1, 2], ids=["forked child", "thread"])
def test_plan_reads_the_kernel_as_a_read_beside_the_manifests_loading(tmp_path: Path, monkeypatch, threads):
    from reconciler import reconcile
    from reconciler.config import Options

    (tmp_path / "a.yaml").write_text(SVC.format(name="a", ip="10.96.0.1"))
    monkeypatch.setattr(reconcile.threading, "active_count", lambda: threads)  # 2: a process with threads
    planned = reconcile.plan_against_kernel(ToldBackend(), str(tmp_path), Options(node_name="node-a"))
    assert planned.observed_model == {"child": threads == 1, "beside_work": True}


def test_a_read_beside_work_runs_one_kernel_tool_at_a_time(monkeypatch):
    """nftables: one `nft list table` at a time (see test_nftables for each_table itself);
    iptables: one `<cmd>-save` after the other. Without beside_work: as many as there are."""
    import threading
    import time

    from reconciler.backends.iptables import backend as ipt
    from reconciler.backends.nftables import backend as nft

    told = []
    monkeypatch.setattr(nft, "observe", lambda **kw: told.append(kw) or nft.Ruleset())
    nft.NftablesBackend().observe(beside_work=True)
    nft.NftablesBackend().observe()
    assert told == [{"tools_at_once": 1}, {"tools_at_once": 3}]

    running, most = 0, []
    lock = threading.Lock()

    def read_save(cmd, flavour, parse):
        nonlocal running
        with lock:
            running += 1
        time.sleep(0.05)
        with lock:
            most.append(running)
            running -= 1
        return {}

    monkeypatch.setattr(ipt.kernel, "read_save", read_save)
    ipt.IptablesBackend(flavour="nft").observe(beside_work=True)
    assert max(most) == 1 and len(most) == 2
    most.clear()
    ipt.IptablesBackend(flavour="nft").observe()
    assert max(most) == 2


def test_directory_snapshot_notices_a_removed_folder_but_not_a_renamed_temp_file(tmp_path: Path):
    (tmp_path / "sub" / "deeper").mkdir(parents=True)
    (tmp_path / "sub" / "deeper" / "a.yaml").write_text(SVC.format(name="a", ip="10.96.0.1"))
    (tmp_path / "b.yaml").write_text(SVC.format(name="b", ip="10.96.0.2"))
    src = DirectorySource(str(tmp_path))
    src.snapshot(objects=False)
    # an editor's `b.yaml.tmp`, renamed over b.yaml: only the files named are looked at
    (tmp_path / "b.yaml").write_text(SVC.format(name="b", ip="10.96.0.3"))
    dirty = {str(tmp_path / "b.yaml.tmp"), str(tmp_path / "b.yaml")}
    assert src._only_files(dirty)
    src._dirty |= dirty
    assert [o.name for o in src.snapshot(objects=False).added_objects] == ["b"]
    # a folder that held manifests is gone (its files' own events may never come): walk the tree
    shutil.rmtree(tmp_path / "sub")
    for gone in (tmp_path / "sub", tmp_path / "sub" / "deeper"):
        assert not src._only_files({str(gone)})
    (tmp_path / "sub").write_text("now a file")  # a folder replaced by a file: walk the tree too
    assert not src._only_files({str(tmp_path / "sub")})
    (tmp_path / "sub").unlink()
    src._dirty |= {str(tmp_path / "sub")}
    assert [o.name for o in src.snapshot(objects=False).removed_objects] == ["a"]


def test_bodies_kept_back_are_released_by_a_later_call(tmp_path: Path) -> None:
    """release_bodies(keep=ids): those objects are not built yet (a first start holds a bad
    file's back): their bodies stay until a later call releases them."""
    for name in ("a", "b"):
        (tmp_path / f"{name}.yaml").write_text(
            f"apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: default}}\n"
            "spec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}\n")
    src = DirectorySource(str(tmp_path))
    a, b = sorted(src.snapshot().objects, key=lambda o: o.name)
    src.release_bodies(keep={id(b)})
    assert "spec" not in a.body and "spec" in b.body
    src.release_bodies()
    assert "spec" not in b.body


def shared_address_objects(i: int, version: int, endpoints: int) -> list:
    """Service s<i>: its own ClusterIP, the externalIP 192.0.2.77 and LB IP 192.0.2.88 on port 80
    that every such service claims (the API server allows that), `endpoints` ready endpoints,
    source ranges that overlap another's (10.0.0.0/8, or its own 10.<i>.0.0/16)."""
    eps = [endpoint(f"10.244.{i}.{k + 1 + version}") for k in range(endpoints)]
    lb = {"status": {"loadBalancer": {"ingress": [{"ip": "192.0.2.88"}]}}}
    svc = service(f"s{i}", f"10.96.0.{i + 1}", HTTP, type="LoadBalancer", externalIPs=["192.0.2.77"],
                  externalTrafficPolicy="Local" if version % 2 else "Cluster",
                  loadBalancerSourceRanges=[f"10.{i}.0.0/16"] if version % 3 else ["10.0.0.0/8"])
    svc.body.update(lb)
    return [svc, endpoint_slice(f"s{i}", eps)]


def test_addresses_several_services_claim_are_rendered_the_same_whatever_came_and_went():
    """Two Services on one externalIP (or LB IP) and port: the element that address gets is the
    same after any sequence of renders as from scratch, the first claimant's by id, in its own
    shard only (a later render used to delete the element when one claimant went, leaving the
    other's address unserved until a restart)."""
    ids = range(6)  # (their shards differ: see the assert below)
    assert len({shard_of(f"default/s{i}:http/TCP") for i in ids}) > 1
    rng = random.Random(11)
    current: dict[int, list] = {}
    renderer, cache = Renderer(), BuildCache()
    for step in range(40):
        i = rng.choice(ids)
        if i in current and rng.random() < 0.4:
            del current[i]
        else:
            current[i] = shared_address_objects(i, step, endpoints=rng.choice((0, 1, 2)))
        desired = cache.build([o for objs in current.values() for o in objs], OPTS)
        got, fresh = renderer.render(desired), render(desired)
        assert diff(got, fresh) == [], f"step {step}: {sorted(current)}"
        for ip in ("192.0.2.77", "192.0.2.88"):
            key = f"{ip} . tcp . 80"
            holders = {ref: table.sets["service-ips"].elements[key] for ref, table in got.tables.items()
                       if "service-ips" in table.sets and key in table.sets["service-ips"].elements}
            served = sorted(f"default/s{i}:http/TCP" for i in current if current[i][1].body["endpoints"])
            assert len(holders) == (1 if served else 0), holders
            if served:
                (ref, (verdict, tag)), = holders.items()
                assert tag == served[0] and ref.endswith(f"-{shard_of(served[0]):02d}")
                # iptables mode: the first rule for that address is the same service port's
                rules = iptables_render(desired).families["ipv4"]["nat"].chains["RECONCILER-SERVICES"]
                first = next(r for r in rules if f"{ip}/32" in r.args)
                assert first.args[first.args.index("--comment") + 1] == served[0]
        # the LB IP's source ranges: those of the first of its Services alone (both sets would
        # overlap, which nft refuses), as iptables mode's first rule sends it to that one's
        allowed = {k.rsplit(" . ", 1)[1] for k in got.tables["ip reconciler"].sets["firewall-allow"].elements} \
            if current else set()
        if current:
            first_svc = min(current)
            ranges = current[first_svc][0].body["spec"]["loadBalancerSourceRanges"]
            assert allowed == set(ranges), f"step {step}"
