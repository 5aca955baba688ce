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


# ---------------------------------------------------------------------- conntrack (`run` only)

CONNTRACK = CONFIG + """conntrack:
  maxPerCore: 65536
  min: 262144
  tcpEstablishedTimeout: 24h0m0s
  tcpCloseWaitTimeout: 10m
  tcpBeLiberal: true
  udpTimeout: 30s
  udpStreamTimeout: 0s
"""


def test_defaults_are_kube_proxys():
    opts = options_from(build_parser().parse_args(["run", "--source", "x"]))
    assert (opts.conntrack_max_per_core, opts.conntrack_min) == (32768, 131072)
    assert (opts.conntrack_tcp_timeout_established, opts.conntrack_tcp_timeout_close_wait) == (86400, 3600)
    assert opts.conntrack_tcp_be_liberal is False
    assert (opts.conntrack_udp_timeout, opts.conntrack_udp_timeout_stream) == (0, 0)
    assert opts.conntrack_sysctl_dir is None


def test_conntrack_section(tmp_path):
    path = tmp_path / "kp.yaml"
    path.write_text(CONNTRACK)
    cfg = load_kube_proxy_config(str(path))
    assert {k: v for k, v in cfg.items() if k.startswith("conntrack_")} == {
        "conntrack_max_per_core": 65536, "conntrack_min": 262144, "conntrack_tcp_timeout_established": 86400,
        "conntrack_tcp_timeout_close_wait": 600, "conntrack_tcp_be_liberal": True, "conntrack_udp_timeout": 30,
        "conntrack_udp_timeout_stream": 0}
    # null is kube-proxy's default (kubeadm writes them so)
    path.write_text(CONFIG + "conntrack:\n  maxPerCore: null\n  min: null\n  tcpEstablishedTimeout: null\n"
                             "  udpTimeout: 0s\n")
    cfg = load_kube_proxy_config(str(path))
    assert {k: v for k, v in cfg.items() if k.startswith("conntrack_")} == {"conntrack_udp_timeout": 0}


def test_conntrack_flags_win_over_the_file(tmp_path):
    path = tmp_path / "kp.yaml"
    path.write_text(CONNTRACK)
    args = build_parser().parse_args([
        "run", "--source", "x", "--config", str(path), "--conntrack-max-per-core", "0", "--conntrack-min", "5",
        "--conntrack-tcp-timeout-established", "1h30m", "--conntrack-tcp-timeout-close-wait", "0",
        "--conntrack-udp-timeout", "45s", "--conntrack-udp-timeout-stream", "3m", "--conntrack-sysctl-dir", "/host"])
    opts = options_from(args)
    assert (opts.conntrack_max_per_core, opts.conntrack_min) == (0, 5)
    assert (opts.conntrack_tcp_timeout_established, opts.conntrack_tcp_timeout_close_wait) == (5400, 0)
    assert (opts.conntrack_udp_timeout, opts.conntrack_udp_timeout_stream) == (45, 180)
    assert opts.conntrack_tcp_be_liberal is True  # (from the file: the flag only turns it on)
    assert opts.conntrack_sysctl_dir == "/host"
    opts = options_from(build_parser().parse_args(["run", "--source", "x", "--conntrack-tcp-be-liberal"]))
    assert opts.conntrack_tcp_be_liberal is True


@pytest.mark.parametrize("line,message", [
    ("  maxPerCore: -1", "conntrack.maxPerCore: expected an integer from 0 to 2147483647, got -1"),
    ("  min: 2147483648", "conntrack.min: expected an integer from 0 to 2147483647, got 2147483648"),
    ("  min: '131072'", "conntrack.min: expected an integer from 0 to 2147483647, got '131072'"),
    ("  tcpBeLiberal: 1", "conntrack.tcpBeLiberal: expected true or false, got 1"),
    ("  tcpEstablishedTimeout: 86400", "conntrack.tcpEstablishedTimeout: invalid duration '86400'"),
    ("  udpTimeout: -30s", "conntrack.udpTimeout: invalid duration '-30s'"),
])
def test_bad_conntrack_values_name_file_and_line(tmp_path, line, message):
    path = tmp_path / "kp.yaml"
    path.write_text(CONFIG + "conntrack:\n  udpStreamTimeout: 1m\n" + line + "\n")
    with pytest.raises(InputError) as exc:
        load_kube_proxy_config(str(path))
    assert str(exc.value).startswith(f"{path}:14:3: {message}")
    path.write_text(CONFIG + "conntrack: 5\n")
    with pytest.raises(InputError, match=r":12:1: conntrack: expected a mapping"):
        load_kube_proxy_config(str(path))


def test_conntrack_values_kube_proxy_reads_otherwise_are_warned_about(tmp_path, caplog):
    path = tmp_path / "kp.yaml"
    path.write_text(CONFIG + "conntrack:\n  max: 1000000\n  udpTimeout: 1500ms\n")
    with caplog.at_level("WARNING"):
        cfg = load_kube_proxy_config(str(path))
    assert cfg["conntrack_udp_timeout"] == 1.5 and "conntrack_max" not in cfg
    assert f"{path}:13:3: conntrack.max is not a KubeProxyConfiguration field; ignored" in caplog.text
    assert (f"{path}:14:3: conntrack.udpTimeout: 1500ms is not a whole number of seconds: 1 is written "
            "(kube-proxy truncates)") in caplog.text


def test_bad_conntrack_flags():
    with pytest.raises(ValueError, match=r"--conntrack-udp-timeout: invalid duration '30'"):
        options_from(build_parser().parse_args(["run", "--source", "x", "--conntrack-udp-timeout", "30"]))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--source", "x", "--conntrack-max-per-core", "-1"])
    with pytest.raises(SystemExit):  # `run` only: the one-shot commands never touch sysctls
        build_parser().parse_args(["apply", "--source", "x", "--conntrack-min", "1"])


def test_run_help_lists_kube_proxys_conntrack_flags(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--help"])
    text = capsys.readouterr().out
    for flag in ("--conntrack-max-per-core", "--conntrack-min", "--conntrack-tcp-timeout-established",
                 "--conntrack-tcp-timeout-close-wait", "--conntrack-tcp-be-liberal", "--conntrack-udp-timeout",
                 "--conntrack-udp-timeout-stream", "--conntrack-sysctl-dir"):
        assert flag in text
