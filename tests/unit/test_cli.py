"""The command line's own output: what it prints around the pipeline's results."""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler.cli import _dump, main


def test_an_input_error_of_a_command_that_never_changes_the_kernel_does_not_say_it_did_not(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bad.yaml").write_text("apiVersion: v1\nkind: Service\nmetadata: {name: web}\nspec:\n  clusterIP: 10.96.0.5\n  ports: 5\n")
    assert main(["validate", "--source", str(tmp_path), "--node-name", "node-a"]) == 1
    err = capsys.readouterr().err
    assert "bad.yaml:6:3: spec.ports: expected list" in err and err.rstrip().endswith("\n1 error(s)")


def test_yaml_output_keeps_a_long_rule_on_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    rule = "meta l4proto tcp " * 12 + "dnat to 10.244.1.5:8080"
    _dump({"rules": [rule]}, "yaml")
    assert f"- {rule}\n" in capsys.readouterr().out
