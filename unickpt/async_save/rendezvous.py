"""How the writers of a group meet: the group's rank 0 trainer serves a TCP store
(:func:`serve`) at an address the other ranks' writers can reach (:func:`address`), and
every writer passes a gate on it (:func:`pass_gate`) before ``init_process_group``, which a
trainer whose writer dies before arriving closes with the reason (:func:`watch_joining`),
so the others fail at once rather than after their timeout."""

from __future__ import annotations

import os
import select

from .._metrics import log
from ..errors import AsyncSaveError

__all__ = ["serve", "address", "gate_keys", "pass_gate", "watch_joining"]

_GATE_OPEN = b"open"


def serve(timeout_s: float):
    """The writers' rendezvous, served by the trainer of the group's rank 0: a TCP store that
    listens on every interface, on a port the kernel picks at bind time and this process
    holds from then on (no port is picked, released and bound again later by another
    process, which a third could take in between). One per group of writers: a new group
    (a restart) gets a new store, and the old one's keys (~170 bytes + 8 per rank, per
    rank) go with it. Its own client connects over the loopback, which always answers."""
    import datetime

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def address() -> str:
    """Where the other ranks' writers reach this host (the trainer of the group's rank 0):
    ``UNICKPT_WRITER_ADDR`` when set (for hosts the others reach at an address of their
    own, e.g. behind a NAT); else ``MASTER_ADDR`` (default 127.0.0.1) when this is the
    job's rank 0, whose host that is; otherwise (the rank 0 of a subgroup) this host's own
    address on its route to ``MASTER_ADDR`` (a UDP socket's local address once connected:
    nothing is sent)."""
    import socket

    import torch.distributed as dist

    if os.environ.get("UNICKPT_WRITER_ADDR"):
        return os.environ["UNICKPT_WRITER_ADDR"]
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if not dist.is_initialized() or dist.get_rank() == 0:
        return master
    try:
        for family, kind, proto, _, sockaddr in socket.getaddrinfo(master, 9, type=socket.SOCK_DGRAM):
            with socket.socket(family, kind, proto) as s:
                s.connect(sockaddr)
                return s.getsockname()[0]
    except OSError as e:
        log.warning("cannot find this host's address towards MASTER_ADDR %s (%s): the writers will look for "
                    "their rendezvous there", master, e)
    return master


def gate_keys(gate: str) -> tuple[str, str]:
    """Keys of a writers' group's gate on its rendezvous store (:func:`pass_gate`), apart
    from the group's own; ``gate`` is the group's random name, so a late word meant for an
    earlier group (whose store's port a new store may have taken) reaches no key here."""
    return f"unickpt/writers/{gate}/arrived", f"unickpt/writers/{gate}/gate"


def pass_gate(store, world: int, gate: str, timeout) -> None:
    """Wait until every writer of the group has reached its rendezvous store, or one of them
    is known never to: the last to arrive opens the gate (``open``); the trainer of a writer
    that exits (or cannot start) before arriving closes it with the reason
    (:func:`watch_joining`). ``compare_set`` on a missing key sets it, so the first word
    stands. Without it, the other writers would wait for the missing one in
    ``init_process_group`` until ``timeout``. Raises AsyncSaveError with the reason."""
    arrived, key = gate_keys(gate)
    if store.add(arrived, 1) >= world:
        store.compare_set(key, "", _GATE_OPEN.decode())
    store.wait([key], timeout)
    said = store.get(key)
    if said != _GATE_OPEN:
        raise AsyncSaveError(said.decode(errors="replace"))


def watch_joining(joined_r: int, addr: str, port: int, gate: str, why: str, limit: float) -> None:
    """The trainer's side of :func:`pass_gate`, in a thread while its writer starts: the
    writer writes a byte to ``joined_r``'s pipe once it has joined its group; the pipe's end
    without that byte means it exited (or was killed, or never started) before, and then the
    gate of the other writers is closed with ``why`` (a no-op once it is open), so they fail
    at once rather than after their timeout. Gives up after ``limit`` seconds (by then the
    group has formed or the writers have timed out)."""
    import datetime

    import torch.distributed as dist

    try:
        waiting = select.poll()  # (not select(): a trainer may hold more than FD_SETSIZE descriptors)
        waiting.register(joined_r, select.POLLIN | select.POLLHUP)
        if not waiting.poll(limit * 1000) or os.read(joined_r, 1):
            return  # joined (or still starting after limit: its own timeout has passed)
        store = dist.TCPStore(addr, port, None, is_master=False, timeout=datetime.timedelta(seconds=30))
        store.compare_set(gate_keys(gate)[1], "", why)
    except Exception as e:  # the group then forms or times out on its own
        log.debug("could not tell the other writers that %s: %s", why, e)
    finally:
        os.close(joined_r)
