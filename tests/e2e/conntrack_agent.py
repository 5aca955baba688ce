"""The reconciler in the lab's node namespace with its conntrack table out of reach for a while:
neither pyroute2 nor the conntrack tool can be used (test_conntrack_traffic.py: a cleanup that
failed must be retried). No product logic here.

``apply ARGS...``       `reconciler apply ARGS`, conntrack out of reach throughout.
``daemon SOURCE MODE``  the run loop (one Daemon), one full sync per line read from stdin: the line
                        "unavailable" syncs with conntrack out of reach, any other normally; each
                        sync's report is printed as a JSON line.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext


@contextmanager
def conntrack_unavailable() -> Iterator[None]:
    saved = {k: v for k, v in sys.modules.items() if k == "pyroute2" or k.startswith("pyroute2.")}
    which = shutil.which
    sys.modules.update({k: None for k in [*saved, "pyroute2"]})  # type: ignore  # (imports fail)
    shutil.which = lambda cmd, *a, **kw: None if os.path.basename(cmd) == "conntrack" else which(cmd, *a, **kw)
    try:
        yield
    finally:
        shutil.which = which
        for k in [k for k in sys.modules if k == "pyroute2" or k.startswith("pyroute2.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def daemon(source: str, mode: str) -> None:
    from reconciler.backends import get_backend
    from reconciler.config import Options
    from reconciler.daemon import Daemon
    from reconciler.reconcile import load_desired

    opts = Options(mode=mode, node_name="node-a", cluster_cidrs=("10.244.0.0/16", "fd00:244::/32"),
                   service_cidrs=("10.96.0.0/16", "fd00:96::/64"))
    loop = Daemon(opts, get_backend(mode), None)
    for line in sys.stdin:
        loop.desired = load_desired(source, opts)
        with conntrack_unavailable() if line.strip() == "unavailable" else nullcontext():
            report = loop.sync("full")
        print(json.dumps({"ok": report.ok, "operations": report.operations, "error": report.error}), flush=True)


def main() -> int:
    sys.path.insert(0, os.getcwd())  # the reconciler of the tree under test, as `python -m reconciler` finds it
    if sys.argv[1] == "apply":
        from reconciler.cli import main as cli

        with conntrack_unavailable():
            return cli(["apply", *sys.argv[2:]])
    daemon(sys.argv[2], sys.argv[3])
    return 0


if __name__ == "__main__":
    sys.exit(main())
