"""Command line: validate, render, plan, apply, observe, cleanup, run."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
from typing import Any, Sequence, get_args

from . import __version__, gcpolicy, instance_lock, quiet_library_loggers
from .backends import get_backend
from .backends.base import Action, KernelError
from .config import (
    HEALTHZ_PORT, INT32_MAX, METRICS_PORT, MODES, Options, bind_address, conntrack_seconds, load_kube_proxy_config,
    merge, parse_cidrs, parse_duration, parse_nodeport_addresses, parse_service_cidrs,
)
from .desired import normalize_ip
from .reconcile import apply, load_desired, plan_against_kernel
from .sources.objects import InputError, InputErrors, InputWarning, in_place_order

log = logging.getLogger("reconciler")

EXIT_OK, EXIT_ERROR, EXIT_CHANGES = 0, 1, 2

DESCRIPTION = """\
Reconcile Kubernetes Services and EndpointSlices into kernel load-balancing state (kube-proxy's job).

Exit codes: 0 success (plan: the kernel already matches), 1 error (bad input or usage, a kernel
tool failed, apply did not converge; run: also its --config file changed), 2 (plan only) changes
pending.
"""


def _common(p: argparse.ArgumentParser, source: bool = True, output: tuple[str, ...] = (),
            config_note: str = "", mode_help: str = "kernel backend (default: the file's mode, else nftables)",
            config: bool = True, desired: bool = True, source_required: bool = True) -> None:
    """The flags of a command; `desired`: those the desired state is built with (the commands that
    only read or remove the kernel's objects take none of them: they would be silently unused)."""
    if source:
        p.add_argument("--source", required=source_required, metavar="DIR",
                       help="directory of Service/EndpointSlice/Node manifests (YAML or JSON, nested folders ok)")
    if config:
        p.add_argument("--config", metavar="FILE",
                       help="a kube-proxy KubeProxyConfiguration file (kubeproxy.config.k8s.io/v1alpha1; its "
                            "nftables: or iptables: section, that of the mode run, is read); flags win over it"
                            + config_note)
    p.add_argument("--mode", choices=MODES, help=mode_help)
    if desired:
        _desired_flags(p)
    p.add_argument("-v", "--verbose", action="store_true", help="log debug details")
    if output:
        p.add_argument("-o", "--output", choices=output, default=output[0], help=f"output format (default {output[0]})")


def _desired_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--node-name", help="this node's name (default: the file's hostnameOverride, else the hostname)")
    p.add_argument("--cluster-cidr", metavar="CIDR[,CIDR]",
                   help="pod CIDRs (one, or one of each family, as kube-proxy; several per family are taken "
                        "too); traffic from outside them to a ClusterIP is masqueraded")
    p.add_argument("--service-cidr", metavar="CIDR[,CIDR]",
                   help="service CIDRs: unallocated IPs are dropped (unused ports of ClusterIPs are rejected: "
                        "by nftables always, by iptables with this flag)")
    p.add_argument("--nodeport-addresses", metavar="CIDR,...|primary",
                   help="NodePorts answer only on local addresses in these CIDRs (default: every local address; "
                        "a family with none of them, or with 0.0.0.0/0 or ::/0: every local address of it); "
                        "'primary': this node's IP of each family (its Node's first InternalIP, else ExternalIP)")
    p.add_argument("--masquerade-all", action="store_true", default=None,
                   help="masquerade all traffic to ClusterIPs")


def _verified(planned: Any) -> str:
    if planned.verified_by == "generation":
        what = "nothing" if planned.plan.empty else "nothing but this transaction"
        return f"Verified by the ruleset generation: {what} has changed the kernel since it was read."
    return "Verified by reading the kernel back."


class _Parser(argparse.ArgumentParser):
    """Usage errors exit 1: exit code 2 is reserved for `plan`'s "changes pending"."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="reconciler", description=DESCRIPTION,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"service-reconciler {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    p = sub.add_parser("validate", help="check the manifests: schema and semantics, file:line:column errors")
    _common(p, output=("text", "json"))
    p.add_argument("--strict", action="store_true",
                   help="fail (exit 1) on any warning too, such as an unknown field or no Node of this node's name "
                        "(the warnings are printed all the same)")
    p = sub.add_parser("render", help="print the canonical desired-state document")
    _common(p, output=("yaml", "json"))
    p = sub.add_parser("plan", help="dry run: what apply would change in the kernel (exit 0 in sync, 2 changes)")
    _common(p, output=("text", "json"))
    p = sub.add_parser("apply", help="make the kernel match the desired state, atomically, then verify")
    _common(p, output=("text", "json"), source_required=False)
    p.add_argument("--plan", metavar="FILE",
                   help="instead of --source: run exactly the operations of a saved plan (`plan -o json > FILE`; "
                        "'-': standard input), refused when the kernel has changed since it was made")
    p.add_argument("--read-back", action="store_true",
                   help="verify by reading the kernel back even when the ruleset generation shows that "
                        "our transaction was the only change since the kernel was read")
    p = sub.add_parser("observe", help="print what the kernel holds now (our objects only), in our model")
    _common(p, source=False, output=("yaml", "json"), desired=False,
            mode_help="the backend whose objects to print (default: the file's mode, else nftables)")
    p = sub.add_parser("cleanup", help="remove every kernel object this tool owns (both modes unless --mode), "
                                        "nothing else")
    _common(p, source=False, config=False, desired=False, mode_help="remove only this mode's objects (default: both modes)")
    p = sub.add_parser("run", help="reconcile continuously from a directory or the Kubernetes API")
    _common(p, source=False, config_note="; when its content changes, run exits 1, to be started again with it")
    p.add_argument("--source", required=True, metavar="DIR|kubernetes",
                   help="a manifest directory (watched) or 'kubernetes' (list+watch the API)")
    p.add_argument("--kubeconfig", metavar="FILE", help="kubeconfig for --source kubernetes (default: the file's "
                                                           "clientConnection.kubeconfig, else in-cluster)")
    p.add_argument("--sync-period", metavar="DURATION",
                   help="full resync period; it reads the kernel back only when the ruleset generation moved, "
                        "and at least hourly (default 30s)")
    p.add_argument("--min-sync-period", metavar="DURATION",
                   help="least time from a sync's end to the next sync's start (default 1s)")
    p.add_argument("--healthz-bind-address", metavar="HOST:PORT",
                   help="/healthz, /livez and /readyz (default 0.0.0.0:10256; a bare IP: port 10256)")
    p.add_argument("--metrics-bind-address", metavar="HOST:PORT",
                   help="/metrics, /proxyMode and /configz (default 127.0.0.1:10249; a bare IP: port 10249)")
    p.add_argument("--log-format", choices=("text", "json"), default="text", help="log line format (default text)")
    _conntrack_flags(p)
    return parser


# kube-proxy's conntrack flags, --conntrack-tcp-be-liberal aside: (flag, metavar, help)
CONNTRACK_FLAGS = (
    ("--conntrack-max-per-core", "N", "nf_conntrack_max: N x the node's CPUs, capped at 1048576, at least "
                                      "--conntrack-min; only ever raised (default 32768; 0: leave it alone)"),
    ("--conntrack-min", "N", "the floor of --conntrack-max-per-core x CPUs (default 131072)"),
    ("--conntrack-tcp-timeout-established", "DURATION", "idle timeout of established TCP connections "
                                                        "(default 24h)"),
    ("--conntrack-tcp-timeout-close-wait", "DURATION", "timeout of TCP connections in CLOSE_WAIT (default 1h)"),
    ("--conntrack-udp-timeout", "DURATION", "idle timeout of UNREPLIED UDP flows (default 0: leave it alone)"),
    ("--conntrack-udp-timeout-stream", "DURATION", "idle timeout of ASSURED UDP flows (default 0: leave it alone)"),
)


def _count(text: str) -> int:
    """An int32 >= 0, as kube-proxy's conntrack counts."""
    value = int(text) if text.strip().isdigit() else -1
    if not 0 <= value <= INT32_MAX:
        raise argparse.ArgumentTypeError(f"expected an integer from 0 to {INT32_MAX}, got {text!r}")
    return value


def _conntrack_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("conntrack sysctls, set once at start as kube-proxy does (flags win over "
                             "`conntrack:` in --config)")
    for flag, metavar, text in CONNTRACK_FLAGS:
        g.add_argument(flag, metavar=metavar, help=text, type=_count if metavar == "N" else str)
    g.add_argument("--conntrack-tcp-be-liberal", action="store_true", default=None,
                   help="set nf_conntrack_tcp_be_liberal to 1: out-of-window TCP packets are not INVALID")
    g.add_argument("--conntrack-sysctl-dir", metavar="DIR",
                   help="where this node's net.netfilter sysctls are (default /proc/sys/net/netfilter; "
                        "a non-privileged container's /proc/sys is read-only: mount the host's elsewhere)")


def options_from(args: argparse.Namespace) -> Options:
    opts = Options()
    if getattr(args, "config", None):
        opts = merge(opts, load_kube_proxy_config(args.config, args.mode))
    node_name = getattr(args, "node_name", None)  # (a command that builds no desired state has no such flags)
    if node_name:  # (trimmed, lower-cased and not blank, as kube-proxy's GetHostname takes it; "": not given)
        node_name = node_name.strip()
        if not node_name:
            raise ValueError("--node-name: blank; give this node's name, as its Node object has it")
    flags: dict[str, Any] = {
        "mode": args.mode,
        "node_name": node_name.lower() if node_name else None,
        "masquerade_all": getattr(args, "masquerade_all", None),
        "kubeconfig": getattr(args, "kubeconfig", None),
    }
    for flag, attr, parse in (("--cluster-cidr", "cluster_cidrs", parse_cidrs),
                              ("--service-cidr", "service_cidrs", parse_service_cidrs),
                              ("--nodeport-addresses", "nodeport_cidrs", parse_nodeport_addresses)):
        value = getattr(args, flag[2:].replace("-", "_"), None)
        try:
            flags[attr] = parse(value, flag) if value else None
        except ValueError as exc:
            raise ValueError(f"{flag}: {exc}") from None
    for name, attr in (("sync_period", "sync_period"), ("min_sync_period", "min_sync_period")):
        value = getattr(args, name, None)
        if value:
            try:
                flags[attr] = parse_duration(value)
            except ValueError as exc:
                raise ValueError(f"--{name.replace('_', '-')}: {exc}") from None
    for name in ("healthz_bind_address", "metrics_bind_address", "conntrack_max_per_core", "conntrack_min",
                 "conntrack_tcp_be_liberal", "conntrack_sysctl_dir"):
        flags[name] = getattr(args, name, None)
    for name, port in (("healthz_bind_address", HEALTHZ_PORT), ("metrics_bind_address", METRICS_PORT)):
        if flags[name] and normalize_ip(flags[name].strip()) is not None:  # a bare IP: its default port,
            flags[name] = bind_address(flags[name], port, f"--{name.replace('_', '-')}")  # as kube-proxy's flag
    for flag, metavar, _ in CONNTRACK_FLAGS:
        name = flag[2:].replace("-", "_")
        value = getattr(args, name, None)
        if metavar == "DURATION" and value is not None:
            try:
                flags[name] = conntrack_seconds(value, flag)
            except ValueError as exc:
                raise ValueError(f"{flag}: {exc}") from None
    opts = merge(opts, flags)
    if opts.min_sync_period > opts.sync_period:  # (a file alone is checked as it is read, with its line)
        raise ValueError(f"--min-sync-period ({opts.min_sync_period:g}s) must not exceed --sync-period "
                         f"({opts.sync_period:g}s)")
    return opts


def _dump(data: Any, fmt: str) -> None:
    if fmt == "json":
        print(json.dumps(data, indent=2))
    else:
        from ruamel.yaml import YAML
        y = YAML(typ="safe", pure=True)
        y.default_flow_style = False
        y.width = 1 << 16  # a rule on one line (at 80 columns its text was folded: grep missed it)
        y.sort_base_mapping_type_on_output = False  # type: ignore[attr-defined]
        y.dump(data, sys.stdout)


def _sbin_on_path() -> None:
    """Kernel tools live in /usr/sbin; a root shell from plain `su` may not have it on PATH."""
    parts = os.environ.get("PATH", "").split(os.pathsep)
    missing = [d for d in ("/usr/local/sbin", "/usr/sbin", "/sbin") if d not in parts]
    if missing:
        os.environ["PATH"] = os.pathsep.join([p for p in parts if p] + missing)


# What a one-shot command built and left for the process's exit to drop (see console()); None when
# main() is called in a process that goes on (tests): nothing is kept then.
_left_for_exit: list[Any] | None = None


def _leave_for_exit(*objects: Any) -> None:
    if _left_for_exit is not None:
        _left_for_exit.extend(objects)


def console() -> None:
    """The `reconciler` command: main(), then the process's end. A one-shot command ends without
    freeing what it built (its output flushed, then os._exit, as mypy ends): at 10k services that
    is millions of small objects, ~0.2 s of freeing them one by one just before the kernel would
    take the memory back whole. `run` ends as usual (its threads are joined, its handlers run)."""
    global _left_for_exit
    _left_for_exit = []
    one_shot: list[bool] = []
    rc = main(one_shot=one_shot)
    if not one_shot:
        sys.exit(rc)
    logging.shutdown()
    try:
        if sys.stdout is not None:  # (None: started with stdout closed)
            sys.stdout.flush()
    except BrokenPipeError:  # the reader went away: as _main (no complaint)
        rc = EXIT_ERROR
    except OSError as exc:  # (a full disk: the output is incomplete)
        rc = EXIT_ERROR
        with contextlib.suppress(Exception):
            print(f"error: writing the output: {exc}", file=sys.stderr)
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    os._exit(rc)


def main(argv: Sequence[str] | None = None, one_shot: list[bool] | None = None) -> int:
    """The command line (argv: sys.argv[1:]); returns the exit code. `one_shot`: True is appended
    to it when the command is not `run` (see console())."""
    _sbin_on_path()
    args = build_parser().parse_args(argv)
    if one_shot is not None and args.command != "run":
        one_shot.append(True)
    if args.command == "run" and threading.current_thread() is threading.main_thread():
        # (a reload, or ReloadPropagatedFrom=, while it starts: not death by SIGHUP's default
        # action; run installs its handlers as soon as it has a loop to wake)
        hangup = signal.signal(signal.SIGHUP, signal.SIG_IGN)
        try:
            return _main(args)
        finally:
            signal.signal(signal.SIGHUP, hangup)
    return _main(args)


def _main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(message)s", stream=sys.stderr)
    quiet_library_loggers()
    as_json = getattr(args, "output", None) == "json" and args.command != "observe"
    # the warnings, for --strict, validate's count and a JSON document of the input's errors (the
    # --config file's too)
    warned = _Warnings.attach() if as_json or args.command == "validate" else None
    try:
        return _dispatch(args, warned)
    except (InputErrors, InputError) as exc:
        errors = in_place_order(exc.errors) if isinstance(exc, InputErrors) else [exc]
        for w in exc.warnings if isinstance(exc, InputErrors) else ():
            log.warning("%s", w)  # (found beside the errors; collected by warned, for -o json)
        for e in errors:
            print(f"error: {e}", file=sys.stderr)
        changes = args.command in ("apply", "run")  # (the others never change the kernel)
        print(f"{len(errors)} error(s){_counted(warned)}" + ("; the kernel was not changed" if changes else ""), file=sys.stderr)
        if as_json and warned is not None:
            print(json.dumps(diagnostics(args.source, errors, warned.items), indent=2))
        return EXIT_ERROR
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:  # the reader went away (`plan | head`): no more output, and no complaint
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_ERROR
    except (KernelError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    finally:
        if warned is not None:
            log.removeHandler(warned)


def _counted(warned: _Warnings | None) -> str:
    """', 2 warning(s)' for a verdict line, when there were any."""
    return f", {len(warned.items)} warning(s)" if warned is not None and warned.items else ""


def diagnostics(source: str, errors: list[InputError], warnings: list[str], service_ports: int | None = None,
                strict: bool = False) -> dict[str, Any]:
    """What `validate -o json` prints, and `render`/`plan`/`apply -o json` instead of their document
    when the input has errors: schemas/diagnostics.schema.json. `strict`: a warning invalidates too."""
    out: dict[str, Any] = {"source": source, "valid": not errors and not (strict and warnings)}
    if service_ports is not None:
        out["servicePorts"] = service_ports
    out["errors"] = [e.to_dict() for e in errors]
    out["warnings"] = [w.to_dict() if isinstance(w, InputWarning) else {"message": w}
                       for w in in_place_order(warnings)]  # (the config file's, logged first, by line too)
    return out


class _Warnings(logging.Handler):
    """Collects the warnings logged while attached (validate --strict, -o json): an input warning
    as itself (InputWarning: its place and field kept), any other as its message."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.items: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args
        single = args[0] if isinstance(args, tuple) and len(args) == 1 else None
        self.items.append(single if isinstance(single, InputWarning) and record.msg == "%s" else record.getMessage())

    @classmethod
    def attach(cls) -> _Warnings:
        """A new collector on our loggers (any left by a call that failed is dropped first)."""
        for h in [h for h in log.handlers if isinstance(h, cls)]:
            log.removeHandler(h)
        collector = cls()
        log.addHandler(collector)
        return collector


def _dispatch(args: argparse.Namespace, warned: _Warnings | None = None) -> int:
    if args.command == "apply" and (args.plan is None) == (args.source is None):
        raise ValueError("apply: give --source DIR, or --plan FILE (a saved plan), not both")
    if args.command == "apply" and args.plan is not None:
        given = [f for f in ("node_name", "cluster_cidr", "service_cidr", "nodeport_addresses", "masquerade_all",
                             "config") if getattr(args, f, None) is not None] + (["read_back"] if args.read_back else [])
        if given:
            raise ValueError(f"apply --plan: the plan was made with its own settings; "
                             f"--{given[0].replace('_', '-')} is not taken")
        return _apply_saved(args)
    opts = options_from(args)
    if args.command == "run":
        from .daemon import run
        return run(args, opts)
    gcpolicy.one_shot()
    backend = get_backend(opts.mode)
    if args.command == "validate":
        desired = load_desired(args.source, opts)
        n = len(desired.services)
        strict = bool(getattr(args, "strict", False))
        if args.output == "json":
            assert warned is not None
            print(json.dumps(diagnostics(args.source, [], warned.items, n, strict), indent=2))
        if strict and warned is not None and warned.items:
            print(f"{args.source}: {len(warned.items)} warning(s), which --strict makes errors", file=sys.stderr)
            return EXIT_ERROR
        if args.output == "text":
            print(f"{args.source}: valid ({n} service port{'' if n == 1 else 's'}{_counted(warned)})")
        return EXIT_OK
    if args.command == "render":
        _dump(load_desired(args.source, opts).to_dict(), args.output)
        return EXIT_OK
    if args.command == "observe":
        _dump(backend.model_to_dict(backend.observe()), args.output)
        return EXIT_OK
    if args.command in ("apply", "cleanup") and (pid := instance_lock.holder()) is not None:
        log.warning("a `reconciler run`%s programs this network namespace: it puts back what its own source "
                    "wants at its next resync", f" (pid {pid})" if pid else "")
    if args.command == "cleanup":
        modes = [args.mode] if args.mode else list(MODES)
        for mode in modes:
            b = backend if mode == opts.mode else get_backend(mode)
            ops = b.cleanup(look_first=True)
            b.apply(ops)
            kept = getattr(b, "kept", [])  # (emptied, not deleted: rules of others jump to them)
            print(f"cleanup ({mode}): " + (f"{len(ops)} operations removed what service-reconciler owned"
                                           if ops else f"nothing {'more ' if kept else ''}of ours to remove")
                  + (f"; kept {len(kept)} emptied chain(s) that rules of others jump to: {', '.join(kept)}"
                     if kept else ""))
        return EXIT_OK
    planned = plan_against_kernel(backend, args.source, opts, describe=args.command == "plan")
    _leave_for_exit(planned)
    if args.command == "plan":
        if planned.observed_at is not None and backend.generation() is not None:  # (for `apply --plan`)
            planned.plan.observed_generation = planned.observed_at
        print(planned.plan.to_json() if args.output == "json" else planned.plan.to_text())
        return EXIT_OK if planned.plan.empty else EXIT_CHANGES
    if args.command == "apply":
        apply(backend, planned, read_back=args.read_back)
        if args.output == "json":
            print(planned.plan.to_json())
        else:
            print(planned.plan.to_text())
            print(("Applied." if not planned.plan.empty else "Nothing to do.") + " " + _verified(planned))
        return EXIT_OK
    raise AssertionError(args.command)


_KINDS = ("table", "chain", "rule", "set", "map", "element")


def _check_saved_plan(mode: Any, ops: list[Any], other: Any, seen: Any) -> int:
    """A saved plan as `plan -o json` writes it (schemas/plan.schema.json), whose every operation
    is one its backend makes, on objects of ours (a plan is a file: it may have been edited);
    raises ValueError saying what is not. Returns how many of the last operations are the other
    mode's."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}")
    if seen is not None and (type(seen) is not int or seen < 0):
        raise ValueError(f"observedGeneration {seen!r} is no generation")
    n_other = 0
    if other is not None:
        n_other = other["operations"]
        if other["mode"] not in MODES or other["mode"] == mode or type(n_other) is not int \
                or not 0 < n_other <= len(ops):
            raise ValueError(f"otherMode {other!r} (another mode, and 1 to {len(ops)} operations)")
    backends = {mode: get_backend(mode), **({other["mode"]: get_backend(other["mode"])} if other else {})}
    for i, op in enumerate(ops):
        if op.action not in get_args(Action) or op.kind not in _KINDS or not isinstance(op.name, str) \
                or not isinstance(op.text, str) or not isinstance(op.service, (str, type(None))):
            raise ValueError(f"operations[{i}] is not an operation: {op.to_dict()}")
        theirs = i >= len(ops) - n_other
        reason = backends[other["mode"] if theirs else mode].foreign(op)
        if reason is not None:
            raise ValueError(f"operations[{i}]: {reason} (a plan only changes this tool's own objects)")
    return n_other


def _apply_saved(args: argparse.Namespace) -> int:
    """`apply --plan FILE`: the saved plan's operations, run as they are, when the kernel is still
    as the plan found it (its nf_tables ruleset generation, `observedGeneration`, unchanged:
    nothing has committed since), then checked by the generation again."""
    from .backends.base import Operation
    from .backends.generation import follows

    try:
        text = sys.stdin.read() if args.plan == "-" else open(args.plan, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{args.plan}: cannot read it: {exc}") from None
    try:
        doc = json.loads(text)
        mode, operations, other = doc["mode"], doc["operations"], doc.get("otherMode")
        seen = doc.get("observedGeneration")
        ops = [Operation(o["action"], o["kind"], o["object"], o["command"], o.get("service")) for o in operations]
        n_other = _check_saved_plan(mode, ops, other, seen)
        if doc["counts"]["operations"] != len(ops):  # (cut short, or added to)
            raise ValueError(f"{len(ops)} operations, where its counts say {doc['counts']['operations']!r}")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{args.plan}: not a plan of `reconciler plan -o json` ({type(exc).__name__}: {exc}); "
                         "nothing applied") from None
    if args.mode is not None and args.mode != mode:
        raise ValueError(f"{args.plan}: a plan of {mode} mode, not {args.mode}")
    backend = get_backend(mode)
    now = backend.generation()
    if seen is None or now is None:
        raise ValueError(f"{args.plan}: cannot tell whether the kernel changed since the plan was made (no ruleset "
                         "generation: legacy iptables, or a plan of an older version); plan and apply again")
    if now != seen:
        raise ValueError(f"{args.plan}: the kernel has changed since the plan was made (ruleset generation {seen}, "
                         f"now {now}): not applied; plan again")
    own, theirs = ops[:len(ops) - n_other], ops[len(ops) - n_other:]
    produced: list[int] | None = backend.apply(own) if own else []
    if theirs:
        more = get_backend(other["mode"]).apply(theirs)
        produced = None if produced is None or more is None else produced + more
    verified = not ops or follows(seen, produced) == backend.generation()
    if args.output == "json":
        print(json.dumps({**doc, **({"verifiedBy": "generation"} if verified else {})}, indent=2))
    elif not ops:
        print("Nothing to do: the plan had no changes.")
    else:
        print(f"Applied the saved plan: {len(ops)} operations. " + (
            "Verified by the ruleset generation: nothing but this transaction has changed the kernel since the "
            "plan was made." if verified else "Somebody else has also changed the kernel meanwhile: plan to "
            "see where it stands."))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
