"""What every backend provides, and the records they exchange with the planner."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

from ..state import DesiredState

Action = Literal["+", "-", "~"]


@dataclass(frozen=True, slots=True)
class Operation:
    """One kernel operation: `text` is what the backend executes (one line of its batch format)."""

    action: Action
    kind: str  # table, chain, rule, set, map, element
    name: str  # the object, e.g. "ip reconciler-07 chain svc-default/web/http/tcp"
    text: str
    service: str | None = None  # the service port it belongs to, when there is one

    def to_dict(self) -> dict[str, Any]:
        d = {"action": self.action, "kind": self.kind, "object": self.name, "command": self.text}
        if self.service:
            d["service"] = self.service
        return d


class Backend(Protocol):
    """A kernel load-balancing backend (nftables, iptables, ...)."""

    mode: str

    def render(self, desired: DesiredState) -> Any:
        """The kernel model that makes the kernel implement `desired`."""

    def observe(self) -> Any:
        """The kernel model read back from the kernel (only objects this tool owns)."""

    def diff(self, desired: Any, observed: Any) -> list[Operation]:
        """Minimal ordered operations turning `observed` into `desired`."""

    def unconverged(self, desired: Any) -> list[Operation]:
        """diff(desired, observe()): what the kernel still lacks (verification after apply)."""

    def apply(self, operations: list[Operation]) -> None:
        """Execute operations atomically: one `nft -f` transaction; for iptables one restore per
        family whose tables each commit atomically. Raises on failure."""

    def service_view(self, model: Any, only: set[str] | None = None) -> dict[str, dict[str, Any]]:
        """Per service port (or just those in `only`): its addresses and endpoints as a model
        shows them (for people)."""

    def cleanup(self) -> list[Operation]:
        """Operations removing every kernel object this tool owns (and nothing else)."""

    def model_to_dict(self, model: Any) -> dict[str, Any]:
        """The model as plain data (for `observe -o json|yaml`)."""


class KernelError(Exception):
    """A kernel tool failed; carries its command and output."""
