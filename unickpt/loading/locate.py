"""Which checkpoint a load reads: a path or a root resolved to a committed checkpoint, its
manifest read by one rank and shared (:func:`find`), and whether it changed under a failed read
(:func:`changed`)."""

from __future__ import annotations

import os
from typing import Any, Mapping

from ..errors import CheckpointChangedError, CheckpointNotFoundError, FormatError, UnickptError
from ..format import Hasher
from ..io import catalog as _catalog
from ..io.storage import Storage, join_path, per_node, storage_for
from ..manifest import MANIFEST_NAME, Manifest
from ..transport import Comm


def read_manifest(path: str | os.PathLike, *, group=None,
                  storage_options: Mapping[str, Any] | None = None) -> tuple[str, Manifest]:
    """Resolve ``path`` to a committed checkpoint and parse its manifest.

    Single process by default. With ``group`` (``"world"`` for the default group), collective:
    one rank reads and shares the manifest (node-local paths: the lowest rank whose node
    holds it), and the returned path keeps ``{node}`` so it can be passed to :func:`load`.
    ``storage_options``: options of the fsspec file system of a URL (docs/storage.md)."""
    if group is not None:
        comm = Comm(None if group == "world" else group)
        storage, p = storage_for(path, storage_options)
        _, rel, man = find(comm, storage, p, per_node(path))
        return (join_path(path, rel) if rel else os.fspath(path)), man
    storage, p = storage_for(path, storage_options)
    ckpt, _, man = _catalog.open_checkpoint(storage, p)
    return ckpt, man


read_manifest_bytes = _catalog.read_manifest_bytes


def note_older_steps(e: BaseException, path, storage_options) -> None:
    """A damaged checkpoint that ``path`` resolved to as the newest under a root: a note
    naming the older committed ones (:func:`unickpt.io.catalog.note_older`)."""
    try:
        storage, p = storage_for(path, storage_options)
        ckpt = _catalog.resolve(storage, p)
    except Exception:  # (a note only: the load's own error is what matters)
        return
    if ckpt != p:
        _catalog.note_older(e, storage, os.fspath(path), ckpt)


def changed(storage: Storage, ckpt: str, man: Manifest) -> CheckpointChangedError | None:
    """After a failed read: the error to report if the checkpoint was replaced meanwhile."""
    try:
        now = Hasher.of128(storage.read_bytes(storage.join(ckpt, MANIFEST_NAME), 1 << 30))
    except CheckpointNotFoundError:  # the checkpoint went away (retention, an overwrite's swap)
        now = None
    except (UnickptError, OSError):  # unreadable now: the original error is the one to report
        return None
    if now == man.source_digest:
        return None
    return CheckpointChangedError(f"{ckpt}: the checkpoint was replaced or removed while it was being read; load it again")


def find(comm: Comm, storage, p: str, node_local: bool, same: Mapping[str, Any] | None = None
         ) -> tuple[str, str, Manifest]:
    """Resolve the checkpoint and share its manifest: ``(checkpoint path, its name under
    p or "", manifest)``. Shared storage: rank 0 resolves. Node storage: every rank resolves
    in its node's directory; the lowest rank that found it sends the manifest, and every
    rank uses the same checkpoint name under its own root. ``same``: the load's arguments
    that every rank must give alike (compared in the first collective). A failure to find
    the checkpoint rides the broadcast's header (:meth:`Comm.defer`); one to parse or match
    this node's copy is agreed on before returning. Three collectives on shared storage,
    four on node storage, when nothing fails."""
    err: BaseException | None = None
    found, rel, mbytes = False, "", b""
    if comm.rank == 0 or node_local:
        try:
            ckpt = _catalog.resolve(storage, p)
            rel = "" if ckpt == p else storage.basename(ckpt)
            mbytes = read_manifest_bytes(storage, ckpt)
            found = True
        except (UnickptError, OSError) as e:
            err = e
    own = mbytes  # node-local: this node's copy, checked against the shared one below
    own_path = storage.join(ckpt, MANIFEST_NAME) if found else None
    if node_local:
        flags = [bool(f) for f in comm.all_gather_int(int(found), "load (finding the checkpoint on any node)",
                                                     same=same)]
        src = flags.index(True) if any(flags) else 0
        same = None  # (compared)
    else:
        src = 0
    if comm.rank == src:  # no rank found it: rank 0's reason, raised on every rank in the broadcast
        comm.defer(err, "load (finding the checkpoint)" + (" on any node" if node_local else ""))
    blob = comm.broadcast_bytes(rel.encode() + b"\0" + mbytes if comm.rank == src else None, src=src,
                                what="load (the manifest)", same=same)
    rel_b, _, mbytes = blob.partition(b"\0")
    rel = rel_b.decode()
    ckpt = storage.join(p, rel) if rel else p
    here = storage.join(ckpt, MANIFEST_NAME)
    # (node storage: another rank's path may differ from ours; never name our own file for its copy)
    where = here if comm.rank == src else (f"the {MANIFEST_NAME} rank {src} read on its node" if node_local
                                           else f"{here} (as rank {src} read it)")

    def parse() -> Manifest:
        man = _catalog.parse_checked(ckpt, mbytes, where)
        if node_local and comm.rank != src:  # every node's copy of this checkpoint must be the same manifest
            try:
                here = own if found and storage.join(ckpt, MANIFEST_NAME) == own_path else read_manifest_bytes(storage, ckpt)
            except CheckpointNotFoundError:
                here = None  # this node does not hold the checkpoint: its files come from peers
            if here is not None and here != mbytes:
                raise FormatError(f"{storage.join(ckpt, MANIFEST_NAME)}: this node's manifest differs from the one "
                                  f"rank {src} read (damaged, or from another save)")
        return man

    return ckpt, rel, comm.step("load (reading the manifest)", parse)

