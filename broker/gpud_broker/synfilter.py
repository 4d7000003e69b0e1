"""The frontend listener's filter of held-off sources: a classic BPF socket filter
(``SO_ATTACH_FILTER``) on the listening TCP socket that drops the segments of held-off IPv4
addresses before the kernel completes their TCP handshake.

Why: ZeroMQ asks ZAP only once the CURVE handshake has been worked through, and its monitor tells
the broker of a connection only once it is accepted; by the time the gate (``gate.ConnectionGate``)
shuts a held-off source's connection down, libzmq's I/O thread has usually done that handshake's
cryptography already (a few scalar multiplications, 100-300 us each), and an honest client whose
connection shares that I/O thread waits behind a burst of them. A filter on the listener costs the
kernel a few instructions per segment and libzmq nothing: the dropped SYN is never accepted.

A held-off address still gets one SYN in ``KEEP_ONE_IN`` through (chosen at random by the kernel),
so that a known client sharing the address with an outsider gets in, more slowly (its SYN is
retransmitted), as the gate lets it. At most ``MAX_SOURCES`` addresses are in the filter (the
newest); IPv6 sources are not filtered here (the gate's shut-down still applies to them).

The kernel copies a listener's filter to every connection it accepts; the broker takes it off
each connection it admits (``attach(fd, None)``), or a known client that got through would lose
most of its segments for the connection's whole life.

Pure except ``attach``, ``attached`` and ``listening_fd``, which touch the socket.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import socket
import struct

SO_ATTACH_FILTER = 26
SO_DETACH_FILTER = 27
MAX_SOURCES = 250  # a jump's offset is one byte: the program stays within reach of its labels
KEEP_ONE_IN = 8  # SYNs of a held-off address let through, one in this many

_SKF_NET_OFF = -0x100000  # loads relative to the network (IP) header
_SKF_AD_RANDOM = -0x1000 + 56  # the ancillary "random number" load
_LDB_ABS = 0x30  # BPF_LD | BPF_B | BPF_ABS
_LDW_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_RSH_K = 0x74  # BPF_ALU | BPF_RSH | BPF_K
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K
_KEEP, _DROP = 0xFFFFFFFF, 0


def _op(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k & 0xFFFFFFFF)


def ipv4_sources(sources: list[str]) -> list[int]:
    """The IPv4 addresses among ``sources`` (the gate's source names), as numbers, the last
    ``MAX_SOURCES`` of them."""
    found = []
    for source in sources:
        try:
            ip = ipaddress.ip_address(source)
        except ValueError:
            continue
        if isinstance(ip, ipaddress.IPv4Address):
            found.append(int(ip))
    return found[-MAX_SOURCES:]


def program(addresses: list[int], keep_one_in: int = KEEP_ONE_IN) -> bytes:
    """The filter for IPv4 ``addresses`` (numbers, at most MAX_SOURCES): a segment from one of
    them is dropped unless the kernel's random number falls in the kept 1/``keep_one_in``; every
    other segment (other addresses, IPv6) is kept."""
    if len(addresses) > MAX_SOURCES:
        raise ValueError(f"at most {MAX_SOURCES} addresses in one filter")
    n = len(addresses)
    ops = [_op(_LDB_ABS, 0, 0, _SKF_NET_OFF),  # 0: the IP header's first byte
           _op(_RSH_K, 0, 0, 4),  # 1: its version
           _op(_JEQ_K, 0, n + 1, 4),  # 2: IPv4 goes on, the rest to "keep" (3 + n + 1 - 3)
           _op(_LDW_ABS, 0, 0, _SKF_NET_OFF + 12)]  # 3: the source address
    for i, address in enumerate(addresses):  # 4 + i: to "held" (5 + n) when it matches
        ops.append(_op(_JEQ_K, n - i, 0, address))
    ops.append(_op(_RET_K, 0, 0, _KEEP))  # 4 + n: keep
    kept_below = (1 << 32) // max(1, keep_one_in)
    ops += [_op(_LDW_ABS, 0, 0, _SKF_AD_RANDOM),  # 5 + n: held: a random number
            _op(_JGE_K, 1, 0, kept_below),  # 6 + n: most go to "drop"
            _op(_RET_K, 0, 0, _KEEP),  # 7 + n: the one in keep_one_in
            _op(_RET_K, 0, 0, _DROP)]  # 8 + n: drop
    return b"".join(ops)


def attach(fd: int, code: bytes | None) -> None:
    """Set ``code`` (``program``'s) as the filter of the socket on ``fd`` (None: remove it). The
    kernel copies it; OSError when it refuses."""
    sock = socket.socket(fileno=fd)
    try:
        if code is None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, SO_DETACH_FILTER, 0)
            except OSError:
                pass  # none was attached
            return
        buf = ctypes.create_string_buffer(code, len(code))
        fprog = struct.pack("HL", len(code) // 8, ctypes.addressof(buf))
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)
    finally:
        sock.detach()


def attached(fd: int) -> bool:
    """Whether the socket on ``fd`` has a filter (``SO_GET_FILTER``)."""
    sock = socket.socket(fileno=fd)
    try:
        return len(sock.getsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, 1024)) > 0
    except OSError:
        return True  # larger than asked for
    finally:
        sock.detach()


def listening_fd(port: int) -> int | None:
    """The descriptor of this process's listening TCP socket on local ``port`` (libzmq's: it does
    not tell it otherwise), or None."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return None
    for name in names:
        fd = int(name)
        try:
            if not os.path.islink(f"/proc/self/fd/{name}") or not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            if (sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6)
                    and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) and sock.getsockname()[1] == port):
                return fd
        except OSError:
            pass
        finally:
            sock.detach()
    return None
