"""The benchmark credits each daemon sync with the kernel tool's time logged since the sync before."""

from __future__ import annotations

import json

import pytest

from benchmark_log import split_iptables_script, sync_tool_seconds, tool_seconds


def test_tool_lines_of_both_backends_are_read_and_others_ignored():
    assert tool_seconds([
        "DEBUG libnftables: 812 bytes in 0.0021s",
        "nft -f: 9915398 bytes in 2.8500s",
        "iptables-restore (nft): 26 lines in 0.2180s",
        "ip6tables-restore (legacy): 3 lines in 0.0100s",
        "sync incremental: 24 operations, 1.5s",  # not a tool line
        "iptables flavour: nft",
    ]) == pytest.approx(0.0021 + 2.85 + 0.218 + 0.01)


def test_each_sync_gets_the_tool_time_logged_before_it(tmp_path):
    log = tmp_path / "run.log"
    records = [
        {"msg": "nft -f: 100 bytes in 3.0000s"},
        {"msg": "sync full: service ports +2 ~0 -0"},
        {"msg": "re-read a.yaml; dropped nothing"},
        {"msg": "libnftables: 10 bytes in 0.0020s"},
        {"msg": "libnftables: 10 bytes in 0.0030s"},  # a sync may run more than one transaction
        {"msg": "sync incremental: service ports +0 ~1 -0"},
        {"msg": "sync incremental: service ports +0 ~0 -0"},  # nothing to do: no tool time
    ]
    log.write_text("\n".join(json.dumps(r) for r in records) + "\nnot json\n")
    assert sync_tool_seconds(str(log), 1) == pytest.approx(3.0)
    assert sync_tool_seconds(str(log), 2) == pytest.approx(0.005)
    assert sync_tool_seconds(str(log), 3) == 0
    with pytest.raises(RuntimeError):
        sync_tool_seconds(str(log), 4)


def test_the_iptables_script_is_split_into_one_restore_input_per_family():
    script = ("# iptables-restore --noflush\n*filter\n:A - [0:0]\nCOMMIT\n"
              "# ip6tables-restore --noflush\n*nat\n-A B -j C\nCOMMIT\n")
    assert split_iptables_script(script) == {"iptables": "*filter\n:A - [0:0]\nCOMMIT\n",
                                             "ip6tables": "*nat\n-A B -j C\nCOMMIT\n"}
