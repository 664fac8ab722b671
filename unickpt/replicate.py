"""Replication of node-local checkpoint files to peer nodes (the memory tier).

A node-local save (``{node}`` in the path) leaves each node's files in that node's own
directory, so losing a node loses its files. With ``replicas=R``, after every data file is
written and before anything is committed, each file is also copied into the temporary
directories of the ``R`` nodes that follow its node (in the order nodes first appear among
the ranks, wrapping around), over ``torch.distributed`` point-to-point transfers: the file's
writer reads it back (node-local memory or disk) in chunks of :data:`CHUNK` bytes and sends
each to the managing rank (the first rank) of every replica node, which writes it at the
same offset. Each node then commits its directory, holding its own files and its replicas,
with the same manifest, which lists for every file the nodes that hold copies
(``FileEntry.replicas``). A load needs nothing more: a node that holds a file, original or
copy, reads it (see :mod:`unickpt.loading`: node-local loads read what a node's directory holds and
receive the rest).

Memory: one buffer of at most :data:`CHUNK` bytes per (sender, receiver) pair a rank takes
part in, reused by every step (a fresh zeroed buffer per chunk cost a page fault per 4 KiB
and a pass of zeros over every byte replicated).
"""

from __future__ import annotations

import json
import mmap
import os
from typing import Callable

import torch

from .errors import InvalidArgumentError
from .io.storage import Storage, per_node
from .plan import SavePlan
from .transport import Comm


__all__ = ["problem", "replicate", "replica_nodes", "CHUNK"]

CHUNK = 32 << 20


def replica_nodes(nodes: list[str], node: str, replicas: int) -> list[str]:
    """The ``replicas`` nodes after ``node`` in ``nodes`` (distinct, in order), wrapping around."""
    i = nodes.index(node)
    return [nodes[(i + k) % len(nodes)] for k in range(1, replicas + 1)]


def problem(plan: SavePlan, storage: Storage, path, replicas: int) -> InvalidArgumentError | None:
    """Why ``replicas`` cannot be made for this save (checked once the plan is known, before
    anything is written), or None."""
    nodes = list(dict.fromkeys(plan.nodes))
    if not per_node(path):
        return InvalidArgumentError(f"{os.fspath(path)}: replicas need node-local storage ({{node}} in the path)")
    if replicas > len(nodes) - 1:
        return InvalidArgumentError(f"replicas={replicas} but the job spans {len(nodes)} node(s): "
                                    f"at most {len(nodes) - 1} other node(s) can hold copies")
    if not storage.caps.atomic_rename:
        return InvalidArgumentError(f"{os.fspath(path)}: replicas need a local file system (not an object store)")
    return None


def replicate(comm: Comm, plan: SavePlan, storage: Storage, tmp: str, name_of: Callable[[str], str], replicas: int,
              dir_rank: bool) -> dict[str, list[str]]:
    """Collective: copy every data file this rank wrote into the temporary directories of
    its replica nodes (:func:`problem` found nothing wrong); returns ``{planned file name:
    [nodes holding a copy]}`` (the same on every rank). Raises (on every rank) when the
    copies could not all be made."""
    nodes = list(dict.fromkeys(plan.nodes))

    def my_sizes() -> dict[str, int]:
        sizes = storage.file_sizes(tmp)
        return {f.name: sizes[name_of(f.name)] for f in plan.files_of(comm.rank)}

    mine = comm.step("save (replicas: sizes of the files written)", my_sizes)
    size = {}
    for blob in comm.all_gather_bytes(json.dumps(mine).encode(), "save (replicas)"):
        size.update(json.loads(blob))
    manager = {n: plan.nodes.index(n) for n in nodes}  # the first rank of each node
    copies: dict[str, list[str]] = {}
    pairs: dict[tuple[int, int], list[tuple[str, int, int]]] = {}  # (src, dst) -> chunks (file, offset, length)
    for f in plan.files:
        copies[f.name] = replica_nodes(nodes, f.node, replicas)
        for node in copies[f.name]:
            dst = manager[node]
            q = pairs.setdefault((f.writer, dst), [])
            n = size[f.name]
            q += [(f.name, a, min(CHUNK, n - a)) for a in range(0, n, CHUNK)] or [(f.name, 0, 0)]
    readers: dict = {}
    writers: dict = {}

    def create_copies() -> None:
        if dir_rank:  # this node's copies: files created at their size, filled below
            for (src, dst), chunks in pairs.items():
                if dst == comm.rank:
                    for name in dict.fromkeys(c[0] for c in chunks):
                        p = storage.join(tmp, name_of(name))
                        storage.create_file(p, size[name])
                        writers[name] = storage.open_writer(p, direct=False, size=size[name])

    comm.step("save (replicas: creating the copies)", create_copies)
    err: BaseException | None = None
    steps = max((len(c) for c in pairs.values()), default=0)
    bufs: dict[tuple[int, int], torch.Tensor] = {}  # one per pair this rank sends or receives on, reused

    def buf_of(pair: tuple[int, int]) -> torch.Tensor:
        b = bufs.get(pair)
        if b is None:
            b = bufs[pair] = torch.empty(max(1, max(c[2] for c in pairs[pair])), dtype=torch.uint8)
        return b

    for t in range(steps):  # step t: every pair moves its t-th chunk
        sends, recvs, fills, maps = [], [], [], []
        for (src, dst), chunks in pairs.items():
            if t >= len(chunks) or src == dst:
                continue
            name, off, n = chunks[t]
            if src == comm.rank:
                buf = None
                if err is None and n:
                    try:
                        r = readers.get(name) or readers.setdefault(name, storage.open_reader(storage.join(tmp, name_of(name))))
                        if hasattr(r, "mapped") and off % mmap.ALLOCATIONGRANULARITY == 0:  # sent from the page cache's pages, not a copy
                            maps.append(r.mapped(off, n))
                            buf = torch.frombuffer(maps[-1], dtype=torch.uint8)
                        else:
                            buf = buf_of((src, dst))[:n]
                            r.readinto(off, memoryview(buf.numpy()))
                    except Exception as e:  # the transfer still happens (zeros): the peer is not left waiting
                        err = e
                        buf = None
                if buf is None:
                    buf = buf_of((src, dst))[: max(n, 1)].zero_()
                sends.append((dst, buf))
            elif dst == comm.rank:
                buf = buf_of((src, dst))[: max(n, 1)]
                recvs.append((src, buf))
                fills.append((name, off, n, buf))
        try:
            comm.exchange(sends, recvs)
        finally:
            sends.clear()  # the tensors over the maps go first
            buf = None
            for m in maps:
                try:
                    m.close()
                except BufferError:  # still referred to (a transfer that failed): closed when collected
                    pass
        for name, off, n, buf in fills:
            if err is None and n:
                try:
                    writers[name].write_at(off, memoryview(buf[:n].numpy()))
                except Exception as e:
                    err = e
    for r in readers.values():
        r.close()
    for w in writers.values():
        try:
            w.close()  # durable when it returns
        except Exception as e:
            err = err or e
    comm.agree(err, "save (replicating files to peer nodes)")
    return copies
