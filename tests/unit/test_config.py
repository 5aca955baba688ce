"""Options: Go-style durations, kube-proxy's KubeProxyConfiguration, flags winning over the file."""

from __future__ import annotations

import json
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from reconciler.cli import build_parser, options_from
from reconciler.config import configz, go_duration, load_kube_proxy_config, parse_duration
from reconciler.health import parse_bind_address, start_metrics_server
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
healthzBindAddress: 0.0.0.0:10266
iptables:
  masqueradeAll: true
  syncPeriod: 45s
  minSyncPeriod: 2s
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
    assert opts.nodeport_cidrs == ("172.30.0.0/24",)
    # --mode picks the section read, as the file's mode would: nftables: (absent here), not iptables:
    assert (opts.masquerade_all, opts.sync_period, opts.min_sync_period) == (False, 30, 1)


def test_bad_config_names_file_and_line(tmp_path):
    path = tmp_path / "kp.yaml"
    path.write_text(CONFIG.replace("mode: iptables", "mode: ipvs"))
    with pytest.raises(InputError) as exc:
        load_kube_proxy_config(str(path))
    assert f"{path}:3:1: mode: mode 'ipvs' is not supported" in str(exc.value)


@pytest.mark.parametrize("line,value,where", [("hostnameOverride: Node-A", "hostnameOverride: 12345", "hostnameOverride"),
                                              ("hostnameOverride: Node-A", "hostnameOverride: [node-a]", "hostnameOverride"),
                                              ("hostnameOverride: Node-A",
                                               "hostnameOverride: Node-A\nclientConnection: {kubeconfig: 7}",
                                               "clientConnection.kubeconfig"),
                                              ("hostnameOverride: Node-A",
                                               "hostnameOverride: Node-A\nclientConnection: /etc/kc",
                                               "clientConnection")])
def test_a_string_setting_of_another_type_is_an_error_at_its_line(tmp_path, line, value, where):
    """kube-proxy's decoder refuses a number where a string goes; a hostnameOverride of 12345 was
    ignored, so the hostname named the node (which endpoints are local) without a word."""
    path = tmp_path / "kp.yaml"
    assert line in CONFIG
    path.write_text(CONFIG.replace(line, value))
    with pytest.raises(InputError) as exc:
        load_kube_proxy_config(str(path))
    assert f"{where}: expected {'a mapping' if where == 'clientConnection' else 'string'}, got" in str(exc.value)
    assert f"{path}:" in str(exc.value)


def test_a_blank_hostname_override_is_an_error_as_kube_proxy_has_it(tmp_path):
    """kube-proxy's GetHostname refuses a hostnameOverride of spaces ("empty hostname is
    invalid"); it was ignored here, so the hostname named the node without a word."""
    path = tmp_path / "kp.yaml"
    path.write_text(CONFIG.replace("hostnameOverride: Node-A", "hostnameOverride: '   '"))
    with pytest.raises(InputError) as exc:
        load_kube_proxy_config(str(path))
    assert str(exc.value).startswith(f"{path}:") and "hostnameOverride: blank" in str(exc.value)


def test_a_config_file_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "kp.yaml"
    path.write_bytes(("# padding\n" * 2000 + CONFIG.replace("Node-A", "N\u00e9")).encode("latin-1"))
    with pytest.raises(InputError) as exc:  # (placed in the file, past the first chunk a reader decodes)
        load_kube_proxy_config(str(path))
    line = 2000 + next(i for i, t in enumerate(CONFIG.splitlines(), 1) if "Node-A" in t)
    assert str(exc.value) == f"{path}:{line}:20: not UTF-8 text (byte 0xe9)"


def test_settings_not_honoured_are_warned_about(tmp_path, caplog):
    path = tmp_path / "kp.yaml"
    path.write_text(CONFIG.replace("mode: iptables\n", "mode: iptables\ndetectLocalMode: NodeCIDR\n")
                    + "  masqueradeBit: 12\n")
    with caplog.at_level("WARNING"):
        load_kube_proxy_config(str(path))
    assert f"{path}:4:1: detectLocalMode: NodeCIDR is not supported" in caplog.text
    assert f"{path}:13:3: iptables.masqueradeBit: 12 is not supported" in caplog.text
    caplog.clear()
    path.write_text(CONFIG + "nftables:\n  masqueradeBit: 10\n")  # the other mode's section: --mode may pick it
    with caplog.at_level("WARNING"):
        load_kube_proxy_config(str(path))
    assert f"{path}:13:3: nftables.masqueradeBit: 10 is not supported" in caplog.text
    caplog.clear()
    path.write_text(CONFIG.replace("mode: iptables\n", "mode: iptables\ndetectLocalMode: ClusterCIDR\n")
                    + "  masqueradeBit: 14\n")  # what is honoured: no warning
    with caplog.at_level("WARNING"):
        load_kube_proxy_config(str(path))
    assert "not supported" not in caplog.text


HEAD = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"


def run_options(tmp_path, text, *flags):
    path = tmp_path / "kp.yaml"
    path.write_text(text)
    return options_from(build_parser().parse_args(["run", "--source", "x", "--config", str(path), *flags]))


def test_zero_sync_periods_are_kube_proxys_defaults(tmp_path):
    """kubeadm writes 0s: kube-proxy's defaulting reads 0 as unset (30s, 1s)."""
    zeros = "  syncPeriod: 0s\n  minSyncPeriod: 0s\n"
    for mode in ("iptables", "nftables"):
        opts = run_options(tmp_path, f"{HEAD}mode: {mode}\niptables:\n{zeros}nftables:\n{zeros}")
        assert (opts.sync_period, opts.min_sync_period) == (30, 1), mode


@pytest.mark.parametrize("lines,message", [
    ("  syncPeriod: -30s\n", "4:3: nftables.syncPeriod: must be greater than 0, got -30s"),
    ("  minSyncPeriod: -1s\n", "4:3: nftables.minSyncPeriod: must not be negative, got -1s"),
    ("  minSyncPeriod: 45s\n", "4:3: nftables.minSyncPeriod: minSyncPeriod (45s) must not exceed syncPeriod (30s)"),
    ("  syncPeriod: 500ms\n", "4:3: nftables.syncPeriod: minSyncPeriod (1s) must not exceed syncPeriod (0.5s)"),
    ("  syncPeriod: 30\n", "4:3: nftables.syncPeriod: invalid duration '30'"),
])
def test_sync_periods_are_validated_as_kube_proxy_does(tmp_path, lines, message):
    path = tmp_path / "kp.yaml"
    path.write_text(f"{HEAD}nftables:\n{lines}")
    with pytest.raises(InputError) as exc:
        load_kube_proxy_config(str(path), "nftables")
    assert str(exc.value).startswith(f"{path}:{message}")


def test_sync_period_flags_are_validated_together():
    with pytest.raises(ValueError, match=r"--min-sync-period \(45s\) must not exceed --sync-period \(30s\)"):
        options_from(build_parser().parse_args(["run", "--source", "x", "--min-sync-period", "45s"]))


SECTIONS = HEAD + """iptables:
  masqueradeAll: true
  syncPeriod: 45s
nftables:
  minSyncPeriod: 2s
"""


def test_the_section_read_is_that_of_the_mode_run(tmp_path, caplog):
    """As kube-proxy's conversion.go: nftables: in nftables mode, else iptables:; --mode counts."""
    def read(text, *flags):
        opts = run_options(tmp_path, text, *flags)
        return opts.mode, opts.masquerade_all, opts.sync_period, opts.min_sync_period

    assert read("mode: iptables\n" + SECTIONS) == ("iptables", True, 45, 1)
    assert read("mode: nftables\n" + SECTIONS) == ("nftables", False, 30, 2)
    assert read("mode: nftables\n" + SECTIONS, "--mode", "iptables") == ("iptables", True, 45, 1)
    assert read("mode: iptables\n" + SECTIONS, "--mode", "nftables") == ("nftables", False, 30, 2)
    with caplog.at_level("WARNING"):  # kube-proxy's default mode is iptables, ours nftables: said so
        assert read('mode: ""\n' + SECTIONS) == ("nftables", False, 30, 2)
    assert "kp.yaml:1:1: mode: not set: kube-proxy runs iptables then, service-reconciler nftables" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert read(SECTIONS, "--mode", "iptables") == ("iptables", True, 45, 1)
    assert "mode: not set" not in caplog.text


def test_top_level_periods_and_masquerade_all_are_ignored_as_kube_proxy_does(tmp_path, caplog):
    with caplog.at_level("WARNING"):
        opts = run_options(tmp_path, HEAD + "mode: nftables\nmasqueradeAll: true\nsyncPeriod: 45s\n")
    assert (opts.masquerade_all, opts.sync_period) == (False, 30)
    assert ("kp.yaml:4:1: masqueradeAll: not a KubeProxyConfiguration field at the top level: kube-proxy ignores "
            "it, and so does service-reconciler (set it under nftables:)") in caplog.text
    assert "kp.yaml:5:1: syncPeriod: not a KubeProxyConfiguration field at the top level" in caplog.text


@pytest.mark.parametrize("lines,healthz,metrics", [
    ("healthzBindAddress: 0.0.0.0\nmetricsBindAddress: '::1'\n", "0.0.0.0:10256", "[::1]:10249"),
    ("healthzBindAddress: 10.0.0.5:8080\nmetricsBindAddress: '[::]:9090'\n", "10.0.0.5:8080", "[::]:9090"),
    ("healthzBindAddress: 010.0.0.5\nmetricsBindAddress: ''\n", "10.0.0.5:10256", "127.0.0.1:10249"),
    ("bindAddress: '::'\n", "[::]:10256", "[::1]:10249"),  # kube-proxy's defaults of the bindAddress family
])
def test_bind_addresses_are_defaulted_as_kube_proxy_does(tmp_path, lines, healthz, metrics):
    opts = run_options(tmp_path, HEAD + "mode: nftables\n" + lines)
    assert (opts.healthz_bind_address, opts.metrics_bind_address) == (healthz, metrics)
    assert parse_bind_address(opts.healthz_bind_address, "x") and parse_bind_address(opts.metrics_bind_address, "x")


def test_bind_address_flags_take_a_bare_ip_as_kube_proxys_do(tmp_path):
    """--metrics-bind-address 0.0.0.0 is 0.0.0.0:10249 (kube-proxy's flag appends its port too)."""
    opts = run_options(tmp_path, HEAD + "mode: nftables\n", "--metrics-bind-address", "0.0.0.0",
                       "--healthz-bind-address", "::1")
    assert (opts.healthz_bind_address, opts.metrics_bind_address) == ("[::1]:10256", "0.0.0.0:10249")
    opts = run_options(tmp_path, HEAD + "mode: nftables\n", "--metrics-bind-address", "10.0.0.5:9090")
    assert opts.metrics_bind_address == "10.0.0.5:9090"


@pytest.mark.parametrize("line,message", [
    ("healthzBindAddress: 0.0.0.0:0", "healthzBindAddress: port must be 1-65535, got '0.0.0.0:0'"),
    ("metricsBindAddress: localhost:10249", "metricsBindAddress: expected IP:port or an IP (port 10249), got"),
    ("metricsBindAddress: '[::1]'", "metricsBindAddress: expected IP:port or an IP (port 10249), got '[::1]'"),
    ("healthzBindAddress: ':10256'", "healthzBindAddress: expected IP:port or an IP (port 10256), got ':10256'"),
    ("bindAddress: all", "bindAddress: invalid IP address 'all'"),
])
def test_bad_bind_addresses_name_file_and_line(tmp_path, line, message):
    path = tmp_path / "kp.yaml"
    path.write_text(HEAD + line + "\n")
    with pytest.raises(InputError) as exc:
        load_kube_proxy_config(str(path))
    assert str(exc.value).startswith(f"{path}:3:1: {message}")


def test_nodeport_addresses_primary(tmp_path):
    """[primary] is kept as such: it becomes this node's IPs when the document is built."""
    assert run_options(tmp_path, HEAD + "nodePortAddresses: [primary]\n").nodeport_cidrs == ("primary",)
    opts = run_options(tmp_path, HEAD + "nodePortAddresses: [primary]\n", "--nodeport-addresses", "10.0.0.0/8")
    assert opts.nodeport_cidrs == ("10.0.0.0/8",)
    opts = run_options(tmp_path, HEAD + "nodePortAddresses: [10.0.0.0/8]\n", "--nodeport-addresses", "primary")
    assert opts.nodeport_cidrs == ("primary",)
    assert run_options(tmp_path, HEAD + "nodePortAddresses: []\n").nodeport_cidrs is None


def test_nodeport_addresses_primary_with_cidrs_is_refused(tmp_path):
    path = tmp_path / "kp.yaml"
    path.write_text(HEAD + "nodePortAddresses:\n- 10.0.0.0/8\n- primary\n")
    with pytest.raises(InputError) as exc:
        load_kube_proxy_config(str(path))
    assert str(exc.value) == f"{path}:5:3: nodePortAddresses[1]: can't use both 'primary' and CIDRs"
    with pytest.raises(ValueError, match=r"^--nodeport-addresses: can't use both 'primary' and CIDRs$"):
        options_from(build_parser().parse_args(["plan", "--source", "x", "--nodeport-addresses", "primary,::/0"]))


def test_kubeconfig_from_client_connection(tmp_path):
    text = HEAD + "clientConnection:\n  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf\n  qps: 0\n"
    assert run_options(tmp_path, text).kubeconfig == "/var/lib/kube-proxy/kubeconfig.conf"
    assert run_options(tmp_path, text, "--kubeconfig", "/etc/k.conf").kubeconfig == "/etc/k.conf"  # the flag wins
    assert run_options(tmp_path, HEAD).kubeconfig is None  # in-cluster


KUBEADM_ZEROS = HEAD + """mode: nftables
bindAddress: 0.0.0.0
configSyncPeriod: 0s
featureGates: {}
logging:
  flushFrequency: 0
  options:
    json:
      infoBufferSize: "0"
  verbosity: 0
oomScoreAdj: null
"""


def test_fields_not_used_are_warned_about_once_with_their_line(tmp_path, caplog):
    with caplog.at_level("WARNING"):
        run_options(tmp_path, KUBEADM_ZEROS)  # what kubeadm writes for the defaults: nothing to say
    assert caplog.text == ""
    text = (KUBEADM_ZEROS.replace("0.0.0.0", "10.0.0.5").replace("0s", "15m").replace("{}", "{Foo: true}")
            .replace("verbosity: 0", "verbosity: 4").replace("null", "-999"))
    with caplog.at_level("WARNING"):
        run_options(tmp_path, text)
    for where, key in ((5, "configSyncPeriod"), (6, "featureGates"), (7, "logging"), (13, "oomScoreAdj")):
        assert caplog.text.count(f"kp.yaml:{where}:1: {key}: not used") == 1, key
    assert "bindAddress" not in caplog.text  # (used: this node's IP of its family, see below)


@pytest.mark.parametrize("value,override", [("10.0.0.5", "10.0.0.5"), ("'010.000.000.005'", "10.0.0.5"),
                                            ("fd00::5", "fd00::5"), ("0.0.0.0", None), ("'::'", None), ("''", None)])
def test_bind_address_is_this_nodes_ip_of_its_family(tmp_path, caplog, value, override):
    """As kube-proxy's detectNodeIPs: a bindAddress that is no unspecified address overrides the
    node IP of its family (nodePortAddresses [primary], the loadBalancerSourceRanges exception)."""
    with caplog.at_level("WARNING"):
        opts = run_options(tmp_path, HEAD + f"bindAddress: {value}\n")
    assert opts.node_ip_override == override
    assert opts.build_options().node_ip_override == override
    # a loose spelling is read as kube-proxy reads it, with a warning at its place
    assert ("kp.yaml:3:1: bindAddress: '010.000.000.005' is read as 10.0.0.5" in caplog.text) == value.startswith("'010")


@pytest.mark.parametrize("text,message", [
    (HEAD + "clusterCIDR: 10.0.0.0\n", "3:1: clusterCIDR: invalid CIDR '10.0.0.0'"),
    (HEAD + "nodePortAddresses: [10.0.0.0/8, 10.0.0.0/33]\n", "3:33: nodePortAddresses[1]: invalid CIDR '10.0.0.0/33'"),
    (HEAD + "nodePortAddresses: 10.0.0.0/8\n", "3:1: nodePortAddresses: expected a list of CIDRs, or [primary]"),
    (HEAD + "bindAddressHardFail: 'true'\n", "3:1: bindAddressHardFail: expected true or false, got 'true'"),
    ("kind: KubeProxyConfiguration\napiVersion: kubeproxy.config.k8s.io/v1beta1\n",
     "2:1: apiVersion: expected kubeproxy.config.k8s.io/v1alpha1, got 'kubeproxy.config.k8s.io/v1beta1'"),
    ("apiVersion: kubeproxy.config.k8s.io/v1alpha1\n", "1:1: kind: is required (KubeProxyConfiguration)"),
    ("kind: KubeProxyConfiguration\nmode: nftables\n", "1:1: apiVersion: is required (kubeproxy.config.k8s.io/v1alpha1)"),
    # of the wrong type, however empty (kube-proxy's decoder refuses them; they were read as unset)
    (HEAD + "nodePortAddresses: ''\n", "3:1: nodePortAddresses: expected a list of CIDRs, or [primary]"),
    (HEAD + "nodePortAddresses: {}\n", "3:1: nodePortAddresses: expected a list of CIDRs, or [primary]"),
    (HEAD + "clusterCIDR: 0\n", "3:1: clusterCIDR: expected string, got integer"),
    (HEAD + "clusterCIDR: []\n", "3:1: clusterCIDR: expected string, got list"),
    (HEAD + "nftables: {syncPeriod: \"\uff13\uff10s\"}\n", "3:12: nftables.syncPeriod: invalid duration"),  # (３０s: Go's digits are ASCII)
])
def test_what_kube_proxy_refuses_is_refused_with_file_and_line(tmp_path, text, message):
    path = tmp_path / "kp.yaml"
    path.write_text(text)
    with pytest.raises(InputError) as exc:
        load_kube_proxy_config(str(path))
    assert str(exc.value).startswith(f"{path}:{message}")


def test_booleans_are_booleans(tmp_path):
    path = tmp_path / "kp.yaml"
    path.write_text(HEAD + "mode: iptables\niptables:\n  masqueradeAll: \"false\"\n")
    with pytest.raises(InputError) as exc:
        load_kube_proxy_config(str(path))
    assert str(exc.value) == f"{path}:5:3: iptables.masqueradeAll: expected true or false, got 'false'"
    # kube-proxy reads YAML 1.1: unquoted yes/no/on/off are booleans there (quoted, strings)
    path.write_text(HEAD + "mode: iptables\niptables:\n  masqueradeAll: yes\nbindAddressHardFail: off\n")
    assert {k: v for k, v in load_kube_proxy_config(str(path)).items()
            if k in ("masquerade_all", "bind_address_hard_fail")} == {"masquerade_all": True, "bind_address_hard_fail": False}
    path.write_text(HEAD + "conntrack:\n  tcpBeLiberal: on\n")
    assert load_kube_proxy_config(str(path))["conntrack_tcp_be_liberal"] is True
    path.write_text(HEAD + "bindAddressHardFail: 'yes'\n")
    with pytest.raises(InputError, match="bindAddressHardFail: expected true or false, got 'yes'"):
        load_kube_proxy_config(str(path))


def test_cidrs_are_read_as_kube_proxy_reads_them(tmp_path, caplog):
    """netutils.ParseCIDRSloppy, as the manifests are read: leading zeros are decimal (warned)."""
    with caplog.at_level("WARNING"):
        opts = run_options(tmp_path, HEAD + "clusterCIDR: 010.244.0.0/16\nnodePortAddresses: ['::ffff:10.0.0.0/104']\n")
    assert (opts.cluster_cidrs, opts.nodeport_cidrs) == (("10.244.0.0/16",), ("10.0.0.0/8",))
    assert "kp.yaml:3:1: clusterCIDR: '010.244.0.0/16' is read as 10.244.0.0/16 (leading zeros" in caplog.text
    assert "kp.yaml:4:21: nodePortAddresses[0]: '::ffff:10.0.0.0/104' is read as 10.0.0.0/8" in caplog.text
    # several of one family: more than kube-proxy takes (one, or a dual-stack pair), kept on purpose
    opts = run_options(tmp_path, HEAD + "clusterCIDR: 10.0.0.0/8,fd00::/48,10.1.0.0/16\n")
    assert opts.cluster_cidrs == ("10.0.0.0/8", "fd00::/48", "10.1.0.0/16")


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
    path.write_text(CONFIG + "conntrack:\n  max: 1000000\n  udpTimeout: 1500ms\n  udpTimout: 30s\n")
    with caplog.at_level("WARNING"):
        cfg = load_kube_proxy_config(str(path))
    assert cfg["conntrack_udp_timeout"] == 1.5 and "conntrack_max" not in cfg
    assert f"{path}:13:3: conntrack.max: not a field of KubeProxyConfiguration; ignored" in caplog.text
    assert f"{path}:15:3: conntrack.udpTimout: not a field of KubeProxyConfiguration (did you mean udpTimeout?)" \
        in caplog.text  # (a misspelt key: its setting stays at the default)
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


def test_a_misspelt_key_is_warned_about_at_its_line_with_the_field_it_probably_means(tmp_path, caplog):
    """A key that is no KubeProxyConfiguration field (a typo would leave its setting at the default
    without a word) gets a warning at file:line, naming the field meant; the rest is read."""
    text = ("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: nftables\n"
            "clusterCIDRs: 10.244.0.0/16\nnodePortAdresses: [primary]\nnftables:\n  masqueradeAl: true\n"
            "  syncPeriod: 5s\nclientConnection:\n  kubeconfg: /etc/kubeconfig\nfrobnicate: 1\n")
    with caplog.at_level("WARNING"):
        opts = run_options(tmp_path, text)
    assert opts.sync_period == 5 and not opts.masquerade_all and not opts.cluster_cidrs
    for where, key, meant in ((4, "clusterCIDRs", "clusterCIDR"), (5, "nodePortAdresses", "nodePortAddresses"),
                              ("7:3", "nftables.masqueradeAl", "masqueradeAll"),
                              ("10:3", "clientConnection.kubeconfg", "kubeconfig")):
        where = f"{where}:1" if isinstance(where, int) else where
        assert caplog.text.count(f"kp.yaml:{where}: {key}: not a field of KubeProxyConfiguration (did you mean "
                                 f"{meant}?); ignored") == 1, key
    assert "kp.yaml:11:1: frobnicate: not a field of KubeProxyConfiguration; ignored" in caplog.text
    assert "syncPeriod: not a field" not in caplog.text


@pytest.mark.parametrize("seconds, text", [
    (30, "30s"), (60, "1m0s"), (90.5, "1m30.5s"), (3600, "1h0m0s"), (86400, "24h0m0s"), (3725, "1h2m5s"),
    (0.2, "200ms"), (0.0015, "1.5ms"), (0.000002, "2µs"), (0, "0s"),
])
def test_durations_are_shown_as_go_prints_them(seconds, text):
    assert go_duration(seconds) == text
    assert parse_duration(text) == pytest.approx(seconds)


def test_configz_serves_the_configuration_in_effect_file_then_flags(tmp_path):
    """/configz on the metrics server, as kube-proxy's: its group name, then the fields of its
    internal KubeProxyConfiguration that we honour, as the file and the flags (which win) set them."""
    path = tmp_path / "kube-proxy.yaml"
    path.write_text("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: iptables\n"
                    "clusterCIDR: 10.244.0.0/16\nhostnameOverride: Node-B\nnodePortAddresses: [192.168.0.0/16]\n"
                    "iptables: {syncPeriod: 1m, minSyncPeriod: 2s, masqueradeAll: true}\n"
                    "conntrack: {maxPerCore: 0, tcpEstablishedTimeout: 2h}\n")
    opts = options_from(build_parser().parse_args(["run", "--source", "x", "--config", str(path),
                                                   "--min-sync-period", "500ms", "--cluster-cidr", "10.8.0.0/14"]))
    registry = CollectorRegistry()
    srv = start_metrics_server("127.0.0.1:0", registry, opts.mode, configz(opts))
    assert srv is not None
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/configz", timeout=5) as resp:
            assert resp.headers["Content-Type"] == "application/json"
            doc = json.load(resp)
    finally:
        srv.close()
    (group, conf), = doc.items()
    assert group == "kubeproxy.config.k8s.io"
    assert conf["Mode"] == "iptables" and conf["HostnameOverride"] == "node-b"
    assert conf["SyncPeriod"] == "1m0s" and conf["MinSyncPeriod"] == "500ms"  # (the flag over the file)
    assert conf["DetectLocal"] == {"ClusterCIDRs": ["10.8.0.0/14"]}
    assert conf["NodePortAddresses"] == ["192.168.0.0/16"]
    assert conf["Linux"]["MasqueradeAll"] is True
    assert conf["Linux"]["Conntrack"]["MaxPerCore"] == 0
    assert conf["Linux"]["Conntrack"]["TCPEstablishedTimeout"] == "2h0m0s"
    assert conf["Linux"]["Conntrack"]["TCPCloseWaitTimeout"] == "1h0m0s"  # (kube-proxy's default)
    assert conf["MetricsBindAddress"] == "127.0.0.1:10249"
    assert conf["BindAddress"] == "0.0.0.0"  # (kube-proxy's default)
    path.write_text(path.read_text() + "bindAddress: '::'\n")
    opts = options_from(build_parser().parse_args(["run", "--source", "x", "--config", str(path)]))
    conf = configz(opts)["kubeproxy.config.k8s.io"]
    assert conf["BindAddress"] == "::" and conf["HealthzBindAddress"] == "[::]:10256"


# --------------------------------------------------------------------------- its schema

def _config_schema():
    import jsonschema

    from helpers import REPO
    with open(f"{REPO}/schemas/kube-proxy-config.schema.json") as fh:
        return jsonschema.Draft202012Validator(json.load(fh))


def test_the_config_schema_names_every_field_the_loader_knows_and_no_other():
    from reconciler.config import CONNTRACK_KEYS, SECTION_FIELDS, TOP_FIELDS
    schema = _config_schema().schema
    assert set(schema["properties"]) == TOP_FIELDS
    for section in ("clientConnection",):
        assert set(schema["properties"][section]["properties"]) == SECTION_FIELDS[section]
    mode = set(schema["$defs"]["modeSection"]["properties"])
    assert mode | set(schema["properties"]["iptables"].get("properties", {})) == SECTION_FIELDS["iptables"]
    assert mode == SECTION_FIELDS["nftables"]
    assert set(schema["$defs"]["conntrack"]["properties"]) == set(CONNTRACK_KEYS)


HEAD = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"


@pytest.mark.parametrize("body", [
    "",  # (every field unset)
    CONFIG.removeprefix(HEAD),
    "mode: nftables\nnodePortAddresses: [primary]\nnftables: {syncPeriod: 1m30s, minSyncPeriod: 0}\n",
    "mode: ''\nnodePortAddresses: []\nbindAddress: '::'\nhealthzBindAddress: '[::]:10256'\nmetricsBindAddress: 127.0.0.1\n",
    "bindAddressHardFail: yes\niptables: {masqueradeAll: off, localhostNodePorts: true, masqueradeBit: 14}\n",
    "conntrack: {maxPerCore: 0, min: 131072, tcpEstablishedTimeout: 24h0m0s, tcpBeLiberal: true, udpTimeout: 0s}\n",
    "clientConnection: {kubeconfig: /etc/kubeconfig, qps: 5}\nhostnameOverride: ''\nfeatureGates: {}\n",
    "conntrack:\nnftables:\nclusterCIDR:\nipvs: {scheduler: rr}\ndetectLocalMode: ClusterCIDR\n",
    "nftables: {syncPeriod: -0s, minSyncPeriod: '0'}\nbindAddress: fd00::5\nhealthzBindAddress: '[fd00::5]:10256'\n",
    "iptables: {syncPeriod: 1m, minSyncPeriod: 2m, masqueradeBit: 14, localhostNodePorts: false}\n"  # (not run: types only)
    "enableProfiling: false\nclientConnection: {qps: 5.5, burst: 10, contentType: application/json}\n"
    "winkernel: {}\ndetectLocal: {bridgeInterface: ''}\noomScoreAdj: -999\nconfigSyncPeriod: 15m\nportRange: ''\n",
])
def test_what_the_loader_takes_without_a_word_the_config_schema_takes(tmp_path, caplog, body):
    from ruamel.yaml import YAML
    path = tmp_path / "c.yaml"
    path.write_text(HEAD + body)
    with caplog.at_level("WARNING"):
        load_kube_proxy_config(str(path), mode="nftables")
    assert "not a field" not in caplog.text
    errors = [e.message for e in _config_schema().iter_errors(YAML(typ="safe").load(path.read_text()))]
    assert errors == []


@pytest.mark.parametrize("body", [
    "mode: ipvs\n", "hostnameOverride: '  '\n", "hostnameOverride: 5\n", "bindAddressHardFail: 'maybe'\n",
    "nodePortAddresses: [primary, 10.0.0.0/8]\n", "nodePortAddresses: 10.0.0.0/8\n",
    "nftables: {syncPeriod: 30}\n", "nftables: {syncPeriod: -30s}\n", "nftables: {masqueradeAll: 'false'}\n",
    "nftables: []\n", "conntrack: {maxPerCore: -1}\n", "conntrack: {min: 4294967296}\n",
    "conntrack: {udpTimeout: 5 minutes}\n", "conntrack: {tcpBeLiberal: 1}\n", "clientConnection: /etc/kc\n",
    "healthzBindAddress: localhost:10256\n", "metricsBindAddress: 5\n", "healthzBindAddress: '[::1]'\n",
    "bindAddress: 10.0.0.1:80\n", "nodePortAddresses: [10.0.0.1]\n", "clusterCIDR: 0\n", "nodePortAddresses: ''\n",
    # the fields not used here, the section of the mode not run: their types, as kube-proxy's decoder has them
    "enableProfiling: 'true'\n", "clientConnection: {qps: '5'}\n", "clientConnection: {burst: 1.5}\n",
    "ipvs: x\n", "featureGates: []\n", "oomScoreAdj: '0'\n", "detectLocalMode: false\n", "configSyncPeriod: 5\n",
    "iptables: {syncPeriod: 30}\n", "iptables: foo\n", "iptables: {masqueradeAll: 'true'}\n",
    "iptables: {localhostNodePorts: 'true'}\n", "nftables: {masqueradeBit: '14'}\n", "configSyncPeriod: 1 day\n",
    "configSyncPeriod: false\n", "iptables: {minSyncPeriod: false}\n",
    # what the loader warns about as no field of its place: refused by the schema, which editors flag
    "sycnPeriod: 30s\n", "nftables: {localhostNodePorts: true}\n", "conntrack: {maxPerCPU: 1}\n",
    "clientConnection: {kubeConfig: /etc/kc}\n",
])
def test_what_the_loader_refuses_or_says_is_no_field_the_config_schema_refuses(tmp_path, caplog, body):
    from ruamel.yaml import YAML
    path = tmp_path / "c.yaml"
    path.write_text(HEAD + body)
    with caplog.at_level("WARNING"):
        try:
            load_kube_proxy_config(str(path), mode="nftables")
        except InputError:
            pass
        else:
            assert "not a field" in caplog.text
    assert list(_config_schema().iter_errors(YAML(typ="safe").load(path.read_text())))


def test_configz_is_the_answer_its_schema_describes(tmp_path):
    import jsonschema

    from helpers import REPO
    with open(f"{REPO}/schemas/http-answers.schema.json") as fh:
        schema = json.load(fh)
    validator = jsonschema.Draft202012Validator({**schema, "anyOf": [{"$ref": "#/$defs/configz"}]})
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG)
    for argv in (["run", "--source", "x", "--node-name", "n"],
                 ["run", "--source", "x", "--config", str(path), "--nodeport-addresses", "primary",
                  "--conntrack-tcp-timeout-established", "90m"]):
        body = configz(options_from(build_parser().parse_args(argv)))
        validator.validate(json.loads(json.dumps(body)))
    assert not validator.is_valid({"kubeproxy.config.k8s.io": {**body["kubeproxy.config.k8s.io"], "Mode": "ipvs"}})


def test_a_loose_spelling_of_a_bind_address_is_read_as_kube_proxy_reads_it_with_a_warning(tmp_path, caplog):
    with caplog.at_level("WARNING"):
        opts = run_options(tmp_path, HEAD + "healthzBindAddress: 010.0.0.5:10256\nmetricsBindAddress: '::ffff:127.0.0.1'\n")
    assert (opts.healthz_bind_address, opts.metrics_bind_address) == ("10.0.0.5:10256", "127.0.0.1:10249")
    assert "kp.yaml:3:1: healthzBindAddress: '010.0.0.5:10256' is read as 10.0.0.5:10256" in caplog.text
    assert "kp.yaml:4:1: metricsBindAddress: '::ffff:127.0.0.1' is read as 127.0.0.1:10249" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        opts = options_from(build_parser().parse_args(["run", "--source", "x", "--node-name", "n",
                                                       "--healthz-bind-address", "010.0.0.5"]))
    assert opts.healthz_bind_address == "10.0.0.5:10256"
    assert "--healthz-bind-address: '010.0.0.5' is read as 10.0.0.5:10256" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        run_options(tmp_path, HEAD + "healthzBindAddress: 10.0.0.5:10256\nmetricsBindAddress: 127.0.0.1\n")
    assert "is read as" not in caplog.text  # (the usual spellings: nothing to say)


def test_the_types_of_the_run_sections_fields_not_used_are_checked_too(tmp_path):
    path = tmp_path / "kp.yaml"
    path.write_text(HEAD + "mode: iptables\niptables: {localhostNodePorts: 'true'}\n")
    with pytest.raises(InputError, match="iptables.localhostNodePorts: expected true or false"):
        load_kube_proxy_config(str(path))
    path.write_text(HEAD + "mode: iptables\niptables: {localhostNodePorts: false, masqueradeAll: true}\n")
    assert load_kube_proxy_config(str(path))["masquerade_all"] is True
