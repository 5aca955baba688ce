"""Options: Go-style durations, kube-proxy's KubeProxyConfiguration, flags winning over the file."""

from __future__ import annotations

import pytest

from reconciler.cli import build_parser, options_from
from reconciler.config import load_kube_proxy_config, parse_duration
from reconciler.sources.objects import InputError


@pytest.mark.parametrize("text,seconds", [("30s", 30), ("200ms", 0.2), ("1m", 60), ("1m30s", 90), ("1h", 3600),
                                          ("0", 0), ("1.5s", 1.5)])
def test_durations(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["30", "s", "1x", "", "1m 30s"])
def test_bad_durations(bad):
    with pytest.raises(ValueError):
        parse_duration(bad)


CONFIG = """apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
clusterCIDR: 10.244.0.0/16,fd00:244::/48
hostnameOverride: Node-A
nodePortAddresses: [172.30.0.0/24]
syncPeriod: 45s
minSyncPeriod: 2s
healthzBindAddress: 0.0.0.0:10266
iptables:
  masqueradeAll: true
"""


def test_kube_proxy_configuration(tmp_path):
    path = tmp_path / "kp.yaml"
    path.write_text(CONFIG)
    cfg = load_kube_proxy_config(str(path))
    assert cfg["mode"] == "iptables"
    assert cfg["cluster_cidrs"] == ("10.244.0.0/16", "fd00:244::/48")
    assert cfg["node_name"] == "node-a"
    assert cfg["nodeport_cidrs"] == ("172.30.0.0/24",)
    assert cfg["sync_period"] == 45 and cfg["min_sync_period"] == 2
    assert cfg["masquerade_all"] is True
    assert cfg["healthz_bind_address"] == "0.0.0.0:10266"


def test_flags_win_over_the_file(tmp_path):
    path = tmp_path / "kp.yaml"
    path.write_text(CONFIG)
    args = build_parser().parse_args(["plan", "--source", "x", "--config", str(path), "--mode", "nftables",
                                      "--node-name", "other", "--cluster-cidr", "10.0.0.0/8"])
    opts = options_from(args)
    assert (opts.mode, opts.node_name, opts.cluster_cidrs) == ("nftables", "other", ("10.0.0.0/8",))
    assert opts.masquerade_all is True and opts.nodeport_cidrs == ("172.30.0.0/24",)


def test_bad_config_names_file_and_line(tmp_path):
    path = tmp_path / "kp.yaml"
    path.write_text(CONFIG.replace("mode: iptables", "mode: ipvs"))
    with pytest.raises(InputError) as exc:
        load_kube_proxy_config(str(path))
    assert f"{path}:3:1: mode: mode 'ipvs' is not supported" in str(exc.value)


def test_settings_not_honoured_are_warned_about(tmp_path, caplog):
    path = tmp_path / "kp.yaml"
    path.write_text(CONFIG.replace("mode: iptables\n", "mode: iptables\ndetectLocalMode: NodeCIDR\n")
                    + "  masqueradeBit: 12\n")
    with caplog.at_level("WARNING"):
        load_kube_proxy_config(str(path))
    assert f"{path}:4:1: detectLocalMode NodeCIDR is not supported" in caplog.text
    assert f"{path}:13:3: masqueradeBit 12 is not supported" in caplog.text
    caplog.clear()
    path.write_text(CONFIG + "nftables:\n  masqueradeBit: 10\n")  # the other mode's section: --mode may pick it
    with caplog.at_level("WARNING"):
        load_kube_proxy_config(str(path))
    assert f"{path}:13:3: masqueradeBit 10 is not supported" in caplog.text
    caplog.clear()
    path.write_text(CONFIG.replace("mode: iptables\n", "mode: iptables\ndetectLocalMode: ClusterCIDR\n")
                    + "  masqueradeBit: 14\n")  # what is honoured: no warning
    with caplog.at_level("WARNING"):
        load_kube_proxy_config(str(path))
    assert "not supported" not in caplog.text
