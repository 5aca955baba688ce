"""Stale UDP conntrack cleanup with real flows (reconciler/conntrack.py), in both modes.

A client keeps its UDP source port, so its conntrack entry decides where its datagrams go. The
node counts each entry's packets (nf_conntrack_acct): an entry whose count goes on is the one that
was there, never deleted. pod1 and pod2 run on node-a (the node under test), pod3 on node-b;
their servers answer on UDP 8080 with their name.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from lab import ADDR, Lab
from labcmd import ns_argv
from manifests import Applied, common_flags, eps, reconciler, svc, write_state
from traffic import concurrently, outcomes, servers

pytestmark = pytest.mark.e2e

EXTRA = ["--service-cidr", "10.96.0.0/16,fd00:96::/64"]
TERMINATING = {"ready": False, "serving": True, "terminating": True}
NODE_IP = ADDR["node"][4]
AGENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conntrack_agent.py")

FLOWS = r"""
import json, socket, sys
from pyroute2.netlink.nfnetlink.nfctsocket import NFCTSocket
out = []
for af, v in ((socket.AF_INET, "V4"), (socket.AF_INET6, "V6")):
    with NFCTSocket(nfgen_family=af) as ct:
        for m in ct.dump():
            o, r = m.get_attr("CTA_TUPLE_ORIG"), m.get_attr("CTA_TUPLE_REPLY")
            op, rp = o.get_attr("CTA_TUPLE_PROTO"), r.get_attr("CTA_TUPLE_PROTO")
            if op.get_attr("CTA_PROTO_NUM") != 17 or op.get_attr("CTA_PROTO_SRC_PORT") != int(sys.argv[1]):
                continue
            counters = m.get_attr("CTA_COUNTERS_ORIG")
            out.append({"dst": o.get_attr("CTA_TUPLE_IP").get_attr(f"CTA_IP_{v}_DST"),
                        "reply_src": r.get_attr("CTA_TUPLE_IP").get_attr(f"CTA_IP_{v}_SRC"),
                        "reply_sport": rp.get_attr("CTA_PROTO_SRC_PORT"),
                        "packets": counters.get_attr("CTA_COUNTERS_PACKETS") if counters else None})
print(json.dumps(out))
"""


def dns(name: str, ips: list[str], **spec: Any) -> dict:
    ports = [{"name": "dns", "port": 53, "targetPort": 8080, "protocol": "UDP"}]
    if "nodePort" in spec:
        ports[0]["nodePort"] = spec.pop("nodePort")
    return svc(name, ips, ports, **spec)


def dns_eps(name: str, pods: list[str], family: int = 4, conditions: dict[str, dict[str, bool]] | None = None) -> dict:
    return eps(name, pods, family, ports=(("dns", 8080, "UDP"),), conditions=conditions)


def flows(lab: Lab, sport: int) -> list[dict[str, Any]]:
    """The node's UDP conntrack entries from source port `sport`."""
    return json.loads(lab.exec("node", [sys.executable, "-c", FLOWS, str(sport)]).stdout)


def packets(lab: Lab, sport: int) -> int:
    """The packets of the one entry from `sport` (fails when it was deleted)."""
    entries = flows(lab, sport)
    assert len(entries) == 1, f"one conntrack entry from port {sport} expected: {entries}"
    return entries[0]["packets"]


@pytest.fixture(scope="module", params=["nftables", "iptables"])
def state(lab: Lab, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Applied]:
    # (a fresh kernel may not have loaded nf_conntrack yet: its sysctls appear with it)
    if shutil.which("modprobe"):
        subprocess.run(["modprobe", "nf_conntrack"], capture_output=True, timeout=20, check=False)
    lab.sysctl("node", "net.netfilter.nf_conntrack_acct", 1)  # entries count their packets from now on
    # the other mode's run left UDP flows to the same service IPs: a new flow whose random source
    # port met one of them would follow it, not the rules under test
    lab.exec("node", ["conntrack", "-F"], check=False)
    yield Applied(str(tmp_path_factory.mktemp("conntrack")), request.param)
    reconciler(lab, "cleanup", "--mode", request.param, check=False)


def ports(state: Applied, test: int) -> int:
    """The first of the client source ports 0..9 of one test in one mode: below the ephemeral
    range, so that no other probe's entry has them."""
    return (21000 if state.mode == "nftables" else 22000) + 10 * test


def put(lab: Lab, state: Applied, docs: list[dict]) -> None:
    write_state(state.source, docs)
    reconciler(lab, "apply", *common_flags(state.source, state.mode, extra=EXTRA))


def test_a_terminating_endpoint_keeps_its_flows_while_it_serves(lab: Lab, state: Applied) -> None:
    """(a) The endpoint a flow went to starts terminating, still serving: new flows go to the other
    one, this flow goes on (the same entry). Once the endpoint is gone its flow is deleted, though
    the rules do not change then, and the client follows to the other endpoint."""
    ip, port = "10.96.7.10", ports(state, 0)
    put(lab, state, [dns("term", [ip]), dns_eps("term", ["pod1", "pod3"])])
    first = lab.udp("pod2", ip, 53, count=3, source_port=port)
    assert outcomes(first) == {"ok": 3}
    (chosen,) = servers(first)
    other = "pod3" if chosen == "pod1" else "pod1"
    put(lab, state, [dns("term", [ip]), dns_eps("term", ["pod1", "pod3"], conditions={chosen: TERMINATING})])
    assert set(servers(lab.udp("pod2", ip, 53, count=4))) == {other}  # new flows: the ready endpoint only
    assert set(servers(lab.udp("pod2", ip, 53, source_port=port))) == {chosen}
    assert packets(lab, port) == 4
    put(lab, state, [dns("term", [ip]), dns_eps("term", [other])])
    assert set(servers(lab.udp("pod2", ip, 53, count=2, source_port=port))) == {other}


def test_flows_to_a_pod_through_another_service_stay_when_one_service_leaves_it(
        lab: Lab, state: Applied) -> None:
    """(b) Services a and b both use pod1; a moves to pod3. The flow through b and direct traffic
    to pod1 go on (the same entries); only a's flow is deleted, and its client reaches pod3."""
    a, b, port = "10.96.7.20", "10.96.7.21", ports(state, 1)

    def docs(a_pod: str) -> list[dict]:
        return [dns("svc-a", [a]), dns_eps("svc-a", [a_pod]), dns("svc-b", [b]), dns_eps("svc-b", ["pod1"])]

    put(lab, state, docs("pod1"))
    via_a, via_b, direct = port, port + 1, port + 2
    for ip, p, sport in ((a, 53, via_a), (b, 53, via_b), (ADDR["pod1"][4], 8080, direct)):
        assert set(servers(lab.udp("pod2", ip, p, count=2, source_port=sport))) == {"pod1"}
    put(lab, state, docs("pod3"))
    assert [f["packets"] for f in flows(lab, via_b) + flows(lab, direct)] == [2, 2]
    assert flows(lab, via_a) == []
    assert set(servers(lab.udp("pod2", b, 53, source_port=via_b))) == {"pod1"}
    assert set(servers(lab.udp("pod2", a, 53, count=2, source_port=via_a))) == {"pod3"}


def test_flows_of_a_removed_endpoint_are_deleted_on_every_frontend(lab: Lab, state: Applied) -> None:
    """(c) A dual-stack NodePort service with an externalIP: its endpoint moves from pod1 to pod3,
    and each client (ClusterIPs, externalIP, NodePort from outside) keeps its source port and
    reaches pod3; then it has no endpoints (each is refused), then it is deleted (not answered)."""
    v4, v6, xip, port = "10.96.7.30", "fd00:96::7:30", "172.30.1.70", ports(state, 2)
    spec = {"type": "NodePort", "nodePort": 30753, "externalIPs": [xip], "ipFamilies": ["IPv4", "IPv6"],
            "ipFamilyPolicy": "RequireDualStack"}

    def docs(*pods: str) -> list[dict]:
        slices = [dns_eps("dual", list(pods)), dns_eps("dual", list(pods), family=6)] if pods else []
        return [dns("dual", [v4, v6], **spec), *slices]

    clients = [("pod2", v4, 53), ("pod2", v6, 53), ("pod2", xip, 53), ("ext1", NODE_IP, 30753)]

    def probe(count: int = 2) -> list[Any]:
        return concurrently([lambda c=c, i=i: lab.udp(c[0], c[1], c[2], count=count, source_port=port + i)
                             for i, c in enumerate(clients)])

    put(lab, state, docs("pod1"))
    assert [set(servers(r)) for r in probe()] == [{"pod1"}] * 4
    put(lab, state, docs("pod3"))
    assert [set(servers(r)) for r in probe()] == [{"pod3"}] * 4
    put(lab, state, docs())  # no endpoints: refused, as the rules say, not sent on to pod3
    assert [outcomes(r) for r in probe(1)] == [{"refused": 1}] * 4
    put(lab, state, docs("pod3"))
    assert [set(servers(r)) for r in probe()] == [{"pod3"}] * 4
    put(lab, state, [])  # deleted: no rule answers (an unallocated ClusterIP is dropped)
    assert all(outcomes(r)["ok"] == 0 for r in probe(1))


def test_a_frontend_a_udp_service_loses_has_its_flows_deleted_by_apply(lab: Lab, state: Applied) -> None:
    """(d) A UDP service keeps its ClusterIP but loses its externalIP and its nodePort: `apply` (a
    process that never saw them as frontends) deletes the flows to those, which went on to pod1
    past the rules (only the run loop, which saw them, did); the ClusterIP's flow goes on."""
    ip, xip, port = "10.96.7.36", "172.30.1.72", ports(state, 7)
    before = [dns("lose", [ip], type="NodePort", nodePort=30756, externalIPs=[xip]), dns_eps("lose", ["pod1"])]
    clients = [("pod2", ip, 53), ("ext1", xip, 53), ("ext1", NODE_IP, 30756)]
    put(lab, state, before)
    for i, (host, addr, p) in enumerate(clients):
        assert set(servers(lab.udp(host, addr, p, count=2, source_port=port + i))) == {"pod1"}
    put(lab, state, [dns("lose", [ip]), dns_eps("lose", ["pod1"])])
    assert packets(lab, port) == 2 and flows(lab, port + 1) == [] and flows(lab, port + 2) == []
    assert set(servers(lab.udp("pod2", ip, 53, source_port=port))) == {"pod1"}
    assert all(outcomes(lab.udp(h, a, p, count=1, timeout=1.0, source_port=port + i))["ok"] == 0
               for i, (h, a, p) in enumerate(clients) if i)


def test_healthy_flows_go_on_through_a_mode_switch(lab: Lab, state: Applied) -> None:
    """A switch of mode is a cold start (every rule of the new mode is new): the flows of a
    ClusterIP and of a NodePort whose endpoint serves go on, the same entries, there and back."""
    ip, port = "10.96.7.60", ports(state, 5)
    write_state(state.source, [dns("steady", [ip], type="NodePort", nodePort=30760), dns_eps("steady", ["pod1"])])
    other = "iptables" if state.mode == "nftables" else "nftables"
    reconciler(lab, "apply", *common_flags(state.source, state.mode, extra=EXTRA))
    assert set(servers(lab.udp("pod2", ip, 53, count=2, source_port=port))) == {"pod1"}
    assert set(servers(lab.udp("ext1", NODE_IP, 30760, count=2, source_port=port + 1))) == {"pod1"}
    for mode in (other, state.mode):
        reconciler(lab, "apply", *common_flags(state.source, mode, extra=EXTRA))
        assert (packets(lab, port), packets(lab, port + 1)) == (2, 2)
    assert set(servers(lab.udp("pod2", ip, 53, source_port=port))) == {"pod1"} and packets(lab, port) == 3


def test_the_next_process_deletes_what_a_cleanup_that_could_not_run_left(lab: Lab, state: Applied) -> None:
    """An apply that moved the endpoint could not reach conntrack: the client stays on pod1. The
    next `reconciler apply` has no rule to change, but its first cleanup deletes the flow."""
    ip, port = "10.96.7.40", ports(state, 3)
    put(lab, state, [dns("lost", [ip]), dns_eps("lost", ["pod1"])])
    assert set(servers(lab.udp("pod2", ip, 53, count=2, source_port=port))) == {"pod1"}
    write_state(state.source, [dns("lost", [ip]), dns_eps("lost", ["pod3"])])
    flags = common_flags(state.source, state.mode, extra=EXTRA)
    lab.exec("node", [sys.executable, AGENT, "apply", *flags], timeout=60)
    assert set(servers(lab.udp("pod2", ip, 53, source_port=port))) == {"pod1"}  # stale: nothing deleted
    assert reconciler(lab, "plan", *flags, check=False).returncode == 0  # the rules are right
    reconciler(lab, "apply", *flags)
    assert set(servers(lab.udp("pod2", ip, 53, count=2, source_port=port))) == {"pod3"}


class RunLoop:
    """conntrack_agent.py's run loop in the node namespace: one full sync per sync() call."""

    def __init__(self, lab: Lab, state: Applied) -> None:
        self.proc = subprocess.Popen(ns_argv(lab.node, [sys.executable, AGENT, "daemon", state.source, state.mode]),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def sync(self, how: str = "available") -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(how + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], 60)
        line = self.proc.stdout.readline() if ready else ""
        assert line, f"no report from the run loop: {self.proc.stderr.read() if self.proc.poll() is not None else ''}"
        return json.loads(line)

    def close(self) -> None:
        self.proc.kill()
        self.proc.communicate(timeout=10)


def test_the_run_loops_targeted_pass_moves_a_client_and_frees_one_that_came_early(
        lab: Lab, state: Applied) -> None:
    """After its first (full) pass the run loop reads only the frontends a change touched, with the
    real tool: a ClusterIP client follows its endpoint from pod1 to pod3, and a client that sent to
    a NodePort before it existed (its entry answers from the node itself) reaches the new
    service's pod1 with the same source port."""
    ip, node_port, port = "10.96.7.80", 30780, ports(state, 6)
    write_state(state.source, [dns("moving", [ip]), dns_eps("moving", ["pod1"])])
    loop = RunLoop(lab, state)
    try:
        assert loop.sync()["ok"]
        assert set(servers(lab.udp("pod2", ip, 53, count=2, source_port=port))) == {"pod1"}
        assert outcomes(lab.udp("ext1", NODE_IP, node_port, source_port=port + 1))["ok"] == 0
        assert [f["reply_src"] for f in flows(lab, port + 1)] == [NODE_IP]  # an entry to the node itself
        write_state(state.source, [dns("moving", [ip]), dns_eps("moving", ["pod3"]),
                                   dns("late", ["10.96.7.81"], type="NodePort", nodePort=node_port),
                                   dns_eps("late", ["pod1"])])
        second = loop.sync()
        assert second["ok"] and second["operations"] > 0
        assert set(servers(lab.udp("pod2", ip, 53, count=2, source_port=port))) == {"pod3"}
        assert set(servers(lab.udp("ext1", NODE_IP, node_port, count=2, source_port=port + 1))) == {"pod1"}
    finally:
        loop.close()


def test_the_run_loop_retries_a_failed_cleanup_on_a_sync_with_nothing_to_apply(
        lab: Lab, state: Applied) -> None:
    """(d) The run loop's sync that moved the endpoint could not reach conntrack; its next sync
    finds no rule to change, retries the cleanup, and the client reaches pod3."""
    ip, port = "10.96.7.50", ports(state, 4)
    put(lab, state, [dns("retry", [ip]), dns_eps("retry", ["pod1"])])
    assert set(servers(lab.udp("pod2", ip, 53, count=2, source_port=port))) == {"pod1"}
    write_state(state.source, [dns("retry", [ip]), dns_eps("retry", ["pod3"])])
    loop = RunLoop(lab, state)
    try:
        first = loop.sync("unavailable")
        assert first["ok"] and first["operations"] > 0
        assert set(servers(lab.udp("pod2", ip, 53, source_port=port))) == {"pod1"}  # stale: nothing deleted
        second = loop.sync("available")
        assert second["ok"] and second["operations"] == 0
        assert set(servers(lab.udp("pod2", ip, 53, count=2, source_port=port))) == {"pod3"}
    finally:
        loop.close()
