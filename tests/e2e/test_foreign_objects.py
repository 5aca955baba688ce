"""apply and cleanup own only their tables: foreign nftables tables, chains and rules stay intact."""

from __future__ import annotations

import json
import re

import pytest

from manifests import common_flags, eps, reconciler, svc, write_state

pytestmark = pytest.mark.e2e

FOREIGN = """
table ip foreign {
    set blocked {
        type ipv4_addr
        elements = { 192.0.2.1 }
    }
    chain input {
        type filter hook input priority 0; policy accept;
        ip saddr @blocked drop
    }
    chain nat-prerouting {
        type nat hook prerouting priority -100; policy accept;
        tcp dport 2222 counter
    }
}
table inet filter {
    chain forward {
        type filter hook forward priority 0; policy accept;
        ct state established accept
    }
}
table ip6 reconciler-other {
    chain c {
        counter
    }
}
"""


def foreign_listing(lab) -> str:
    out = []
    for fam, name in (("ip", "foreign"), ("inet", "filter"), ("ip6", "reconciler-other")):
        out.append(lab.exec("node", ["nft", "list", "table", fam, name]).stdout)
    return "\n".join(out)


def test_apply_and_cleanup_leave_foreign_objects(lab, tmp_path):
    lab.nft("node", FOREIGN)
    try:
        before = foreign_listing(lab)
        src = str(tmp_path / "state")
        write_state(src, [svc("web", ["10.96.0.10"], [{"name": "http", "port": 80, "protocol": "TCP"}]),
                          eps("web", ["pod1"])])
        applied = reconciler(lab, "apply", *common_flags(src))
        # nobody else committed between apply's read and its transaction: no read-back needed
        assert "Applied. Verified by the ruleset generation" in applied.stdout
        again = reconciler(lab, "apply", *common_flags(src), "--read-back")  # asked for all the same
        assert "Nothing to do. Verified by reading the kernel back." in again.stdout
        as_json = json.loads(reconciler(lab, "apply", *common_flags(src), "-o", "json").stdout)
        assert as_json["inSync"] and as_json["verifiedBy"] == "generation"
        assert foreign_listing(lab) == before
        tables = lab.exec("node", ["nft", "list", "tables"]).stdout
        assert "table ip reconciler\n" in tables and re.search(r"table ip reconciler-\d\d\n", tables)
        reconciler(lab, "cleanup", "--mode", "nftables")
        reconciler(lab, "cleanup", "--mode", "nftables")  # twice is fine
        tables = lab.exec("node", ["nft", "list", "tables"]).stdout.splitlines()
        ours = [t for t in tables if re.fullmatch(r"table ip6? reconciler(-\d\d)?", t.strip())]
        assert ours == [], ours
        assert foreign_listing(lab) == before
        observed = reconciler(lab, "observe", "--mode", "nftables", "-o", "json")
        assert '"tables": {}' in observed.stdout
    finally:
        for fam, name in (("ip", "foreign"), ("inet", "filter"), ("ip6", "reconciler-other")):
            lab.exec("node", ["nft", "delete", "table", fam, name], check=False)


def test_invalid_input_never_touches_the_kernel(lab, tmp_path):
    src = str(tmp_path / "state")
    write_state(src, [svc("web", ["10.96.0.10"], [{"name": "http", "port": 80, "protocol": "TCP"}]),
                      eps("web", ["pod1"])])
    reconciler(lab, "apply", *common_flags(src))
    try:
        before = lab.exec("node", ["nft", "list", "ruleset"]).stdout
        with open(f"{src}/broken.yaml", "w") as fh:
            fh.write("apiVersion: v1\nkind: Service\nmetadata:\n  name: x\nspec:\n  clusterIP: 10.96.0.11\n"
                     "  ports:\n    - port: 99999\n")
        res = reconciler(lab, "apply", *common_flags(src), check=False)
        assert res.returncode == 1
        assert "broken.yaml:8:" in res.stderr and "spec.ports[0].port" in res.stderr
        assert lab.exec("node", ["nft", "list", "ruleset"]).stdout == before
        assert lab.tcp("pod2", "10.96.0.10", 80)[0].ok
    finally:
        reconciler(lab, "cleanup", "--mode", "nftables", check=False)
