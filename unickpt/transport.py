"""Every use of torch.distributed in unickpt lives here.

:class:`Comm` wraps a process group (or no group at all: a single process) and offers the
few operations save and load need: exchange of small byte strings, agreement on success or
failure, and batched point-to-point transfers of host tensors. Pieces always travel as host
(CPU) tensors: with an NCCL group a gloo side group over the same ranks carries them, and
device tensors are copied to host in bounded chunks by the caller.
"""

from __future__ import annotations

import os
import socket
import traceback
from typing import Sequence

import torch
import torch.distributed as dist

from .errors import DistributedError, UnickptError, as_typed

__all__ = ["Comm", "node_id", "LOCAL"]

LOCAL = "local"
"""Pass as ``group`` to load in this process alone, even under torch.distributed."""

_SIDE_GROUPS: dict[int, object] = {}


def node_id() -> str:
    """Identity of the node this process runs on: ``UNICKPT_NODE_ID``, else the launcher's
    node rank (``GROUP_RANK`` under torchrun, ``SLURM_NODEID`` under srun), else the host name."""
    v = os.environ.get("UNICKPT_NODE_ID")
    if v:
        return v
    for var in ("GROUP_RANK", "SLURM_NODEID"):
        v = os.environ.get(var)
        if v:
            return f"node{v}"
    return socket.gethostname()


class Comm:
    """A process group, or a single process when torch.distributed is not initialised."""

    def __init__(self, group=None) -> None:
        # group="local": this process alone, even when torch.distributed is initialised
        self.active = group != "local" and dist.is_available() and dist.is_initialized()
        if group == "local":
            group = None
        if not self.active:
            if group is not None:
                raise DistributedError("a group was given but torch.distributed is not initialised")
            self.group = None
            self.rank, self.world = 0, 1
            self.p2p_group = None
            return
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        if self.rank < 0:
            raise DistributedError("this process is not a member of the given group")
        backend = str(dist.get_backend(self.group)).lower()
        if "gloo" in backend:
            self.p2p_group = self.group
        else:  # NCCL & co: host tensors travel on a gloo group over the same ranks
            key = id(self.group)
            if key not in _SIDE_GROUPS:  # only the group's members call this: local synchronization
                ranks = dist.get_process_group_ranks(self.group)
                _SIDE_GROUPS[key] = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)
            self.p2p_group = _SIDE_GROUPS[key]

    # -- small collectives ---------------------------------------------------------------

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's byte string, on every rank (two collectives: lengths, then padded data)."""
        if not self.active or self.world == 1:
            return [bytes(data)]
        g = self.p2p_group
        n = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(sizes, n, group=g)
        m = max(int(s.item()) for s in sizes)
        buf = torch.zeros(max(m, 1), dtype=torch.uint8)
        if data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        outs = [torch.empty_like(buf) for _ in range(self.world)]
        dist.all_gather(outs, buf, group=g)
        return [bytes(o[: int(s.item())].numpy().tobytes()) for o, s in zip(outs, sizes)]

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        """Rank ``src``'s byte string on every rank."""
        if not self.active or self.world == 1:
            assert data is not None
            return bytes(data)
        g = self.p2p_group
        n = torch.tensor([len(data) if self.rank == src else 0], dtype=torch.int64)
        dist.broadcast(n, group=g, group_src=src)
        buf = torch.empty(max(int(n.item()), 1), dtype=torch.uint8)
        if self.rank == src and data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        dist.broadcast(buf, group=g, group_src=src)
        return bytes(buf[: int(n.item())].numpy().tobytes())

    def agree(self, error: BaseException | None, what: str) -> None:
        """Collective: raise on every rank if any rank failed.

        The failing rank re-raises its own exception; the others raise
        :class:`DistributedError` quoting the first failure, so no rank goes on alone into a
        later collective and hangs.
        """
        if error is not None:
            error = as_typed(error)
        if not self.active or self.world == 1:
            if error is not None:
                raise error
            return
        msg = b""
        if error is not None:
            msg = f"{type(error).__name__}: {error}".encode()[:4000] or b"error"
        msgs = self.all_gather_bytes(msg)
        if error is not None:
            raise error
        for r, m in enumerate(msgs):
            if m:
                raise DistributedError(f"{what} failed on rank {r}: {m.decode(errors='replace')}")

    def barrier(self) -> None:
        if self.active and self.world > 1:
            dist.barrier(group=self.p2p_group)

    # -- point to point --------------------------------------------------------------------

    def exchange(
        self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]]
    ) -> None:
        """Post every send and receive at once, then wait for all of them.

        Peers are group ranks. Messages between one pair of ranks match in the order they are
        listed, so both sides must list them in the same deterministic order.
        """
        if not sends and not recvs:
            return
        if not self.active:
            raise DistributedError("point-to-point transfer without an initialised process group")
        ops = []
        for peer, t in recvs:
            ops.append(dist.P2POp(dist.irecv, t, group=self.p2p_group, group_peer=peer))
        for peer, t in sends:
            ops.append(dist.P2POp(dist.isend, t, group=self.p2p_group, group_peer=peer))
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def describe(exc: BaseException) -> str:
    """One-line description of an exception, with its origin for unexpected ones."""
    if isinstance(exc, UnickptError):
        return str(exc)
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" at {tb[-1].filename}:{tb[-1].lineno}" if tb else ""
    return f"{type(exc).__name__}: {exc}{where}"
