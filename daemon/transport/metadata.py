"""Peer NIXL agent metadata: what can be read from it before NIXL loads it.

NIXL's serialized metadata starts with the agent name. Knowing the name
before ``add_remote_agent`` lets the worker remove a stale entry first (NIXL
merges regions of a known name instead of replacing them).
"""

from __future__ import annotations

import struct

__all__ = ["peek_agent_name"]


_MD_PREFIX = b"nixlSerDes|Agent"


def peek_agent_name(metadata: bytes) -> str | None:
    """Read the agent name from NIXL's serialized metadata without loading it.

    Loading metadata for a known agent merges the new regions into the old
    ones, so the name must be known *before* the load to remove the stale entry
    first. The format is NIXL's serdes (tag, little-endian u64 length, value);
    if it ever changes this returns None and :meth:`NixlWorker.add_remote`
    falls back to loading first.
    """
    start = len(_MD_PREFIX) + 8
    if not metadata.startswith(_MD_PREFIX) or len(metadata) < start:
        return None
    (n,) = struct.unpack_from("<Q", metadata, len(_MD_PREFIX))
    if n == 0 or n > 4096 or start + n > len(metadata):
        return None
    try:
        return metadata[start : start + n].decode()
    except UnicodeDecodeError:
        return None
