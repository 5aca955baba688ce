"""The conntrack sysctls `run` sets at start, as kube-proxy's setSysctls: the values (pure), and the
writes against a directory standing in for /proc/sys/net/netfilter."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from reconciler import conntrack_sysctls as cs
from reconciler.config import Options

TCP = {"nf_conntrack_tcp_timeout_established": 86400, "nf_conntrack_tcp_timeout_close_wait": 3600}


def values(opts: Options, cpus: int) -> dict[str, int]:
    return {s.name: s.value for s in cs.wanted(opts, cpus)}


@pytest.mark.parametrize("per_core,minimum,cpus,expected", [
    (32768, 131072, 2, 131072),  # the defaults on a small node: the floor
    (32768, 131072, 8, 262144),  # per core x CPUs above the floor
    (32768, 131072, 64, 1048576),  # 2097152 capped
    (32768, 2000000, 4, 2000000),  # a floor above the cap is kept...
    (32768, 2000000, 40, 1048576),  # ...unless the scaled value was capped (kube-proxy checks the cap first)
    (0, 131072, 8, 0),  # maxPerCore 0: leave nf_conntrack_max alone, min ignored
    (1, 0, 3, 3),
])
def test_conntrack_max(per_core: int, minimum: int, cpus: int, expected: int) -> None:
    assert cs.conntrack_max(per_core, minimum, cpus) == expected


def test_defaults_are_kube_proxys() -> None:
    assert values(Options(), 2) == {"nf_conntrack_max": 131072, "nf_conntrack_buckets": 32768, **TCP}
    assert values(Options(), 16) == {"nf_conntrack_max": 524288, "nf_conntrack_buckets": 131072, **TCP}


def test_zero_leaves_values_alone_and_the_rest_is_set_in_whole_seconds() -> None:
    opts = Options(conntrack_max_per_core=0, conntrack_tcp_timeout_established=0, conntrack_tcp_timeout_close_wait=0)
    assert cs.wanted(opts, 8) == []
    opts = Options(conntrack_tcp_timeout_established=7200.9, conntrack_tcp_be_liberal=True,
                   conntrack_udp_timeout=0.5, conntrack_udp_timeout_stream=180)
    assert [(s.name, s.value) for s in cs.wanted(opts, 2)][2:] == [
        ("nf_conntrack_tcp_timeout_established", 7200), ("nf_conntrack_tcp_timeout_close_wait", 3600),
        ("nf_conntrack_tcp_be_liberal", 1),
        ("nf_conntrack_udp_timeout", 0),  # 500ms: kube-proxy writes int(d / time.Second) (the config warns)
        ("nf_conntrack_udp_timeout_stream", 180)]


@pytest.mark.parametrize("raise_only,current,write", [
    (False, 432000, True), (False, 86400, False), (False, 100, True), (False, None, True),
    (True, 65536, True), (True, 131072, False), (True, 262144, False), (True, None, True),
])
def test_written_only_when_different_and_the_table_size_only_when_smaller(
        raise_only: bool, current: int | None, write: bool) -> None:
    assert cs.Sysctl("x", 86400 if not raise_only else 131072, "k", raise_only).needs_write(current) is write


# ------------------------------------------------------------------------------------ writes


def netfilter(tmp_path: Path, **current: int) -> Path:
    d = tmp_path / "netfilter"
    d.mkdir()
    for name, value in current.items():
        (d / name).write_text(f"{value}\n")
    return d


HOST = {"nf_conntrack_max": 262144, "nf_conntrack_buckets": 262144, "nf_conntrack_tcp_timeout_established": 432000,
        "nf_conntrack_tcp_timeout_close_wait": 60, "nf_conntrack_tcp_be_liberal": 0, "nf_conntrack_udp_timeout": 30,
        "nf_conntrack_udp_timeout_stream": 120}


def read(d: Path) -> dict[str, int]:
    return {p.name: int(p.read_text()) for p in d.iterdir()}


def test_tune_writes_what_differs_and_logs_it_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    d = netfilter(tmp_path, **HOST)
    monkeypatch.setattr(cs, "node_cpus", lambda: 32)
    opts = Options(conntrack_sysctl_dir=str(d), conntrack_udp_timeout=45, conntrack_udp_timeout_stream=120)
    with caplog.at_level("INFO"):
        assert cs.tune(opts) is True
    assert read(d) == {**HOST, "nf_conntrack_max": 1048576, "nf_conntrack_tcp_timeout_established": 86400,
                       "nf_conntrack_tcp_timeout_close_wait": 3600, "nf_conntrack_udp_timeout": 45}
    assert [r.getMessage() for r in caplog.records] == [
        "conntrack sysctls set: net.netfilter.nf_conntrack_max=1048576, "
        "net.netfilter.nf_conntrack_tcp_timeout_established=86400, "
        "net.netfilter.nf_conntrack_tcp_timeout_close_wait=3600, net.netfilter.nf_conntrack_udp_timeout=45"]
    caplog.clear()
    mtimes = {p.name: p.stat().st_mtime_ns for p in d.iterdir()}
    with caplog.at_level("INFO"):
        cs.tune(opts)  # all as configured: nothing written, nothing said
    assert caplog.records == [] and {p.name: p.stat().st_mtime_ns for p in d.iterdir()} == mtimes


def test_a_larger_table_is_left_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = netfilter(tmp_path, **{**HOST, "nf_conntrack_max": 2000000, "nf_conntrack_buckets": 16384})
    monkeypatch.setattr(cs, "node_cpus", lambda: 2)
    cs.tune(Options(conntrack_sysctl_dir=str(d)))
    assert read(d)["nf_conntrack_max"] == 2000000
    assert read(d)["nf_conntrack_buckets"] == 32768  # (131072 / 4: raised on its own, as kube-proxy's hashsize)


def test_a_write_that_fails_is_a_warning_and_the_others_are_still_set(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    d = netfilter(tmp_path, **HOST)
    monkeypatch.setattr(cs, "node_cpus", lambda: 64)
    real_write = cs._write

    def write(directory: str, name: str, value: int) -> None:
        if name in ("nf_conntrack_max", "nf_conntrack_tcp_be_liberal"):  # as in a non-initial namespace
            raise PermissionError(errno.EACCES, "Permission denied", f"{directory}/{name}")
        real_write(directory, name, value)

    monkeypatch.setattr(cs, "_write", write)
    with caplog.at_level("INFO"):
        assert cs.tune(Options(conntrack_sysctl_dir=str(d), conntrack_tcp_be_liberal=True)) is True
    assert read(d)["nf_conntrack_max"] == 262144
    assert read(d)["nf_conntrack_tcp_timeout_established"] == 86400
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        f"cannot set net.netfilter.nf_conntrack_max to 1048576 (it is 262144): [Errno 13] Permission denied: "
        f"'{d}/nf_conntrack_max'; proxying goes on without it (conntrack.maxPerCore: 0 leaves it alone)",
        f"cannot set net.netfilter.nf_conntrack_tcp_be_liberal to 1 (it is 0): [Errno 13] Permission denied: "
        f"'{d}/nf_conntrack_tcp_be_liberal'; proxying goes on without it (conntrack.tcpBeLiberal: false leaves "
        f"it alone)"]
    assert caplog.records[-1].getMessage() == (  # what was set, only
        "conntrack sysctls set: net.netfilter.nf_conntrack_tcp_timeout_established=86400, "
        "net.netfilter.nf_conntrack_tcp_timeout_close_wait=3600")


def test_not_loaded_is_retried_later_once_then_warned(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    d = netfilter(tmp_path)  # no nf_conntrack_* yet
    opts = Options(conntrack_sysctl_dir=str(d))
    with caplog.at_level("INFO"):
        assert cs.tune(opts, retry_later=True) is False
        assert cs.tune(opts) is True
    assert read(d) == {}
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", "conntrack sysctls: nf_conntrack is not loaded yet; they are set after the first sync"),
        ("WARNING", f"conntrack sysctls not set: nf_conntrack is not loaded (no {d}/nf_conntrack_max)")]
    caplog.clear()
    # a directory that is not there at all (--conntrack-sysctl-dir naming a mount the pod lacks)
    with caplog.at_level("INFO"):
        assert cs.tune(Options(conntrack_sysctl_dir=str(tmp_path / "missing"))) is True
    assert caplog.records[-1].getMessage() == (f"conntrack sysctls not set: no directory {tmp_path / 'missing'} "
                                               "(netfilter's sysctls not loaded, or the directory not mounted)")
    caplog.clear()
    opts = Options(conntrack_sysctl_dir=str(d), conntrack_max_per_core=0, conntrack_tcp_timeout_established=0,
                   conntrack_tcp_timeout_close_wait=0)
    with caplog.at_level("INFO"):
        assert cs.tune(opts, retry_later=True) is True  # nothing asked for: nothing to wait for
    assert caplog.records == []

