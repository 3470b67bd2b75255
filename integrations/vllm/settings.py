"""The connector's settings (``kv_connector_extra_config``) and the sidecar it needs.

:class:`Settings` parses ``kv_connector_extra_config`` (unknown keys are
refused at start-up); :func:`memory_for` checks where the KV cache lives
against the worker's device. The ``*_MINOR`` constants are the sidecar
protocol minors that brought what the connector uses: a worker refuses a
sidecar older than :data:`NEEDS_MINOR` or :data:`TOKEN_MINOR` at start-up and
does without the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...ipc.hold_token import ENGINE_TOKEN_LIFE_S
from ...ipc.protocol import MAX_HOLD_S, MemoryKind
from ...ipc.socket_path import default_socket
from .layout import UnsupportedConfig

NULL_BLOCK = 0
"""vLLM's null block: padding for skipped positions, never transferred or read into."""

TESTED_VLLM = ("0.33.0",)

NEEDS_MINOR = 1
"""The sidecar protocol minor this connector relies on (``received`` completions
carry their descriptor count); an older sidecar is refused at start-up."""
RESERVE_MINOR = 2
"""The minor that brought reservations (``memory`` other than ``shm``)."""
BATCH_MINOR = 5
"""The minor that brought batches: a step's holds (and reads) go in one message."""
KEEPALIVE_MINOR = 9
"""The minor that brought keepalive pings (``Ping.engines``): before it an idle
worker is released after the sidecar's ``--engine-lease``."""
REPAIR_PAUSE_S = 1.0
"""After a sidecar did not answer, or the rank could not register again: tried
again this long after (doubling, up to REPAIR_MAX_S, while it keeps failing)."""
REPAIR_MAX_S = 30.0
KEEP_MINOR = 10
"""The minor that brought ``Keep``: before it D does not keep P's holds while
its requests wait (they then live P's hold timeout)."""
DEFAULT_HOLD_TIMEOUT_S = 30.0
"""How long P's sidecar keeps blocks no reader claimed (vLLM NixlConnector's
``kv_lease_duration``): the time for D to admit the request; from then on D
keeps them (``keep_every_s``) until it reads, and a D that is gone lets them
go one ``--hold-lease`` after its last claim."""
TOKEN_MINOR = 11
"""The minor that brought hold tokens (a sidecar without them cannot be read from)."""
TOKEN_LIFE_S = ENGINE_TOKEN_LIFE_S
"""How long the hold tokens the scheduler issues are valid (past vLLM's 480 s hold;
twice the hold timeout when that is longer): what P's sidecar expects of an
engine's own tokens (:data:`~kvsidecar.ipc.hold_token.ENGINE_TOKEN_LIFE_S`)."""


@dataclass(frozen=True)
class Settings:
    """``kv_connector_extra_config`` keys (all optional).

    ``sidecar_socket``: the rank's sidecar socket; ``{rank}`` / ``{local_rank}``
    are filled in (default: the sidecar's own default for the device).
    ``sidecar_sockets``: one socket per tp rank instead.
    ``hold_timeout_s``: how long P's sidecar keeps blocks no reader claimed
    (default DEFAULT_HOLD_TIMEOUT_S; a D that admitted the request keeps
    claiming it every ``keep_every_s`` until it reads). ``client_timeout_s``:
    per call (10 s).
    ``memory``: where the KV cache lives (:func:`memory_for`): ``memfd``
    (CPU default), ``shm``, or on a GPU ``cuda_vmm`` / ``cuda_malloc``.
    ``kernel_block_size``: tokens per attention kernel block. Not needed: the
    worker reads it from the attention views vLLM registers (and refuses a
    setting that disagrees); it only shapes the scheduler's start-up check.
    """

    sidecar_socket: str | None = None
    sidecar_sockets: tuple[str, ...] = ()
    hold_timeout_s: float | None = None
    client_timeout_s: float = 10.0
    keep_every_s: float = 3.0
    kernel_block_size: int | None = None
    memory: str | None = None

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> Settings:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(k for k in extra if k not in known)
        if unknown:
            raise UnsupportedConfig(
                f"unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)}"
            )
        socks = extra.get("sidecar_sockets") or ()
        hold = extra.get("hold_timeout_s")
        if hold is not None and not 0 < float(hold) <= MAX_HOLD_S:
            # Refused here, not by P's sidecar on every hold: the scheduler hands
            # out each hold's token before its worker holds.
            raise UnsupportedConfig(f"hold_timeout_s {hold} is out of range: more than 0, "
                                    f"at most {MAX_HOLD_S:g} s")
        kbs = extra.get("kernel_block_size")
        memory = extra.get("memory")
        return cls(extra.get("sidecar_socket"), tuple(str(s) for s in socks),
                   DEFAULT_HOLD_TIMEOUT_S if hold is None else float(hold),
                   float(extra.get("client_timeout_s", 10.0)),
                   float(extra.get("keep_every_s", 3.0)),
                   None if kbs is None else int(kbs),
                   None if memory is None else str(memory))

    def socket_for(self, rank: int, local_rank: int, device: str) -> str:
        if self.sidecar_sockets:
            if rank >= len(self.sidecar_sockets):
                raise UnsupportedConfig(f"sidecar_sockets names {len(self.sidecar_sockets)} "
                                        f"sockets, rank {rank} has none")
            return self.sidecar_sockets[rank]
        if self.sidecar_socket:
            return self.sidecar_socket.format(rank=rank, local_rank=local_rank)
        return default_socket(device)



def socket_device(device_type: str, index: int | None) -> str:
    """The device a worker's default sidecar socket is named for, as ``kvsidecar
    serve --device`` names it: ``cpu``, or the GPU with its index (``cuda:1``:
    ``serve --device cuda:1`` listens on ``cuda1.sock``)."""
    return device_type if device_type == "cpu" or index is None else f"{device_type}:{index}"


HOST_MEMORY = ("shm", "memfd")
GPU_MEMORY = ("cuda_vmm", "cuda_malloc")


def memory_for(device: str, memory: str | None) -> MemoryKind:
    """Where the KV cache lives, checked at start-up against the worker's device.

    CPU: ``memfd`` (default; a reservation the sidecar allocates and owns,
    the same path as on a GPU) or ``shm`` (POSIX shared memory the connector
    creates, registered in attach mode). GPU: only a sidecar reservation of
    GPU memory (``cuda_vmm`` or ``cuda_malloc``), and only when asked for: the
    path runs on CPU here and is untested with a GPU.
    """
    if device == "cpu":
        if memory in (None, *HOST_MEMORY):
            return "memfd" if memory is None else memory  # type: ignore[return-value]
        raise UnsupportedConfig(f"memory {memory!r} is GPU memory but this vLLM worker runs on "
                                f"the CPU; use one of {HOST_MEMORY}")
    if memory in GPU_MEMORY:
        return memory  # type: ignore[return-value]
    raise UnsupportedConfig(
        f"kvsidecar on a {device!r} worker needs its KV cache in GPU memory the sidecar "
        f"allocates: set kv_connector_extra_config \"memory\" to one of {GPU_MEMORY} "
        "(not yet run with vLLM on a GPU; see the README, 'Use it with vLLM')")
