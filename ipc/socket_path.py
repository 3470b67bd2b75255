"""Where a sidecar's engine socket is when nobody names it.

One rule for both ends: ``kvsidecar serve`` listens there by default and an
engine's client (the vLLM connector, ``kvsidecar status``) looks there by
default, so the two meet when they run as the same user with the same
environment. Anything else (another user, a systemd unit for the sidecar and
none for the engine) names the socket explicitly.
"""

from __future__ import annotations

import os


def default_socket(device: str) -> str:
    """``$RUNTIME_DIRECTORY/<dev>.sock`` (systemd's ``RuntimeDirectory=``, owned by
    the service's user), else ``$XDG_RUNTIME_DIR/kvsidecar/<dev>.sock``, else
    ``/tmp/kvsidecar-<euid>/<dev>.sock`` (a per-user directory: a shared name in
    /tmp could be taken by another user first); ``<dev>`` is the device without
    its colon (``cuda:0`` -> ``cuda0``)."""
    name = f"{device.replace(':', '')}.sock"
    runtime = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
    if runtime:
        return os.path.join(runtime, name)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return os.path.join(xdg, "kvsidecar", name)
    return os.path.join("/tmp", f"kvsidecar-{os.geteuid()}", name)
