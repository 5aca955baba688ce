"""The canonical document: skipping, joining, verdicts (REJECT vs DROP), policies, determinism."""

from __future__ import annotations

import json
import os
import random
import shutil

from helpers import HTTP, STATE_DIR, build, endpoint, endpoint_slice, node, service

from reconciler.desired import BuildOptions, build_desired_state
from reconciler.sources.manifests import load_directory


def only(state, sid):
    return state.by_id()[sid]


def test_skips_like_kube_proxy():
    objs = [
        service("headless", "None", HTTP),
        service("ext", "", HTTP, type="ExternalName", externalName="x.example"),
        service("other", "10.96.0.3", HTTP),
        service("ok", "10.96.0.4", HTTP),
    ]
    objs[2].body["metadata"]["labels"] = {"service.kubernetes.io/service-proxy-name": "someone-else"}
    state = build(objs)
    assert [s.id for s in state.services] == ["default/ok:http/TCP"]
    # kube-proxy selects on the labels' absence: an empty value skips too, and so does `headless`
    for label in ("service.kubernetes.io/service-proxy-name", "service.kubernetes.io/headless"):
        svc, sl = service("web", "10.96.0.5", HTTP), endpoint_slice("web", [endpoint("10.244.1.5")])
        sl.body["metadata"]["labels"][label] = ""
        assert only(build([svc, sl]), "default/web:http/TCP").family("ipv4").internal.verdict == "reject", label
        svc.body["metadata"]["labels"] = {label: ""}
        assert build([svc, sl]).services == (), label


def test_nodeport_addresses_per_family_as_kube_proxy_reads_them():
    objs = [service("web", "10.96.0.1", HTTP)]
    fams = lambda cidrs: {f: o.nodePortCIDRs for f, o in build(objs, nodeport_cidrs=cidrs).families.items()}
    assert fams(None) == {"ipv4": None, "ipv6": None}  # every local address
    assert fams(("192.168.1.0/24",)) == {"ipv4": ("192.168.1.0/24",), "ipv6": None}  # none named: all
    assert fams(("0.0.0.0/0", "192.168.1.0/24", "fd00::/64")) == {"ipv4": None, "ipv6": ("fd00::/64",)}
    # loopback is never a NodePort address (as kube-proxy's nftables mode): only loopback, none
    assert fams(("127.0.0.0/8", "192.168.1.0/24", "::1/128")) == {"ipv4": ("192.168.1.0/24",), "ipv6": ()}
    # kept collapsed, as the kernel holds them; CIDRs that cover everything are every address;
    # a CIDR holding loopback stays whole (the renderers leave loopback out of it)
    assert fams(("10.0.0.0/9", "10.128.0.0/9", "10.1.0.0/16", "fd00::/64"))["ipv4"] == ("10.0.0.0/8",)
    assert fams(("0.0.0.0/1", "128.0.0.0/1"))["ipv4"] is None
    state = build(objs, nodeport_cidrs=("0.0.0.0/1", "fd00::/64"))
    assert state.families["ipv4"].nodePortCIDRs == ("0.0.0.0/1",)
    assert state.families["ipv4"].nodePortsHoldLoopback and not state.families["ipv6"].nodePortsHoldLoopback
    assert build(objs, nodeport_cidrs=("::/8",)).families["ipv6"].nodePortsHoldLoopback


def test_nodeport_addresses_primary_are_the_nodes_ips():
    """As kube-proxy's server.go: [primary] is this node's IP of each family (its Node's first
    InternalIP, else ExternalIP) as a /32 or /128; a family without one (or a loopback one) serves
    on every local address; with no Node IP at all, every address does, with a warning."""
    n = node()
    n.body["status"] = {"addresses": [{"type": "ExternalIP", "address": "203.0.113.7"},
                                      {"type": "InternalIP", "address": "fd00:30::2"},
                                      {"type": "InternalIP", "address": "172.30.0.2"}]}
    objs = [service("web", "10.96.0.1", HTTP), n]
    state = build(objs, nodeport_cidrs=("primary",))
    assert {f: o.nodePortCIDRs for f, o in state.families.items()} == {"ipv4": ("172.30.0.2/32",),
                                                                        "ipv6": ("fd00:30::2/128",)}
    assert not state.warnings
    n.body["status"] = {"addresses": [{"type": "ExternalIP", "address": "203.0.113.7"},
                                      {"type": "InternalIP", "address": "::1"}]}
    state = build(objs, nodeport_cidrs=("primary",))
    assert {f: o.nodePortCIDRs for f, o in state.families.items()} == {"ipv4": ("203.0.113.7/32",), "ipv6": None}
    state = build(objs[:1], nodeport_cidrs=("primary",))  # no Node object
    assert {f: o.nodePortCIDRs for f, o in state.families.items()} == {"ipv4": None, "ipv6": None}
    assert state.warnings == ("nodePortAddresses primary: no IP of Node 'node-a' is known (no Node object with an "
                              "InternalIP or ExternalIP, no bindAddress): NodePorts answer on every local address",)


def test_bind_address_is_this_nodes_ip_of_its_family():
    """As kube-proxy's detectNodeIPs: bindAddress (node_ip_override) is the node IP of its family,
    over the Node's; the other family keeps the Node's. It stands without a Node object too."""
    n = node()
    n.body["status"] = {"addresses": [{"type": "InternalIP", "address": "172.30.0.2"},
                                      {"type": "InternalIP", "address": "fd00:30::2"}]}
    objs = [service("web", "10.96.0.1", HTTP), n]
    state = build(objs, nodeport_cidrs=("primary",), node_ip_override="172.30.0.9")
    assert state.node.addresses == ("172.30.0.9", "fd00:30::2")
    assert {f: o.nodePortCIDRs for f, o in state.families.items()} == {"ipv4": ("172.30.0.9/32",),
                                                                        "ipv6": ("fd00:30::2/128",)}
    state = build(objs[:1], nodeport_cidrs=("primary",), node_ip_override="fd00:30::9")  # no Node object
    assert state.node.addresses == ("fd00:30::9",) and not state.warnings
    assert {f: o.nodePortCIDRs for f, o in state.families.items()} == {"ipv4": None, "ipv6": ("fd00:30::9/128",)}


def test_no_endpoints_rejects_everywhere():
    state = build([service("web", "10.96.0.1", [{**HTTP[0], "nodePort": 30001}], type="NodePort")])
    blk = only(state, "default/web:http/TCP").family("ipv4")
    assert blk.internal.verdict == "reject" and blk.external.verdict == "reject"


def test_slices_joined_by_label_and_port_name():
    objs = [
        service("web", "10.96.0.1", HTTP),
        endpoint_slice("web", [endpoint("10.244.1.5")], name="web-1"),
        endpoint_slice("web", [endpoint("10.244.2.5", node="node-b")], name="web-2"),
        endpoint_slice("web", [endpoint("10.244.3.5")], port_name="metrics", name="web-3"),
        endpoint_slice("other", [endpoint("10.244.4.5")], name="other-1"),
    ]
    blk = only(build(objs), "default/web:http/TCP").family("ipv4")
    assert [str(e) for e in blk.internal.endpoints] == ["10.244.1.5:8080", "10.244.2.5:8080"]
    assert [str(e) for e in blk.hairpinEndpoints] == ["10.244.1.5:8080"]


def test_itp_local_without_local_endpoints_drops():
    objs = [service("web", "10.96.0.1", HTTP, internalTrafficPolicy="Local"),
            endpoint_slice("web", [endpoint("10.244.2.5", node="node-b")])]
    blk = only(build(objs), "default/web:http/TCP").family("ipv4")
    assert blk.internal.verdict == "drop"


def test_etp_local_external_uses_local_and_short_circuits_to_cluster():
    objs = [service("web", "10.96.0.1", [{**HTTP[0], "nodePort": 30001}], type="NodePort",
                    externalTrafficPolicy="Local"),
            endpoint_slice("web", [endpoint("10.244.1.5"), endpoint("10.244.2.5", node="node-b")])]
    blk = only(build(objs), "default/web:http/TCP").family("ipv4")
    assert blk.internal.verdict == "forward" and len(blk.internal.endpoints) == 2
    assert blk.external.policy == "Local"
    assert [str(e) for e in blk.external.endpoints] == ["10.244.1.5:8080"]
    assert len(blk.external.shortCircuit) == 2


def test_etp_local_without_local_endpoints_drops_external_only():
    objs = [service("web", "10.96.0.1", [{**HTTP[0], "nodePort": 30001}], type="NodePort",
                    externalTrafficPolicy="Local"),
            endpoint_slice("web", [endpoint("10.244.2.5", node="node-b")])]
    blk = only(build(objs), "default/web:http/TCP").family("ipv4")
    assert blk.internal.verdict == "forward"
    assert blk.external.verdict == "drop" and len(blk.external.shortCircuit) == 1


def test_health_check_node_port_counts_local_ready():
    objs = [service("lb", "10.96.0.1", [{**HTTP[0], "nodePort": 30001}], type="LoadBalancer",
                    externalTrafficPolicy="Local", healthCheckNodePort=32000),
            endpoint_slice("lb", [endpoint("10.244.1.5"), endpoint("10.244.1.6"),
                                  endpoint("10.244.2.5", node="node-b")])]
    state = build(objs)
    assert [h.to_dict() for h in state.healthChecks] == [
        {"service": "default/lb", "nodePort": 32000, "localEndpoints": 2}]
    # counted by address over all the service's ports, as kube-proxy does: one local pod on
    # each of two ports is two
    ports = [{"name": "a", "port": 80, "nodePort": 30001}, {"name": "b", "port": 81, "nodePort": 30002}]
    objs = [service("lb", "10.96.0.1", ports, type="LoadBalancer", externalTrafficPolicy="Local",
                    healthCheckNodePort=32000),
            endpoint_slice("lb", [endpoint("10.244.1.5")], port_name="a"),
            endpoint_slice("lb", [endpoint("10.244.1.6"), endpoint("10.244.1.5", ready=False)], port_name="b")]
    assert [h.localEndpoints for h in build(objs).healthChecks] == [2]
    # a dual-stack pod is one endpoint, not one per family
    dual = [service("lb", "10.96.0.1", [{**HTTP[0], "nodePort": 30001}], type="LoadBalancer",
                    externalTrafficPolicy="Local", healthCheckNodePort=32000, clusterIPs=["10.96.0.1", "fd00::1"]),
            endpoint_slice("lb", [endpoint("10.244.1.5")]),
            endpoint_slice("lb", [endpoint("fd00:244::5")], family="IPv6")]
    assert [h.to_dict() for h in build(dual).healthChecks] == [
        {"service": "default/lb", "nodePort": 32000, "localEndpoints": 1, "localEndpointsByFamily": {"ipv4": 1, "ipv6": 1}}]
    # each family counted on its own, as kube-proxy's two proxiers do: a node whose only local
    # endpoint is IPv4 answers 503 on its IPv6 addresses (where that traffic is dropped)
    one_family = [*dual[:2], endpoint_slice("lb", [endpoint("fd00:244::7", node="node-b")], family="IPv6")]
    check = build(one_family).healthChecks[0]
    assert (check.localEndpoints, check.count("ipv4"), check.count("ipv6")) == (1, 1, 0)
    # a single-stack Service: nothing to count on the other family's addresses
    single = build(objs).healthChecks[0]
    assert (single.count("ipv4"), single.count("ipv6")) == (2, 0)
    # a slice port the Service does not have (a port being renamed) counts nothing: no 200 for a
    # service port whose traffic is refused (upstream counts it; see README)
    renamed = [service("lb", "10.96.0.1", [{**HTTP[0], "nodePort": 30001}], type="LoadBalancer",
                       externalTrafficPolicy="Local", healthCheckNodePort=32000),
               endpoint_slice("lb", [endpoint("10.244.1.5")], port_name="web")]
    assert [h.localEndpoints for h in build(renamed).healthChecks] == [0]


def test_a_zero_node_port_or_health_check_node_port_is_unset():
    """kube-proxy reads 0 as not set (a LoadBalancer without node ports: allocateLoadBalancerNodePorts
    false); it was refused as out of range."""
    objs = [service("lb", "10.96.0.1", [{**HTTP[0], "nodePort": 0}], type="LoadBalancer",
                    externalTrafficPolicy="Local", healthCheckNodePort=0, allocateLoadBalancerNodePorts=False),
            service("np", "10.96.0.2", [{**HTTP[0], "nodePort": 0}], type="NodePort")]
    state = build(objs)
    assert [(sp.id, sp.nodePort, sp.healthCheckNodePort) for sp in state.services] == [
        ("default/lb:http/TCP", None, None), ("default/np:http/TCP", None, None)]
    assert state.healthChecks == ()


def test_dual_stack_and_sctp_ports():
    ports = [{"name": "a", "port": 5000, "protocol": "TCP"}, {"name": "b", "port": 5000, "protocol": "SCTP"}]
    objs = [service("d", "10.96.0.1", ports, clusterIPs=["10.96.0.1", "fd00:96::1"]),
            endpoint_slice("d", [endpoint("fd00:244:1::5")], port=5000, port_name="b", family="IPv6",
                           protocol="SCTP")]
    state = build(objs)
    assert sorted(state.by_id()) == ["default/d:a/TCP", "default/d:b/SCTP"]
    sctp = only(state, "default/d:b/SCTP")
    assert sctp.family("ipv4").internal.verdict == "reject"
    assert [str(e) for e in sctp.family("ipv6").internal.endpoints] == ["[fd00:244:1::5]:5000"]


def test_topology_uses_node_zone_label():
    objs = [node(zone="zone-a"), service("web", "10.96.0.1", HTTP),
            endpoint_slice("web", [endpoint("10.244.1.5", hints=["zone-a"]),
                                   endpoint("10.244.2.5", node="node-b", hints=["zone-b"])])]
    blk = only(build(objs), "default/web:http/TCP").family("ipv4")
    assert [e.ip for e in blk.internal.endpoints] == ["10.244.1.5"]
    objs[0] = node(zone="zone-c")
    blk = only(build(objs), "default/web:http/TCP").family("ipv4")
    assert len(blk.internal.endpoints) == 2


def _lb(ranges, node_addresses=None, lb_ips=("172.30.1.13", "fd00:30::1:13"), **opts):
    svc = service("lb", "10.96.0.1", HTTP, type="LoadBalancer", loadBalancerSourceRanges=list(ranges))
    svc.body["status"] = {"loadBalancer": {"ingress": [{"ip": ip} for ip in lb_ips]}}
    objs = [svc, endpoint_slice("lb", [endpoint("10.244.1.5")])]
    if node_addresses is not None:
        n = node()
        n.body["status"] = {"addresses": node_addresses}
        objs.append(n)
    state = build(objs, **opts)
    import jsonschema
    with open(os.path.join(os.path.dirname(STATE_DIR), "schemas", "desired-state.schema.json")) as fh:
        jsonschema.validate(state.to_dict(), json.load(fh))
    return only(state, "default/lb:http/TCP").family("ipv4")


def test_source_ranges_are_merged():
    # nft refuses overlapping intervals in one set: 10.1.0.0/16 inside 10.0.0.0/8 must not reach it
    blk = _lb(["10.1.0.0/16", "10.0.0.0/8", "192.168.0.0/25", "192.168.0.128/25"])
    assert blk.loadBalancerSourceRanges == ("10.0.0.0/8", "192.168.0.0/24")


def test_lb_ips_are_allowed_sources_when_the_node_is_inside_a_range():
    internal = [{"type": "Hostname", "address": "node-a"}, {"type": "ExternalIP", "address": "203.0.113.9"},
                {"type": "InternalIP", "address": "not-an-ip"}, {"type": "InternalIP", "address": "172.30.0.2"}]
    assert _lb(["172.30.0.0/24"], internal).loadBalancerSourceRanges == ("172.30.0.0/24", "172.30.1.13/32")
    # the node is outside every range: only the ranges
    assert _lb(["198.51.100.0/24"], internal).loadBalancerSourceRanges == ("198.51.100.0/24",)
    # an ExternalIP counts only when the family has no InternalIP
    external = [{"type": "ExternalIP", "address": "203.0.113.9"}]
    assert _lb(["203.0.113.0/24"], external).loadBalancerSourceRanges == ("172.30.1.13/32", "203.0.113.0/24")
    assert _lb(["203.0.113.0/24"], internal).loadBalancerSourceRanges == ("203.0.113.0/24",)
    dual = [{"type": "InternalIP", "address": "fd00:30::2"}, {"type": "InternalIP", "address": "172.30.0.2"}]
    assert _lb(["172.30.0.0/24"], dual).loadBalancerSourceRanges == ("172.30.0.0/24", "172.30.1.13/32")
    # no Node addresses known: nothing added; an LB IP inside a range is merged into it
    assert _lb(["172.30.0.0/24"]).loadBalancerSourceRanges == ("172.30.0.0/24",)
    assert _lb(["172.30.0.0/16"], internal).loadBalancerSourceRanges == ("172.30.0.0/16",)
    # bindAddress is the node's IP of its family (over the Node's InternalIP)
    assert _lb(["198.51.100.0/24"], internal, node_ip_override="198.51.100.7").loadBalancerSourceRanges == (
        "172.30.1.13/32", "198.51.100.0/24")
    assert _lb(["172.30.0.0/24"], internal, node_ip_override="198.51.100.7").loadBalancerSourceRanges == (
        "172.30.0.0/24",)


def test_only_vip_mode_ingress_ips_are_programmed():
    """proxyutil.IsVIPMode: an ingress IP is the proxy's when ipMode is unset or VIP; Proxy (the
    LB proxies itself) and any other value (only a file can hold one) are skipped."""
    svc = service("lb", "10.96.0.9", [{**HTTP[0], "nodePort": 30009}], type="LoadBalancer")
    svc.body["status"] = {"loadBalancer": {"ingress": [
        {"ip": "172.30.1.1"}, {"ip": "172.30.1.2", "ipMode": "VIP"}, {"ip": "172.30.1.3", "ipMode": "Proxy"},
        {"ip": "172.30.1.4", "ipMode": ""}, {"ip": "172.30.1.5", "ipMode": "vip"}, {"hostname": "lb.example"}]}}
    d = build([svc, endpoint_slice("lb", [endpoint("10.244.1.5")])])
    [sp] = d.services
    assert sp.families[0].loadBalancerIPs == ("172.30.1.1", "172.30.1.2")
    assert [w.split(": ", 1)[1] for w in d.warnings if "ipMode" in w] == [
        "status.loadBalancer.ingress[3].ipMode: '' is neither VIP nor Proxy; this ingress IP is skipped, as "
        "kube-proxy skips it",
        "status.loadBalancer.ingress[4].ipMode: 'vip' is neither VIP nor Proxy; this ingress IP is skipped, as "
        "kube-proxy skips it"]


def test_loosely_written_addresses_are_read_as_kube_proxy_reads_them():
    """netutils.ParseIPSloppy / ParseCIDRSloppy, which the API server's legacy validation accepts:
    leading zeros are decimal, an IPv4-mapped IPv6 address is IPv4 (it was classed IPv6: an
    external IP never programmed, an IPv4 slice's endpoint refused). The document carries the
    canonical form, each loose spelling is warned about, and a duplicate so written is one."""
    svc = service("lb", "010.096.000.001", [{**HTTP[0], "nodePort": 30001}], type="LoadBalancer",
                  clusterIPs=["010.096.000.001", "fd00:0096::0001"],
                  externalIPs=["::ffff:192.0.2.7", "198.051.100.001", "198.51.100.1"],
                  loadBalancerSourceRanges=["010.0.0.0/08", "::ffff:203.0.113.0/120", "fd00::/0064"])
    svc.body["status"] = {"loadBalancer": {"ingress": [{"ip": "172.030.001.013"}, {"ip": "::ffff:172.30.1.14"}]}}
    objs = [svc, endpoint_slice("lb", [endpoint("010.244.001.005"), endpoint("::ffff:10.244.1.6", node="node-b")])]
    state = build(objs)
    sp = only(state, "default/lb:http/TCP")
    v4, v6 = sp.family("ipv4"), sp.family("ipv6")
    assert (v4.clusterIP, v6.clusterIP) == ("10.96.0.1", "fd00:96::1")
    assert v4.externalIPs == ("192.0.2.7", "198.51.100.1") and v6.externalIPs == ()
    assert v4.loadBalancerIPs == ("172.30.1.13", "172.30.1.14") and v6.loadBalancerIPs == ()
    assert v4.loadBalancerSourceRanges == ("10.0.0.0/8", "203.0.113.0/24")
    assert [str(e) for e in v4.internal.endpoints] == ["10.244.1.5:8080", "10.244.1.6:8080"]
    assert len([w for w in state.warnings if "is read as" in w]) == 9  # all but fd00:0096::0001, fd00::/0064
    assert ("mem:default/lb: spec.externalIPs[0]: '::ffff:192.0.2.7' is read as 192.0.2.7 (an IPv4-mapped IPv6 "
            "address is IPv4 to kube-proxy)") in state.warnings
    import jsonschema
    with open(os.path.join(os.path.dirname(STATE_DIR), "schemas", "desired-state.schema.json")) as fh:
        jsonschema.validate(state.to_dict(), json.load(fh))
    # the same written plainly: the same document, no warning
    plain = [service("lb", "10.96.0.1", [{**HTTP[0], "nodePort": 30001}], type="LoadBalancer",
                     clusterIPs=["10.96.0.1", "fd00:96::1"], externalIPs=["192.0.2.7", "198.51.100.1"],
                     loadBalancerSourceRanges=["10.0.0.0/8", "203.0.113.0/24", "fd00::/64"]),
             endpoint_slice("lb", [endpoint("10.244.1.5"), endpoint("10.244.1.6", node="node-b")])]
    plain[0].body["status"] = {"loadBalancer": {"ingress": [{"ip": "172.30.1.13"}, {"ip": "172.30.1.14"}]}}
    again = build(plain)
    assert again.to_dict() == state.to_dict() and again.warnings == ()


def test_document_is_deterministic_whatever_the_file_order(tmp_path):
    opts = BuildOptions("node-a", ("10.244.0.0/16",))
    first = json.dumps(build_desired_state(load_directory(STATE_DIR).objects, opts).to_dict())
    # Same manifests, other file names and order: one file per document, shuffled.
    docs = []
    for root, _, files in os.walk(STATE_DIR):
        for f in files:
            docs += open(os.path.join(root, f)).read().split("\n---\n")
    random.Random(7).shuffle(docs)
    for i, d in enumerate(docs):
        (tmp_path / f"{len(docs) - i:03d}.yaml").write_text(d)
    second = json.dumps(build_desired_state(load_directory(tmp_path).objects, opts).to_dict())
    assert first == second
    shutil.rmtree(tmp_path)


def test_document_validates_against_schema():
    import jsonschema
    schema = json.load(open(os.path.join(os.path.dirname(STATE_DIR), "schemas", "desired-state.schema.json")))
    doc = build_desired_state(load_directory(STATE_DIR).objects, BuildOptions("node-a", ("10.244.0.0/16",))).to_dict()
    jsonschema.validate(doc, schema)
    doc["services"][0]["ipv4"]["internal"]["verdict"] = "maybe"
    try:
        jsonschema.validate(doc, schema)
    except jsonschema.ValidationError:
        pass
    else:
        raise AssertionError("schema accepted an invalid verdict")


def test_a_nodeport_outside_the_api_servers_range_is_warned_about():
    svc = service("ssh", "10.96.0.9", [{"name": "ssh", "port": 22, "nodePort": 22}], type="NodePort")
    state = build([svc])
    assert any("spec.ports[0].nodePort: 22 is outside the API server's default range 30000-32767" in w
               for w in state.warnings)
    assert only(state, "default/ssh:ssh/TCP").nodePort == 22  # (programmed all the same, as asked)


def test_load_balancer_ips_of_a_service_of_another_type_are_warned_about_not_programmed():
    svc = service("np", "10.96.0.9", [{"name": "http", "port": 80, "nodePort": 30301}], type="NodePort")
    svc.body["status"] = {"loadBalancer": {"ingress": [{"ip": "192.168.70.31"}]}}
    state = build([svc])
    assert any("status.loadBalancer.ingress: ignored: a NodePort Service's load balancer IPs are not programmed"
               in w for w in state.warnings), state.warnings
    assert only(state, "default/np:http/TCP").families[0].loadBalancerIPs == ()
    svc.body["status"]["loadBalancer"]["ingress"] = [{"hostname": "lb.example.com"}]  # (no IP: nothing to say)
    assert not any("ingress" in w for w in build([svc]).warnings)


def test_the_usual_endpoint_reads_the_same_on_the_fast_path_as_with_every_check():
    """_parse_slice decides the usual endpoint itself; _endpoint reads any endpoint with every
    check. On 2,000 random usual (and some unusual) endpoints the two agree field for field, and
    warn alike of unknown fields."""
    from reconciler.desired import _endpoint, _parse_slice, _Reader

    rnd = random.Random(7)
    for family, addr_type, make in (("ipv4", "IPv4", lambda i: f"10.{i // 250}.{i % 250}.{rnd.randint(1, 254)}"),
                                    ("ipv6", "IPv6", lambda i: f"fd00:0:0::{i:x}:{rnd.randint(0, 65535):x}")):
        eps = []
        for i in range(1000):
            ep: dict = {"addresses": [make(i)]}
            cond = {k: rnd.choice([True, False, None]) for k in ("ready", "serving", "terminating") if rnd.random() < 0.7}
            if rnd.random() < 0.05:
                cond["servng"] = True
            if cond or rnd.random() < 0.5:
                ep["conditions"] = cond if rnd.random() < 0.9 else rnd.choice([None, {}])
            if rnd.random() < 0.8:
                ep["nodeName"] = rnd.choice(["node-a", "node-b", ""])
            if rnd.random() < 0.3:
                ep["zone"] = rnd.choice(["zone-a", ""])
            if rnd.random() < 0.05:
                ep["hints"] = {"forZones": [{"name": "zone-a"}]}  # (always the careful path)
            if rnd.random() < 0.2:  # (as the API serves a Pod's endpoint)
                ep["targetRef"] = {"kind": "Pod", "name": f"web-{i}", rnd.choice(["namespace", "namspace"]): "default"}
            for extra in ("hostname", "nodename"):  # (a field, and a misspelt one)
                if rnd.random() < 0.05:
                    ep[extra] = "web"
            eps.append(ep)
        sl = endpoint_slice("web", eps, family=addr_type)
        fast: list[str] = []
        parsed = _parse_slice(sl, fast)
        assert parsed is not None
        slow: list[str] = []
        careful = [_endpoint(_Reader(sl, slow), raw, i, family, addr_type, 8080) for i, raw in enumerate(eps)]
        assert list(parsed.endpoints) == careful
        assert sorted(fast) == sorted(slow) and len(slow) > 100


def test_nodes_in_the_input_but_none_of_this_nodes_name_are_warned_about_once_per_build():
    """The node name defaults to the hostname: a wrong one silently changes topology and traffic
    policies (no endpoint is local). With no Node in the input at all there is nothing to say."""
    from reconciler.desired import BuildCache

    objs = [service("web", "10.96.0.1", HTTP), endpoint_slice("web", [endpoint("10.244.1.5")]), node("node-a")]
    assert build(objs).warnings == ()
    assert build(objs[:2], node_name="vm").warnings == ()
    state = build(objs, node_name="vm")
    assert state.warnings == (
        'no Node "vm" in the input (it has: node-a): this node\'s zone and IPs are unknown, and only endpoints with '
        'nodeName "vm" are local; is --node-name (or hostnameOverride) right?',)
    more = objs + [node(f"node-{c}") for c in "edcb"]
    assert "(it has: node-a, node-b, node-c and 2 more)" in build(more, node_name="vm").warnings[0]
    # a build with memory says it each time (the daemon logs a warning once, until it changes)
    # and no more once this node's Node comes
    cache = BuildCache()
    opts = BuildOptions("vm", ("10.244.0.0/16",))
    for _ in range(2):
        assert cache.build(objs, opts).warnings == state.warnings
    assert cache.update([node("vm")], [], opts).warnings == ()
    assert "(it has: node-a)" in cache.update([], [o for o in cache.objects.values() if o.name == "vm"],
                                               opts).warnings[0]
    assert cache.update([], [objs[2]], opts).warnings == ()  # (no Node at all)


def test_a_node_or_load_balancer_port_without_a_node_port_is_warned_at_its_field():
    """A hand-written NodePort (or LoadBalancer) Service without nodePort: the API server would
    allocate one; here the port has none, which a warning says at the field."""
    http = [{"name": "http", "port": 80}]
    for kind in ("NodePort", "LoadBalancer"):
        state = build([service("np", "10.96.0.9", http, type=kind)])
        assert only(state, "default/np:http/TCP").nodePort is None
        assert [w for w in state.warnings if "spec.ports[0].nodePort: not set" in w] == [
            f"mem:default/np: spec.ports[0].nodePort: not set: a {kind} Service's port gets one from the API "
            "server; this one has no NodePort here"], kind
    quiet = build([service("lb", "10.96.0.9", http, type="LoadBalancer", allocateLoadBalancerNodePorts=False),
                   service("ci", "10.96.0.8", http)])
    assert not [w for w in quiet.warnings if "nodePort" in w]


def test_cluster_cidrs_one_inside_another_are_merged() -> None:
    """--cluster-cidr 10.0.0.0/8,10.244.0.0/16 (an easy mistake): the same pods, one CIDR (an
    nftables interval set refuses overlapping elements, which failed every transaction)."""
    d = build([], cluster_cidrs=("10.244.0.0/16", "10.0.0.0/8", "fd00:244::/33", "fd00:244:8000::/33"))
    assert d.families["ipv4"].clusterCIDRs == ("10.0.0.0/8",)
    assert d.families["ipv6"].clusterCIDRs == ("fd00:244::/32",)
