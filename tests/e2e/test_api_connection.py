"""The API connections of the Kubernetes source, for real: a watch whose connection dies without
a word (no reset, no FIN: every packet dropped) is noticed by TCP keepalive and watched again on
a new connection, so a change made meanwhile still arrives (it waited for the 330 s read timeout)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from reconciler.sources.kubernetes import API_KEEPALIVE, load_api_client
from tests import netns

pytestmark = pytest.mark.e2e

AGENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "api_watch_agent.py")


def test_a_watch_whose_connection_dies_silently_is_replaced() -> None:
    reason = netns.skip_reason("nft", "ss")
    if reason:
        pytest.skip(reason)
    with netns.throwaway("rc-apiwatch") as ns:
        # keepalive as given (1 s idle, 1 s between 2 probes: ~3 s), against a 20 s deadline
        proc = subprocess.run(["ip", "netns", "exec", ns, sys.executable, AGENT, "1", "1", "2", "20"],
                              capture_output=True, text=True, timeout=90, check=False,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["connections"] >= 3  # (the three watches: Services, EndpointSlices, the Node)
    assert result["seconds"] is not None and result["seconds"] < 15, result
    assert result["errors"] >= 1  # (the dead connection ended in an error, then a new watch)


def test_the_api_client_asks_for_keepalive_as_client_go_notices_a_dead_connection(tmp_path) -> None:
    """~45 s to a dead connection's end (30 s idle, 3 probes 5 s apart), where client-go's HTTP/2
    pings take 30 + 15 s; the timings reach the client's connection pool."""
    import socket

    cfg = tmp_path / "kubeconfig"
    cfg.write_text("apiVersion: v1\nkind: Config\nclusters: [{name: c, cluster: {server: 'http://127.0.0.1:1'}}]\n"
                   "users: [{name: u, user: {}}]\ncontexts: [{name: c, context: {cluster: c, user: u}}]\n"
                   "current-context: c\n")
    options = load_api_client(str(cfg)).rest_client.pool_manager.connection_pool_kw["socket_options"]
    assert (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1) in options
    idle, interval, count = API_KEEPALIVE
    assert {(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle), (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval),
            (socket.IPPROTO_TCP, socket.TCP_KEEPCNT, count)} <= set(options)
    assert idle + interval * count <= 60
