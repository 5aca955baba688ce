"""Run inside a throwaway network namespace (test_api_connection.py): the fake API server on
loopback, a KubernetesSource watching it through load_api_client's connections, then the
source's established connections black-holed (every packet of theirs dropped, both ways: the API
server's host lost, or a failover that drops flows, with no reset), and a change made meanwhile.
Prints one JSON line: how long until the change reached the source's cache (null: not by the
deadline), and the informers' errors. No product logic here.

usage: api_watch_agent.py IDLE INTERVAL COUNT DEADLINE   (the keepalive given to load_api_client)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fakeapi import FakeAPIServer, endpoint_slice, service  # noqa: E402

from reconciler.sources.kubernetes import KubernetesSource, load_api_client  # noqa: E402


def addresses(src: KubernetesSource) -> set[str]:
    return {a for o in src.snapshot() if o.kind == "EndpointSlice"
            for ep in o.body.get("endpoints", []) for a in ep.get("addresses", [])}


def main() -> None:
    idle, interval, count, deadline = (int(a) for a in sys.argv[1:5])
    api = FakeAPIServer(bookmark_interval=None).start()  # (no bookmarks: a watch with nothing to say is silent)
    api.create(service("web"))
    api.create(endpoint_slice("web-1", "web", ["10.244.1.5"]))
    with tempfile.NamedTemporaryFile("w", suffix=".kubeconfig", delete=False) as fh:
        fh.write(f"apiVersion: v1\nkind: Config\nclusters: [{{name: fake, cluster: {{server: \"{api.url}\"}}}}]\n"
                 "users: [{name: me, user: {token: t}}]\ncontexts: [{name: fake, context: {cluster: fake, user: me}}]\n"
                 "current-context: fake\n")
    src = KubernetesSource(load_api_client(fh.name, keepalive=(idle, interval, count)), "node-a", backoff_max=1.0)
    src.start()
    try:
        assert src.wait_synced(10), "no initial sync"
        time.sleep(0.5)  # (the watches open)
        ss = subprocess.run(["ss", "-tnH", "state", "established", "dport", f"= :{api.port}"],
                            capture_output=True, text=True, timeout=10, check=True).stdout
        ports = sorted({line.split()[2].rsplit(":", 1)[1] for line in ss.splitlines() if line.strip()})
        assert ports, "no connection to the API server"
        ruleset = (f"table inet blackhole {{\n chain input {{\n  type filter hook input priority -300;\n"
                   f"  tcp sport {{ {', '.join(ports)} }} drop\n  tcp dport {{ {', '.join(ports)} }} drop\n }}\n}}\n")
        subprocess.run(["nft", "-f", "-"], input=ruleset, text=True, timeout=10, check=True)
        started = time.monotonic()
        changed = api.get("EndpointSlice", "default", "web-1")
        changed["endpoints"][0]["addresses"] = ["10.244.1.99"]
        api.update(changed)
        seen = None
        while time.monotonic() - started < deadline:
            if "10.244.1.99" in addresses(src):
                seen = time.monotonic() - started
                break
            time.sleep(0.2)
        print(json.dumps({"seconds": seen, "connections": len(ports), "errors": src.counters["errors"]}))
    finally:
        src.stop(timeout=2)
        api.stop()
        os.unlink(fh.name)


if __name__ == "__main__":
    main()
