"""Kernel backends: each renders the DesiredState into its kernel model, observes the kernel into the
same model, plans the operations between the two and applies them atomically."""

from __future__ import annotations

from typing import Any


def get_backend(mode: str) -> Any:
    """The backend for a mode name ('nftables' or 'iptables')."""
    if mode == "nftables":
        from .nftables.backend import NftablesBackend
        return NftablesBackend()
    if mode == "iptables":
        from .iptables.backend import IptablesBackend
        return IptablesBackend()
    raise ValueError(f"unknown mode {mode!r}")
