"""Baseline: the same number of bytes moved by one raw NIXL READ, no sidecar.

Two processes, two bare ``nixl_agent`` objects (UCX, progress thread off), one
descriptor each side over shared memory: the best case the sidecar's reads
are compared with. The target keeps progressing its UCX worker (wire-up needs
it) until the initiator's notification says it is done.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from multiprocessing.connection import Connection
from typing import Any

from kvsidecar.ipc.memory import ShmRegion, unique_name


def _agent(name: str) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def _descs(base: int, nbytes: int, ndesc: int) -> list[tuple[int, int, int]]:
    """``ndesc`` equal pieces of ``nbytes``, every other slot of a 2x buffer, so
    no two are adjacent (NIXL never merges them anyway; the stride keeps it fair)."""
    size = nbytes // ndesc
    return [(base + 2 * i * size, size, 0) for i in range(ndesc)]


def _target(nbytes: int, conn: Connection) -> None:
    agent = _agent("raw-target")
    with ShmRegion.create(unique_name("raw"), nbytes) as region:
        region.numpy()[:] = 7
        descs = agent.get_reg_descs([(region.address, nbytes, 0, "")], "DRAM")
        agent.register_memory(descs)
        conn.send((agent.get_agent_metadata(), region.address))
        done = False
        while not done:
            for msgs in agent.get_new_notifs().values():
                done = done or b"stop" in msgs
            time.sleep(0.0001)
        agent.deregister_memory(descs)


def raw_read_seconds(nbytes: int, repeats: int = 3, descriptors: int = 1) -> float:
    """Best wall time of one READ of ``nbytes`` cross-process, as one descriptor or
    as ``descriptors`` scattered pieces."""
    span = nbytes if descriptors == 1 else 2 * nbytes
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(span, child), daemon=True)
    proc.start()
    agent = _agent("raw-initiator")
    try:
        with ShmRegion.create(unique_name("raw"), span) as region:
            reg = agent.get_reg_descs([(region.address, span, 0, "")], "DRAM")
            agent.register_memory(reg)
            if not parent.poll(60):
                raise RuntimeError("raw NIXL target did not start")
            meta, remote_addr = parent.recv()
            peer = agent.add_remote_agent(meta)
            local = agent.get_xfer_descs(_descs(region.address, nbytes, descriptors), "DRAM")
            remote = agent.get_xfer_descs(_descs(remote_addr, nbytes, descriptors), "DRAM")
            best = float("inf")
            for i in range(repeats + 1):  # the first one wires up
                t0 = time.perf_counter()
                h = agent.initialize_xfer("READ", local, remote, peer, b"")
                state = agent.transfer(h)
                while state not in ("DONE", "ERR"):
                    state = agent.check_xfer_state(h)
                dt = time.perf_counter() - t0
                agent.release_xfer_handle(h)
                if state == "ERR":
                    raise RuntimeError("raw NIXL read failed")
                if i:
                    best = min(best, dt)
            if int(region.numpy()[0]) != 7:
                raise RuntimeError("raw NIXL read moved no data")
            agent.send_notif(peer, b"stop")
            for _ in range(100):
                agent.get_new_notifs()
                time.sleep(0.001)
            agent.deregister_memory(reg)
            return float(best)
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
