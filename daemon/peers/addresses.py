"""Peer addresses: ``host:port`` (IPv6 hosts in brackets), as both ends spell them."""

from __future__ import annotations

__all__ = ["check_address", "ipv6", "normalise", "split_address"]



def split_address(address: str) -> tuple[str, str]:
    """``host:port`` or ``tcp://host:port`` -> (host, port); IPv6 hosts in brackets."""
    addr = address.removeprefix("tcp://")
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port:
        raise ValueError(f"expected host:port, got {address!r}")
    return host, port


def normalise(address: str) -> str:
    host, port = split_address(address)
    return f"{host}:{port}"


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

