"""iptables: a long shared chain (RECONCILER-SERVICES with dozens of services) is edited in place
with -D/-I by the real iptables-restore, and the result is what was planned (apply, asked to
verify by reading the kernel back, and a plan afterwards find nothing left) and still carries
traffic."""

from __future__ import annotations

import re

import pytest

from benchmark_log import tool_seconds
from manifests import common_flags, eps, reconciler, svc, write_state
from traffic import outcomes

pytestmark = pytest.mark.e2e

HTTP = [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}]


def docs(indices) -> list[dict]:
    out = []
    for i in indices:
        out += [svc(f"s{i}", [f"10.96.7.{i + 1}"], HTTP), eps(f"s{i}", ["pod1"])]
    return out


def test_long_chain_edited_in_place_then_verified(lab, tmp_path):
    src = str(tmp_path / "state")
    write_state(src, docs(range(40)))
    try:
        reconciler(lab, "apply", *common_flags(src, "iptables"))
        write_state(src, docs([i for i in range(41) if i != 17]))  # one service goes, one comes
        proc = reconciler(lab, "apply", *common_flags(src, "iptables"), "-v", "--read-back")
        assert "Verified by reading the kernel back." in proc.stdout
        out = proc.stdout
        assert tool_seconds(proc.stderr.splitlines()) > 0  # restore's own time, as the benchmark reads it
        assert "-D RECONCILER-SERVICES -d 10.96.7.18/32" in out
        assert re.search(r"-I RECONCILER-SERVICES \d+ -d 10\.96\.7\.41/32", out)
        assert ":RECONCILER-SERVICES - [0:0]" not in out  # not rewritten
        again = reconciler(lab, "plan", *common_flags(src, "iptables"), check=False)
        assert again.returncode == 0, again.stdout
        assert outcomes(lab.tcp("node", "10.96.7.41", 80, count=3)) == {"ok": 3}
        assert outcomes(lab.tcp("node", "10.96.7.18", 80, count=1, timeout=1)) != {"ok": 1}
    finally:
        reconciler(lab, "cleanup", "--mode", "iptables", check=False)


@pytest.mark.parametrize("mode", ["iptables", "nftables"])
def test_cidrs_of_every_address_read_back_as_written(lab, tmp_path, mode):
    """A source range of every address (0.0.0.0/0, ::/0: a chart's "allow all") and a cluster
    CIDR of every address: iptables-save prints no `-s 0.0.0.0/0`, and iptables refuses
    `! -s 0.0.0.0/0`; the rules are written as they read back, so apply succeeds and a plan then
    finds nothing to do (it found the firewall chain changed for ever), and the LB IP carries
    traffic from any source. Cluster CIDRs one inside another are merged (an nftables interval
    set refused them: nothing was programmed)."""
    src = str(tmp_path / "state")
    lb = {"loadBalancer": {"ingress": [{"ip": "172.30.1.17"}, {"ip": "fd00:31::17"}]}}
    write_state(src, [svc("any", ["10.96.7.100", "fd00:96::7:100"], HTTP, type="LoadBalancer", status=lb,
                          ipFamilies=["IPv4", "IPv6"], loadBalancerSourceRanges=["0.0.0.0/0", "::/0"]),
                      eps("any", ["pod1"]), eps("any", ["pod1"], 6)])
    try:
        for cluster in ([], ["--cluster-cidr", "0.0.0.0/0,::/0"],
                        ["--cluster-cidr", "10.0.0.0/8,10.244.0.0/16,fd00::/8,fd00:244::/32"]):
            flags = common_flags(src, mode, extra=cluster)
            reconciler(lab, "apply", *flags, "--read-back")
            again = reconciler(lab, "plan", *flags, check=False)
            assert again.returncode == 0, again.stdout
            for ip in ("172.30.1.17", "fd00:31::17"):
                res = lab.tcp("ext1", ip, 80, count=3)
                assert outcomes(res) == {"ok": 3}
                assert {r.seen_ip for r in res} <= {"172.30.0.2", "fd00:30::2"}  # (policy Cluster: masqueraded)
    finally:
        reconciler(lab, "cleanup", "--mode", mode, check=False)
