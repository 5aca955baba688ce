"""Both ways of running an nftables transaction (libnftables in-process for small ones, `nft -f`
for big ones, or whenever RECONCILER_NFT_IN_PROCESS=0) are atomic and report errors the same way."""

from __future__ import annotations

import json
import sys

import pytest

pytestmark = pytest.mark.e2e

PROBE = r"""
import json, sys
from reconciler.backends.base import KernelError
from reconciler.backends.nftables import kernel

def rules():
    doc = kernel.list_table("ip", "sr-tx-test")
    return [r["rule"]["expr"] for r in doc["nftables"] if "rule" in r] if doc else None

out = {"in_process": kernel._LIBNFT.available()}
kernel.run_script("add table ip sr-tx-test\nadd chain ip sr-tx-test c\nadd rule ip sr-tx-test c counter\n")
out["after_ok"] = len(rules())
try:
    kernel.run_script("add rule ip sr-tx-test c counter\nadd rule ip sr-tx-test missing counter\n")
    out["error"] = None
except KernelError as exc:
    out["error"] = str(exc)
out["after_failed"] = len(rules())
kernel.run_script("delete table ip sr-tx-test\n")
out["after_delete"] = rules()
print(json.dumps(out))
"""


@pytest.mark.parametrize("in_process", ["1", "0"])
def test_transactions_are_atomic_on_both_paths(lab, in_process):
    proc = lab.exec("node", ["env", f"RECONCILER_NFT_IN_PROCESS={in_process}", sys.executable, "-c", PROBE],
                    check=False, timeout=30)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["in_process"] is (in_process == "1")
    assert out["after_ok"] == 1
    assert out["error"] is not None and "nothing was changed" in out["error"] and "missing" in out["error"]
    assert out["after_failed"] == 1  # the good first line of the failed transaction did not land either
    assert out["after_delete"] is None
