"""Peer addresses: ``host:port`` (IPv6 hosts in brackets), as both ends spell them.

A sidecar with member keys advertises ``host:port/<64 hex>``: its CURVE public
key, which the reader dials (see :mod:`~kvsidecar.daemon.peer_auth`).
"""

from __future__ import annotations

__all__ = ["check_address", "ipv6", "normalise", "split_address", "split_key"]


def split_key(address: str) -> tuple[str, bytes | None]:
    """``host:port/<64 hex>`` -> (``host:port``, the 32-byte key); anything else
    -> (address, None): it names no key (and is dialled, or refused, as it is)."""
    addr = address.removeprefix("tcp://")
    head, sep, tail = addr.rpartition("/")
    if not sep or len(tail) != 64:
        return address, None
    try:
        return head, bytes.fromhex(tail)
    except ValueError:
        return address, None



def split_address(address: str) -> tuple[str, str]:
    """``host:port`` or ``tcp://host:port`` (either with a key after a slash)
    -> (host, port); IPv6 hosts in brackets."""
    addr = split_key(address)[0].removeprefix("tcp://")
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port:
        raise ValueError(f"expected host:port, got {address!r}")
    return host, port


def normalise(address: str) -> str:
    """``host:port`` (with ``/<key>`` when the address names one)."""
    host, port = split_address(address)
    key = split_key(address)[1]
    return f"{host}:{port}" + (f"/{key.hex()}" if key is not None else "")


def ipv6(host: str) -> bool:
    return host.startswith("[") or ":" in host


def check_address(address: str) -> None:
    """Raise ValueError unless ``address`` is ``host:port`` in printable ASCII
    without spaces: an engine names its peers' addresses, they reach log lines
    and errors as they are (a newline in one would forge log lines), and
    libzmq dials nothing else anyway."""
    if not (address.isascii() and address.isprintable()) or " " in address:
        raise ValueError(f"handshake address {address[:300]!r} is not printable ASCII "
                         "without spaces")
    split_address(address)

