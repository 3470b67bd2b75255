"""Peer addresses: ``host:port`` (IPv6 hosts in brackets), as both ends spell them."""

from __future__ import annotations

__all__ = ["ipv6", "normalise", "split_address"]



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
