"""Which address peers should dial when the handshake server binds a wildcard.

``gethostname()`` often resolves to 127.0.1.1 or to nothing at all inside a
container, so it is not used. Instead: the address of the interface that
holds the default route (the one other hosts reach this host through), else
the first non-loopback address, read from the kernel (``/proc/net/route``,
``/proc/net/if_inet6`` and ``SIOCGIFADDR``). Nothing is sent anywhere.
IPv6 addresses come back in brackets, ready for ``host:port``.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import socket
import struct

__all__ = ["WILDCARDS", "bracket", "routable_address"]

WILDCARDS = ("0.0.0.0", "*", "::", "[::]", "")
_SIOCGIFADDR = 0x8915


def bracket(host: str) -> str:
    """``::1`` -> ``[::1]``; anything else unchanged."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _ipv4_of(ifname: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                              struct.pack("256s", ifname.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(raw[20:24])


def _default_route_interfaces() -> list[str]:
    out = []
    with contextlib.suppress(OSError), open("/proc/net/route") as f:
        for line in f.readlines()[1:]:
            parts = line.split()
            if len(parts) > 2 and parts[1] == "00000000":
                out.append(parts[0])
    return out


def _ipv6_addresses() -> list[tuple[str, str]]:
    """(interface, address) of global-scope IPv6 addresses."""
    out = []
    with contextlib.suppress(OSError), open("/proc/net/if_inet6") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[3] == "00":  # scope global
                addr = ipaddress.IPv6Address(bytes.fromhex(parts[0]))
                out.append((parts[5], str(addr)))
    return out


def routable_address(ipv6: bool = False) -> str | None:
    """This host's address for peers, or None when it has none but loopback."""
    routes = _default_route_interfaces()
    if ipv6:
        addrs = _ipv6_addresses()
        addrs.sort(key=lambda a: a[0] not in routes)
        return bracket(addrs[0][1]) if addrs else None
    names = routes + [n for _, n in socket.if_nameindex() if n not in routes]
    for name in names:
        addr = _ipv4_of(name)
        if addr is not None and not ipaddress.IPv4Address(addr).is_loopback:
            return addr
    return None
