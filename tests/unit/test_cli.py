"""The command line's own output: what it prints around the pipeline's results."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from helpers import STATE_DIR

from reconciler.cli import _dump, main


def test_an_input_error_of_a_command_that_never_changes_the_kernel_does_not_say_it_did_not(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bad.yaml").write_text("apiVersion: v1\nkind: Service\nmetadata: {name: web}\nspec:\n  clusterIP: 10.96.0.5\n  ports: 5\n")
    assert main(["validate", "--source", str(tmp_path), "--node-name", "node-a"]) == 1
    err = capsys.readouterr().err
    assert "bad.yaml:6:3: spec.ports: expected list" in err and err.rstrip().endswith("\n1 error(s)")
    (tmp_path / "api.yaml").write_text("apiVersion: v1\nkind: Service\nmetadata: {name: api}\nspec:\n"
                                       "  clusterIP: 10.96.0.6\n  ports: [{port: 80}]\n  sessionAfinity: ClientIP\n")
    assert main(["validate", "--source", str(tmp_path), "--node-name", "node-a"]) == 1
    assert capsys.readouterr().err.rstrip().endswith("\n1 error(s), 1 warning(s)")  # (the warnings counted too)


def test_yaml_output_keeps_a_long_rule_on_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    rule = "meta l4proto tcp " * 12 + "dnat to 10.244.1.5:8080"
    _dump({"rules": [rule]}, "yaml")
    assert f"- {rule}\n" in capsys.readouterr().out


def test_validate_strict_fails_on_any_warning_and_prints_it(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             caplog: pytest.LogCaptureFixture) -> None:
    svc = ("apiVersion: v1\nkind: Service\nmetadata: {name: web}\nspec:\n  clusterIP: 10.96.0.5\n"
           "  ports: [{port: 80}]\n  sessionAfinity: ClientIP\n")
    (tmp_path / "web.yaml").write_text(svc)
    args = ["validate", "--source", str(tmp_path), "--node-name", "node-a"]
    warning = "web.yaml:7:3: spec.sessionAfinity: unknown field of ServiceSpec"
    assert main(args) == 0  # (a warning alone: valid)
    assert warning in caplog.text and capsys.readouterr().out == f"{tmp_path}: valid (1 service port, 1 warning(s))\n"
    caplog.clear()
    assert main([*args, "--strict"]) == 1
    assert warning in caplog.text  # (printed all the same)
    out, err = capsys.readouterr()
    assert out == "" and err == f"{tmp_path}: 1 warning(s), which --strict makes errors\n"
    caplog.clear()
    (tmp_path / "web.yaml").write_text(svc.replace("sessionAfinity", "sessionAffinity"))
    assert main([*args, "--strict"]) == 0 and not caplog.text
    (tmp_path / "node.yaml").write_text("apiVersion: v1\nkind: Node\nmetadata: {name: node-b}\n")
    assert main([*args, "--strict"]) == 1  # (no Node of this node's name)
    assert 'no Node "node-a" in the input (it has: node-b)' in caplog.text


@pytest.mark.parametrize("command", ["observe", "cleanup"])
def test_commands_that_build_no_desired_state_refuse_its_flags(command: str, capsys: pytest.CaptureFixture[str]
                                                               ) -> None:
    """observe and cleanup only read or remove the kernel's objects: a --node-name or --cluster-cidr
    given to them would be silently unused, so it is a usage error (exit 1), before any kernel work."""
    for flag in ("--node-name", "--cluster-cidr", "--service-cidr", "--nodeport-addresses"):
        with pytest.raises(SystemExit) as exc:
            main([command, flag, "x"])
        assert exc.value.code == 1
        assert f"unrecognized arguments: {flag} x" in capsys.readouterr().err


def _diagnostics_schema() -> dict[str, Any]:
    return json.loads((Path(__file__).parents[2] / "schemas" / "diagnostics.schema.json").read_text())


def test_json_output_of_bad_input_is_a_diagnostics_document(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """-o json on bad input: the errors and warnings as data on stdout (file, line, column, field,
    message: for CI annotations), exit 1, and the same errors as text on stderr."""
    (tmp_path / "web.yaml").write_text(
        "apiVersion: v1\nkind: Service\nmetadata: {name: web}\nspec:\n  clusterIP: 10.96.0.5\n"
        "  ports: [{port: 80, nodePort: 22}]\n  type: NodePort\n  sessionAfinity: ClientIP\n")
    args = ["--source", str(tmp_path), "--node-name", "node-a", "-o", "json"]
    assert main(["validate", *args]) == 0
    doc = json.loads(capsys.readouterr().out)
    jsonschema.validate(doc, _diagnostics_schema())
    assert doc["valid"] and doc["servicePorts"] == 1 and doc["errors"] == []
    assert {"file": str(tmp_path / "web.yaml"), "line": 8, "column": 3, "field": "spec.sessionAfinity",
            "message": "unknown field of ServiceSpec, ignored (did you mean sessionAffinity?); kubectl's strict field "
                       "validation would refuse it"} in doc["warnings"]
    assert any(w.get("field") == "spec.ports[0].nodePort" and w["line"] == 6 for w in doc["warnings"])
    assert main(["validate", *args, "--strict"]) == 1
    assert json.loads(capsys.readouterr().out)["valid"] is False

    (tmp_path / "bad.yaml").write_text("apiVersion: v1\nkind: Service\nmetadata: {name: db}\nspec:\n"
                                       "  clusterIP: 10.96.0.6\n  ports: [{port: 70000}]\n")
    for command in ("validate", "render"):
        assert main([command, *args]) == 1
        out, err = capsys.readouterr()
        doc = json.loads(out)
        jsonschema.validate(doc, _diagnostics_schema())
        assert doc["valid"] is False and doc["errors"] == [
            {"file": str(tmp_path / "bad.yaml"), "line": 6, "column": 12, "field": "spec.ports[0].port",
             "message": "port 70000 out of range 1-65535"}]
        assert "bad.yaml:6:12: spec.ports[0].port: port 70000 out of range" in err
        # the warnings found beside the errors are shown too (fixing the errors should not hide them)
        assert any(w.get("field") == "spec.sessionAfinity" for w in doc["warnings"])
        assert "web.yaml:8:3: spec.sessionAfinity: unknown field" in caplog.text
        caplog.clear()
    (tmp_path / "broken.yaml").write_text("kind: [\n")  # (a file that does not parse: the others are read all the same)
    assert main(["validate", *args]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert [e["file"] for e in doc["errors"]] == [str(tmp_path / "bad.yaml"), str(tmp_path / "broken.yaml")]
    assert any(w.get("field") == "spec.sessionAfinity" for w in doc["warnings"])


def test_every_error_of_one_object_is_reported_in_line_order(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                             ) -> None:
    """After an error in one part of an object (a port, an address, a field) the other parts are
    still read: one run shows all that is wrong with it, as the API server's validation does."""
    (tmp_path / "web.yaml").write_text("""apiVersion: v1
kind: Service
metadata: {name: web}
spec:
  clusterIP: 10.96.0.600
  externalIPs: [192.0.2.1, nope]
  sessionAffinity: Sticky
  ports:
    - {name: http, port: 99999}
    - {name: https, port: "443", protocol: tcp}
    - {name: dns, port: 53}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 0x}]
endpoints:
  - addresses: [10.244.1.5]
  - addresses: [10.244.1.600]
    conditions: {ready: 1}
  - addresses: [10.244.1.7]
    conditions: {ready: yes}
""")
    assert main(["validate", "--source", str(tmp_path), "--node-name", "node-a", "-o", "json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert [(e["line"], e["field"]) for e in doc["errors"]] == [
        (5, "spec.clusterIP"), (6, "spec.externalIPs[1]"), (7, "spec.sessionAffinity"), (9, "spec.ports[0].port"),
        (10, "spec.ports[1].port"), (10, "spec.ports[1].protocol"),  # (each field of one port)
        (17, "ports[0].port"), (20, "endpoints[1].addresses[0]"), (21, "endpoints[1].conditions.ready"),
        (23, "endpoints[2].conditions.ready")]


def test_config_file_warnings_carry_their_place_in_json_in_line_order(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """validate -o json (a CI job's annotations): the --config file's warnings have file, line and
    column as the manifests' do, and come in the order of file and line."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "web.yaml").write_text("apiVersion: v1\nkind: Service\nmetadata: {name: web}\nspec:\n"
                                             "  clusterIP: 10.96.0.5\n  ports: [{port: 80}]\n")
    config = tmp_path / "config.yaml"
    config.write_text("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
                      "syncPeriod: 10s\nnftables:\n  syncPerod: 5s\noomScoreAdj: -999\ndetectLocalMode: NodeCIDR\n"
                      "nftables2: {}\nclusterCIDR: 010.244.0.0/16\nnodePortAddresses: [10.0.0.0/8, 192.168.001.0/24]\n"
                      "conntrack: {udpTimeout: 1.5s}\n")
    assert main(["validate", "--source", str(tmp_path / "m"), "--node-name", "node-a", "--config", str(config),
                 "-o", "json"]) == 0
    warnings = json.loads(capsys.readouterr().out)["warnings"]
    assert [(w["file"], w["line"]) for w in warnings] == [(str(config), n) for n in (1, 3, 5, 6, 7, 8, 9, 10, 11)]
    assert warnings[0]["message"].startswith("not set") and warnings[0]["field"] == "mode"
    assert all(w.get("field") for w in warnings)  # (each names its field)
    # (a value's spelling too: its place, field and column, not only in the message)
    assert [(w["column"], w["field"], w["message"].split(" ")[0]) for w in warnings[-3:]] == [
        (1, "clusterCIDR", "'010.244.0.0/16'"), (33, "nodePortAddresses[1]", "'192.168.001.0/24'"),
        (13, "conntrack.udpTimeout", "1.5s")]


def test_a_bad_duration_names_its_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for flag in ("--sync-period", "--min-sync-period"):
        assert main(["run", "--source", str(tmp_path), flag, "30"]) == 1
        assert f"error: {flag}: invalid duration '30'" in capsys.readouterr().err


def test_a_source_without_any_object_is_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A wrong --source (an empty folder, one of other YAML): applied, it would remove every
    service port, so validate and plan say so; validate --strict fails."""
    (tmp_path / "values.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    args = ["validate", "--source", str(tmp_path), "--node-name", "node-a"]
    assert main(args) == 0
    assert f"{tmp_path}: no Service or EndpointSlice in it" in caplog.text
    assert main([*args, "--strict"]) == 1
    caplog.clear()
    (tmp_path / "web.yaml").write_text("apiVersion: v1\nkind: Service\nmetadata: {name: web}\nspec:\n"
                                       "  clusterIP: 10.96.0.5\n  ports: [{port: 80}]\n")
    assert main(args) == 0 and "no Service" not in caplog.text


def test_apply_and_cleanup_say_that_a_running_run_will_put_its_state_back(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]) -> None:
    import reconciler.cli as cli
    from reconciler import instance_lock

    class Empty:  # (never this host's kernel)
        def cleanup(self, look_first: bool = False) -> list:
            return []

        def apply(self, ops: list) -> list:
            return []

    monkeypatch.setattr(cli, "get_backend", lambda mode: Empty())
    monkeypatch.setattr(instance_lock, "holder", lambda lock_dir=None: "4242")
    assert main(["cleanup", "--mode", "nftables"]) == 0
    assert "a `reconciler run` (pid 4242) programs this network namespace: it puts back what its own source " \
           "wants at its next resync" in caplog.text
    caplog.clear()
    monkeypatch.setattr(instance_lock, "holder", lambda lock_dir=None: None)
    assert main(["cleanup", "--mode", "nftables"]) == 0 and "reconciler run" not in caplog.text
    assert "cleanup (nftables): nothing of ours to remove" in capsys.readouterr().out


def test_apply_takes_a_source_or_a_saved_plan_and_nothing_a_plan_was_made_with(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = tmp_path / "plan.json"
    saved.write_text(json.dumps({"mode": "nftables", "operations": [], "counts": {"operations": 0}}))
    assert main(["apply"]) == 1
    assert "apply: give --source DIR, or --plan FILE (a saved plan), not both" in capsys.readouterr().err
    assert main(["apply", "--plan", str(saved), "--source", str(tmp_path)]) == 1
    assert main(["apply", "--plan", str(saved), "--cluster-cidr", "10.244.0.0/16"]) == 1
    assert "apply --plan: the plan was made with its own settings; --cluster-cidr is not taken" in capsys.readouterr().err
    assert main(["apply", "--plan", str(saved), "--read-back"]) == 1
    assert "--read-back is not taken" in capsys.readouterr().err
    assert main(["apply", "--plan", str(saved), "--mode", "iptables"]) == 1
    assert "a plan of nftables mode, not iptables" in capsys.readouterr().err
    saved.write_text("{not json")
    assert main(["apply", "--plan", str(saved)]) == 1
    assert f"{saved}: not a plan of `reconciler plan -o json`" in capsys.readouterr().err


LIBRARY_DEBUG = """
import logging, sys
import pyroute2.netlink.core  # (pyroute2 sets its loggers' levels when imported)
from reconciler import cli

def dispatch(args, warned):
    logging.getLogger("pyroute2.netlink.core").debug("LIBRARY-DEBUG")
    logging.getLogger("asyncio").debug("ASYNCIO-DEBUG")
    logging.getLogger("pyroute2.netlink.core").warning("LIBRARY-WARNING")
    logging.getLogger("reconciler.backends").debug("OURS-DEBUG")
    return 0

cli._dispatch = dispatch
sys.exit(cli.main(["validate", "--source", "state", "-v"]))
"""


def test_verbose_is_our_debug_output_not_the_libraries(tmp_path: Path) -> None:
    """-v: our debug lines; a library's only from warnings up (pyroute2 logged every netlink
    message of each generation read)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", LIBRARY_DEBUG], cwd=root, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "OURS-DEBUG" in proc.stderr and "LIBRARY-WARNING" in proc.stderr
    assert "LIBRARY-DEBUG" not in proc.stderr and "ASYNCIO-DEBUG" not in proc.stderr


def test_the_daemons_verbose_log_is_ours_not_the_libraries() -> None:
    import io
    import logging

    from reconciler.daemon import setup_logging

    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    stream = io.StringIO()
    try:
        setup_logging("text", verbose=True, stream=stream)
        logging.getLogger("pyroute2").setLevel(logging.NOTSET)  # (as pyroute2 does when imported)
        logging.getLogger("pyroute2.netlink.nlsocket").debug("LIBRARY-DEBUG")
        logging.getLogger("urllib3.connectionpool").warning("RETRYING")
        logging.getLogger("reconciler.daemon").debug("OURS-DEBUG")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    text = stream.getvalue()
    assert "OURS-DEBUG" in text and "LIBRARY-DEBUG" not in text and "RETRYING" not in text


@pytest.mark.parametrize("cidrs", ["0.0.0.0/0", "10.96.0.0/16,::/0"])
def test_a_service_cidr_of_every_address_is_refused(cidrs: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Traffic to an address of a service CIDR that is no ClusterIP is dropped: a /0 would cut the
    node off, so it is an error before anything is read or programmed."""
    assert main(["render", "--source", STATE_DIR, "--node-name", "node-a", "--service-cidr", cidrs]) == 1
    err = capsys.readouterr().err
    assert "--service-cidr: " in err and "/0 is every address" in err
    assert main(["render", "--source", STATE_DIR, "--node-name", "node-a", "--service-cidr", "10.96.0.0/16,fd00:96::/64"]) == 0


def test_node_name_is_trimmed_and_lower_cased_and_never_blank(capsys: pytest.CaptureFixture[str]) -> None:
    """As kube-proxy takes --hostname-override (TrimSpace, ToLower; blank is an error): a name with
    a stray space, from a templated flag, still finds its Node and its local endpoints."""
    args = ["render", "--source", STATE_DIR, "--service-cidr", "10.96.0.0/16,fd00:96::/64", "-o", "json"]
    assert main(args + ["--node-name", "node-a"]) == 0
    plain = capsys.readouterr()
    assert main(args + ["--node-name", " Node-A\n"]) == 0
    spaced = capsys.readouterr()
    assert spaced.out == plain.out and "no Node" not in spaced.err
    assert main(args + ["--node-name", "  "]) == 1
    assert "--node-name: blank" in capsys.readouterr().err
    assert main(args + ["--node-name", ""]) == 0  # (an unset variable: not given, the hostname then)


def _saved_plan(tmp_path: Path, mode: str, edit: Any = None) -> str:
    """A plan of the example state against an empty kernel, as `plan -o json` writes it (made
    here without reading any kernel), optionally edited; its path."""
    from reconciler.backends import get_backend
    from reconciler.desired import BuildOptions, build_desired_state
    from reconciler.plan import Plan
    from reconciler.sources.manifests import load_directory

    backend = get_backend(mode)
    desired = build_desired_state(load_directory(STATE_DIR).objects, BuildOptions("node-a", ("10.244.0.0/16",)))
    want = backend.render(desired)
    doc = json.loads(Plan(mode, "node-a", operations=backend.diff(want, type(want)())).to_json())
    doc["observedGeneration"] = 7
    if edit is not None:
        edit(doc)
    path = tmp_path / f"{mode}.json"
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.mark.parametrize("mode", ["nftables", "iptables"])
def test_a_saved_plan_is_checked_whole_before_anything_is_applied(
        mode: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`apply --plan FILE` runs a file, which may have been edited: every operation must be one
    the backend makes, on objects of ours, and the document one `plan -o json` writes; else
    nothing is applied and the error says which operation and why (an added `delete table inet
    theirs` was run, and an otherMode count that split the operations wrongly half-applied them)."""
    from reconciler.cli import _check_saved_plan
    from reconciler.backends.base import Operation

    good = json.loads(Path(_saved_plan(tmp_path, mode)).read_text())
    ops = [Operation(o["action"], o["kind"], o["object"], o["command"], o.get("service")) for o in good["operations"]]
    assert len(ops) > 50 and _check_saved_plan(mode, ops, None, 7) == 0  # (every operation a real plan has passes)
    theirs = ({"action": "-", "kind": "table", "object": "inet theirs", "command": "delete table inet theirs"}
              if mode == "nftables" else
              {"action": "-", "kind": "chain", "object": "iptables nat THEIRS", "command": "-X THEIRS"})
    sneaky = ({"action": "+", "kind": "rule", "object": "ip reconciler chain x",
               "command": "add rule ip reconciler x accept; delete table inet theirs"}
              if mode == "nftables" else  # (our comment on a rule of the host's own: not one of our jumps)
              {"action": "+", "kind": "rule", "object": "iptables filter INPUT",
               "command": '-I INPUT 1 -p tcp -m tcp --dport 22 -m comment --comment "service-reconciler x" -j DROP'})
    edits = {
        "a foreign object": (lambda d: d["operations"].append(theirs), "is not ours"),
        "a second command": (lambda d: d["operations"].append(sneaky), "operations["),
        "an unknown action": (lambda d: d["operations"][0].update(action="?"), "is not an operation"),
        "otherMode too many": (lambda d: d.update(otherMode={"mode": "iptables" if mode == "nftables" else "nftables",
                                                             "operations": 100000}), "otherMode"),
        "otherMode of its own mode": (lambda d: d.update(otherMode={"mode": mode, "operations": 1}), "otherMode"),
        "otherMode splitting ours": (lambda d: d.update(otherMode={"mode": "iptables" if mode == "nftables"
                                                                   else "nftables", "operations": 1}), "operations["),
        "a generation as text": (lambda d: d.update(observedGeneration="7"), "observedGeneration"),
        "cut short": (lambda d: d["operations"].pop(), "counts say"),
        "another kind of command": (lambda d: d["operations"].append(
            {**_first(d, "rule"), "command": "delete table ip reconciler" if mode == "nftables"
             else f"-X {_first(d, 'rule')['object'].split()[-1]}"}), "is not made as"),
        "a rule added as a removal": (lambda d: d["operations"].append({**_first(d, "rule"), "action": "-"}),
                                      "is not made as"),
    }
    if mode == "nftables":  # (the operation's own table, but another object of it)
        edits["a chain of another name"] = (lambda d: d["operations"].append(
            {**_first(d, "chain"), "command": "add chain ip reconciler evil { type filter hook input priority -500; "
                                              "policy drop; }"}), "its command is about ip reconciler chain evil")
    if mode == "iptables":  # (rules that jump to ours, but not where or as our jumps are)
        edits["a rule of somebody else's chain"] = (lambda d: d["operations"].append(
            {"action": "-", "kind": "rule", "object": "iptables filter CALICO-X",
             "command": '-D CALICO-X -m comment --comment "service-reconciler x" -j RECONCILER-FILTER'}), "not ours")
        edits["one of our jumps, not first"] = (lambda d: d["operations"].append(
            {"action": "+", "kind": "rule", "object": "iptables nat PREROUTING",
             "command": '-I PREROUTING 7 -m comment --comment "service-reconciler service portals" '
                        '-j RECONCILER-SERVICES'}), "inserted first")
    for what, (edit, said) in edits.items():
        assert main(["apply", "--plan", _saved_plan(tmp_path, mode, edit)]) == 1, what
        err = capsys.readouterr().err
        assert said in err and "nothing applied" in err, (what, err)
    (tmp_path / "latin.json").write_bytes(b'{"mode": "nftables", "node": "caf\xe9"}')
    assert main(["apply", "--plan", str(tmp_path / "latin.json")]) == 1
    assert f"{tmp_path / 'latin.json'}: cannot read it: 'utf-8' codec" in capsys.readouterr().err


def _first(doc: dict[str, Any], kind: str) -> dict[str, Any]:
    """A saved plan's first operation of this kind (on an IPv4 object, for nftables)."""
    return next(o for o in doc["operations"] if o["kind"] == kind and not o["object"].startswith("ip6 "))


@pytest.mark.parametrize("mode", ["nftables", "iptables"])
def test_every_operation_of_a_plan_that_changes_or_removes_passes_the_saved_plan_check(mode: str) -> None:
    """The check of a saved plan's operations (the command of the kind, action and object the
    operation names) takes every operation diff() makes: flushes, deletions, changed elements
    and rules, not only those of a first apply."""
    from reconciler.backends import get_backend
    from reconciler.cli import _check_saved_plan
    from reconciler.desired import BuildOptions, build_desired_state
    from reconciler.sources.manifests import load_directory
    backend = get_backend(mode)
    objects = load_directory(STATE_DIR).objects
    before = backend.render(build_desired_state(objects, BuildOptions("node-a", ("10.244.0.0/16",))))
    after = backend.render(build_desired_state(objects[: len(objects) // 2],
                                               BuildOptions("node-b", ("10.244.0.0/16",), masquerade_all=True)))
    for want, have in ((after, before), (type(before)(), before)):
        ops = backend.diff(want, have)
        assert {o.action for o in ops} >= ({"-", "+", "~"} if want is after else {"-"}), {o.action for o in ops}
        assert _check_saved_plan(mode, ops, None, 7) == 0


def _many_services(directory: Path, count: int) -> None:
    for i in range(count):
        (directory / f"svc{i}.yaml").write_text(
            f"apiVersion: v1\nkind: Service\nmetadata: {{name: svc{i}, namespace: default}}\n"
            f"spec:\n  clusterIP: 10.96.{i // 250}.{i % 250 + 1}\n  ports: [{{name: http, port: 80}}]\n"
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n"
            f"metadata: {{name: svc{i}-a, namespace: default, labels: {{kubernetes.io/service-name: svc{i}}}}}\n"
            "addressType: IPv4\nports: [{name: http, port: 8080}]\n"
            f"endpoints: [{{addresses: [10.244.{i // 250}.{i % 250 + 1}], conditions: {{ready: true}}}}]\n")


def test_the_command_ends_a_one_shot_command_with_all_its_output_and_its_exit_code(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """console() ends a one-shot command without freeing what it built: everything printed still
    arrives (more than a pipe holds), the exit code is main()'s, and a reader that goes away early
    gets no complaint on stderr."""
    import subprocess
    import sys
    _many_services(tmp_path, 300)
    argv = ["render", "--source", str(tmp_path), "--node-name", "node-a", "-o", "json"]
    assert main(argv) == 0
    expected = capsys.readouterr().out
    assert len(expected) > 1 << 17  # (twice a pipe's buffer)
    proc = subprocess.run([sys.executable, "-m", "reconciler", *argv], capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout) == (0, expected)
    (tmp_path / "bad.yaml").write_text("apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec: {ports: 5}\n")
    proc = subprocess.run([sys.executable, "-m", "reconciler", "validate", "--source", str(tmp_path), "--node-name",
                           "node-a"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "bad.yaml:4:8: spec.ports: expected list" in proc.stderr
    (tmp_path / "bad.yaml").unlink()
    with subprocess.Popen([sys.executable, "-m", "reconciler", *argv], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE) as reader:
        assert reader.stdout is not None and reader.stderr is not None
        assert reader.stdout.read(10) == expected[:10].encode()
        reader.stdout.close()  # (gone before the rest is written)
        err = reader.stderr.read().decode()
        assert reader.wait(timeout=120) == 1
    assert "Traceback" not in err and "Exception ignored" not in err and "BrokenPipe" not in err, err
    (tmp_path / "few").mkdir()
    _many_services(tmp_path / "few", 1)  # (output that waits in the buffer for the end's flush)
    buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    with subprocess.Popen([sys.executable, "-m", "reconciler", "render", "--source", str(tmp_path / "few"),
                           "--node-name", "node-a", "-o", "json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          env=buffered) as reader:
        assert reader.stdout is not None and reader.stderr is not None
        reader.stdout.close()  # (gone before anything is written)
        err = reader.stderr.read().decode()
        assert reader.wait(timeout=120) == 1
    assert "Traceback" not in err and "Exception ignored" not in err and "BrokenPipe" not in err, err
    argv = [sys.executable, "-m", "reconciler", "validate", "--source", str(tmp_path / "few"), "--node-name", "node-a"]
    closed = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=buffered,
                            timeout=120, preexec_fn=lambda: os.close(1))  # (started with no stdout at all)
    assert "Traceback" not in closed.stderr, closed.stderr
    with open("/dev/full", "w") as full:  # (the output's write fails at the end's flush)
        proc = subprocess.run(argv, stdout=full, stderr=subprocess.PIPE, text=True, env=buffered, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "error: writing the output: [Errno 28] No space left on device" in proc.stderr
