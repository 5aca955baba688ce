"""The only place that runs `nft`: read our tables as JSON, and run one `nft -f` transaction."""

from __future__ import annotations

import json
import shutil
import subprocess
from typing import Any

from ..base import KernelError


def nft_binary() -> str:
    path = shutil.which("nft")
    if not path:
        raise KernelError("nft not found: install the nftables package")
    return path


def list_table(family: str, name: str) -> dict[str, Any] | None:
    """`nft -j list table FAMILY NAME`, or None when the table does not exist."""
    proc = subprocess.run([nft_binary(), "-j", "list", "table", family, name],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        if "No such file or directory" in proc.stderr or "does not exist" in proc.stderr:
            return None
        raise KernelError(f"nft -j list table {family} {name}: {proc.stderr.strip()}")
    return json.loads(proc.stdout)


def run_script(script: str) -> None:
    """Run `script` with `nft -f -`: one atomic transaction, all or nothing."""
    if not script.strip():
        return
    proc = subprocess.run([nft_binary(), "-f", "-"], input=script, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise KernelError(f"nft -f failed (nothing was changed): {proc.stderr.strip()}")
