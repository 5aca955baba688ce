#!/usr/bin/env python3
"""Stdlib-only traffic agent run inside a network namespace (``ip netns exec``).

Two sub-commands:

``serve NAME PORT [PORT ...] [--no-tcp] [--no-udp]``
    Listen on every port on 0.0.0.0 and :: (separate v4/v6 sockets), TCP and
    UDP.  Each TCP connection and each UDP datagram is answered with the line
    ``"<NAME> <peer-ip> <peer-port>\\n"``.  UDP replies leave from the address
    the datagram was sent to (IP_PKTINFO), so multi-address hosts work.
    Prints ``READY`` on stdout once every socket is bound; exits when its
    parent process goes away.

``probe JSON``
    Run ``count`` probes (fresh socket each) and print a JSON list of results,
    see ``tests/e2e/traffic.py``.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import os
import select
import selectors
import socket
import struct
import sys
import time
from typing import Any

IP_PKTINFO = getattr(socket, "IP_PKTINFO", 8)
IP_RECVERR = getattr(socket, "IP_RECVERR", 11)
IPV6_RECVERR = getattr(socket, "IPV6_RECVERR", 25)

UNREACHABLE_ERRNOS = {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EACCES}


# ----------------------------------------------------------------- server ---


def _peer_ip(addr: str) -> str:
    ip = ipaddress.ip_address(addr.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        return str(ip.ipv4_mapped)
    return str(ip)


def _udp_reply(sock: socket.socket, family: int, name: str) -> None:
    data, anc, _flags, peer = sock.recvmsg(65535, 256)
    line = f"{name} {_peer_ip(peer[0])} {peer[1]}\n".encode()
    out = []
    for level, typ, cdata in anc:
        if family == socket.AF_INET and level == socket.IPPROTO_IP and typ == IP_PKTINFO:
            # struct in_pktinfo {int ifindex; in_addr spec_dst; in_addr addr;}
            _ifi, _spec, addr = struct.unpack("i4s4s", cdata[:12])
            out.append((level, typ, struct.pack("i4s4s", 0, addr, b"\0" * 4)))
        elif family == socket.AF_INET6 and level == socket.IPPROTO_IPV6 and typ == socket.IPV6_PKTINFO:
            # struct in6_pktinfo {in6_addr addr; int ifindex;}; let routing pick the device
            out.append((level, typ, cdata[:16] + struct.pack("i", 0)))
    try:
        sock.sendmsg([line], out, 0, peer)
    except OSError:
        sock.sendto(line, peer)


def serve(name: str, ports: list[int], tcp: bool, udp: bool) -> None:
    sel = selectors.DefaultSelector()
    for port in ports:
        for family, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
            kinds = ([socket.SOCK_STREAM] if tcp else []) + ([socket.SOCK_DGRAM] if udp else [])
            for kind in kinds:
                s = socket.socket(family, kind)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                s.bind((host, port))
                if kind == socket.SOCK_STREAM:
                    s.listen(128)
                elif family == socket.AF_INET:
                    s.setsockopt(socket.IPPROTO_IP, IP_PKTINFO, 1)
                else:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_RECVPKTINFO, 1)
                s.setblocking(False)
                sel.register(s, selectors.EVENT_READ, (family, kind))
    parent = os.getppid()
    sys.stdout.write("READY\n")
    sys.stdout.flush()
    while os.getppid() == parent:  # exit if the test process died without cleanup
        for key, _ in sel.select(timeout=1.0):
            sock: socket.socket = key.fileobj  # type: ignore[assignment]
            family, kind = key.data
            try:
                if kind == socket.SOCK_STREAM:
                    conn, peer = sock.accept()
                    with conn:
                        conn.settimeout(1.0)
                        conn.sendall(f"{name} {_peer_ip(peer[0])} {peer[1]}\n".encode())
                else:
                    _udp_reply(sock, family, name)
            except OSError:
                pass


# ----------------------------------------------------------------- client ---


def _family(ip: str) -> int:
    return socket.AF_INET6 if ":" in ip else socket.AF_INET


def _err(outcome: str, t0: float, detail: str, local_port: int | None = None) -> dict[str, Any]:
    return {"outcome": outcome, "server": None, "seen_ip": None, "seen_port": None,
            "elapsed": time.monotonic() - t0, "local_port": local_port, "detail": detail}


def _classify(exc: BaseException) -> str:
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "timeout"
    if isinstance(exc, ConnectionRefusedError):
        return "refused"
    if isinstance(exc, OSError) and exc.errno in UNREACHABLE_ERRNOS:
        return "unreachable"
    return "error"


def _detail(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno:
        return errno.errorcode.get(exc.errno, str(exc.errno))
    return type(exc).__name__


def _ok(line: bytes, t0: float, local_port: int) -> dict[str, Any]:
    parts = line.decode(errors="replace").split()
    if len(parts) != 3:
        return _err("error", t0, f"bad reply {line!r}", local_port)
    return {"outcome": "ok", "server": parts[0], "seen_ip": parts[1], "seen_port": int(parts[2]),
            "elapsed": time.monotonic() - t0, "local_port": local_port, "detail": ""}


def _set_recverr(s: socket.socket, fam: int, on: bool) -> None:
    """IP(V6)_RECVERR: queue every ICMP error on the socket (turning it off purges the queue)."""
    if fam == socket.AF_INET:
        s.setsockopt(socket.IPPROTO_IP, IP_RECVERR, int(on))
    else:
        s.setsockopt(socket.IPPROTO_IPV6, IPV6_RECVERR, int(on))


def _errqueue_errno(s: socket.socket) -> int | None:
    """errno of the first queued ICMP error (struct sock_extended_err), if any."""
    try:
        _data, anc, _flags, _addr = s.recvmsg(1, 512, socket.MSG_ERRQUEUE | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError as exc:
        return exc.errno
    for _level, _typ, cdata in anc:
        if len(cdata) >= 4:
            return int(struct.unpack("=I", cdata[:4])[0])
    return None


def _errno_result(code: int, t0: float, what: str, lport: int | None = None) -> dict[str, Any]:
    exc = OSError(code, os.strerror(code))
    if code == errno.ECONNREFUSED:
        exc = ConnectionRefusedError(code, os.strerror(code))
    return _err(_classify(exc), t0, f"{what} {_detail(exc)}", lport)


def _tcp_once(ip: str, port: int, timeout: float, source_ip: str | None) -> dict[str, Any]:
    """Non-blocking connect + poll.  ICMP errors are also read from the error queue:
    an ICMP(v6) error that arrives while connect() still holds the socket lock (it
    does for IPv6 over veth: TcpExtLockDroppedIcmps) is otherwise only a "soft"
    error and connect() would wait for the SYN retransmit (~1 s)."""
    t0 = time.monotonic()
    fam = _family(ip)
    s = socket.socket(fam, socket.SOCK_STREAM)
    try:
        s.setblocking(False)
        _set_recverr(s, fam, True)
        if source_ip:
            s.bind((source_ip, 0))
        rc = s.connect_ex((ip, port))
        if rc not in (0, errno.EINPROGRESS):
            return _errno_result(rc, t0, "connect")
        poller = select.poll()
        poller.register(s, select.POLLOUT | select.POLLERR)
        left = timeout - (time.monotonic() - t0)
        events = poller.poll(max(0, int(left * 1000))) if rc else [(s.fileno(), select.POLLOUT)]
        so_error = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if so_error:
            return _errno_result(so_error, t0, "connect")
        try:
            s.getpeername()
        except OSError:
            qerr = _errqueue_errno(s)
            if qerr:
                return _errno_result(qerr, t0, "connect(icmp)")
            return _err("timeout", t0, "connect timeout" if not events else "connect: not connected")
        lport = s.getsockname()[1]
        _set_recverr(s, fam, False)
        buf = b""
        while b"\n" not in buf:
            left = timeout - (time.monotonic() - t0)
            if left <= 0:
                return _err("timeout", t0, "no reply after connect", lport)
            s.settimeout(left)
            try:
                chunk = s.recv(4096)
            except BaseException as exc:  # noqa: BLE001
                out = _classify(exc)
                return _err("timeout" if out == "timeout" else "error", t0, "recv " + _detail(exc), lport)
            if not chunk:
                return _err("error", t0, "closed without reply", lport)
            buf += chunk
        return _ok(buf.split(b"\n", 1)[0], t0, lport)
    finally:
        s.close()


def _udp_once(ip: str, port: int, timeout: float, source_ip: str | None,
              source_port: int | None, seq: int) -> dict[str, Any]:
    t0 = time.monotonic()
    fam = _family(ip)
    s = socket.socket(fam, socket.SOCK_DGRAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Report every ICMP error (host unreachable is not "hard" without it).
        _set_recverr(s, fam, True)
        if source_ip or source_port:
            s.bind((source_ip or ("::" if fam == socket.AF_INET6 else "0.0.0.0"), source_port or 0))
        s.settimeout(timeout)
        try:
            s.connect((ip, port))
        except BaseException as exc:  # noqa: BLE001
            return _err(_classify(exc), t0, "connect " + _detail(exc))
        lport = s.getsockname()[1]
        send_note = ""
        try:
            s.send(f"probe {seq}\n".encode())
        except PermissionError as exc:
            # Dropped/rejected by local netfilter (OUTPUT): an ICMP error may follow.
            send_note = "send " + _detail(exc) + "; "
        except BaseException as exc:  # noqa: BLE001
            return _err(_classify(exc), t0, "send " + _detail(exc), lport)
        try:
            data = s.recv(65535)
        except BaseException as exc:  # noqa: BLE001
            return _err(_classify(exc), t0, send_note + "recv " + _detail(exc), lport)
        return _ok(data.split(b"\n", 1)[0], t0, lport)
    finally:
        s.close()


def probe(spec: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for i in range(int(spec["count"])):
        if spec["proto"] == "tcp":
            out.append(_tcp_once(spec["ip"], spec["port"], spec["timeout"], spec.get("source_ip")))
        else:
            out.append(_udp_once(spec["ip"], spec["port"], spec["timeout"], spec.get("source_ip"),
                                 spec.get("source_port"), i))
        if spec.get("interval"):
            time.sleep(spec["interval"])
    return out


def main(argv: list[str]) -> int:
    if argv and argv[0] == "serve":
        args = argv[1:]
        tcp, udp = "--no-tcp" not in args, "--no-udp" not in args
        args = [a for a in args if not a.startswith("--")]
        serve(args[0], [int(p) for p in args[1:]], tcp, udp)
        return 0
    if argv and argv[0] == "probe":
        json.dump(probe(json.loads(argv[1])), sys.stdout)
        return 0
    sys.stderr.write(__doc__ or "")
    return 2


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:
        sys.exit(130)
