"""`reconciler run --source DIR` started with a file that cannot be read, real kernel.

On a kernel holding nothing of ours (a node's first start, a reboot) the readable files are
programmed rather than nothing, and the rest follows once the file is fixed; a process restarted
on a programmed kernel leaves it whole while the file stays broken.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab import Lab
from manifests import eps, reconciler, svc
from test_run import BROKEN, HEALTHZ, http_get, put, reconciler_run, serving, state_docs, wait_for
from traffic import outcomes

pytestmark = pytest.mark.e2e

API_IP = "10.96.0.20"


def api_service() -> dict:
    return svc("api", [API_IP], [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}])


def health(lab: Lab) -> dict:
    return json.loads(http_get(lab, "node", f"http://{HEALTHZ}/healthz")[2])


def test_first_start_programs_the_readable_files_and_a_restart_keeps_the_kernel_whole(
        lab: Lab, tmp_path: Path) -> None:
    src = tmp_path / "state"
    src.mkdir()
    web = {k: v for k, v in state_docs().items() if k.startswith("web")}
    put(str(src), {**web, "api-eps": eps("api", ("pod1",))})
    (src / "api-svc.yaml").write_text(BROKEN.replace("broken", "api").replace("10.96.0.99", API_IP))
    for mode in ("nftables", "iptables"):  # a kernel with nothing of ours, in either mode
        reconciler(lab, "cleanup", "--mode", mode, check=False)
    try:
        with reconciler_run(lab, str(src), tmp_path / "first.log") as run:
            assert serving(lab) == {"pod1", "pod2", "pod3"}, run.log.read_text()
            assert run.logged(r"^nothing of ours is programmed yet: starting without the objects of 1 "
                              r"manifest file\(s\) with errors \(.*/api-svc\.yaml\)")
            h = health(lab)
            assert h["degraded"] is True and "api-svc.yaml:10:5" in h["lastError"]
            assert "ok" not in outcomes(lab.tcp("pod2", API_IP, 80, count=5))  # its Service is unreadable
            put(str(src), {"api-svc": api_service()})  # fixed
            wait_for(lambda: health(lab)["degraded"] is False, 10, 0.1, "degraded to clear")
            assert serving(lab, ip=API_IP) == {"pod1"}
            # broken again: the last good state stays whole, as always once there is one
            (src / "api-svc.yaml").write_text(BROKEN.replace("broken", "api").replace("10.96.0.99", API_IP))
            wait_for(lambda: health(lab)["degraded"] is True, 10, 0.1, "degraded")
            assert serving(lab, ip=API_IP) == {"pod1"}
        # a restart (an upgrade, a crash) with the file still broken: the kernel is ours, left whole
        with reconciler_run(lab, str(src), tmp_path / "second.log") as run:
            assert run.logged(r"^sync full: no valid input yet, kernel left as it is"), run.log.read_text()
            assert not run.logged(r"^nothing of ours is programmed yet")
            assert serving(lab, ip=API_IP) == {"pod1"}
            assert serving(lab) == {"pod1", "pod2", "pod3"}
    finally:
        reconciler(lab, "cleanup", "--mode", "nftables", check=False)
