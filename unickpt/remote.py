"""Load-side routing for node-local storage: pieces a rank cannot read itself.

When each node keeps its files on its own disk (``{node}`` in the path), a rank can only
read the files its node holds. Every rank announces the targets it cannot read (role, name,
dtype, layout); every rank then computes the same plan: each missing piece, cut into chunks
of at most ``bucket_bytes`` cut where checksummed ranges start (a range longer than the
bucket travels whole, so it is still verified), is assigned to the least-loaded rank that sees the file(s)
holding it (a residual or dropped master also needs its model weight's file). Readers load
each chunk exactly as the requester would (same byte ranges, same decoding of quantized
state, same checksum checks) and send it; transfers run in steps bounded per reader.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import torch

from ._copy import as_bytes
from .errors import CheckpointNotFoundError
from .format import dtype_name, torch_dtype
from .layout import Layout
from .manifest import Manifest
from .state import Entry
from .transport import Comm

__all__ = ["files_needed", "load_remote"]


def files_needed(man: Manifest, key: tuple[str, str]) -> set[str]:
    st = man.tensors[key]
    out = {st.file} if st.coder.stores else set()
    model = st.coder.model_of(st.args)
    if model is not None:
        out.add(man.tensors[("model", model)].file)
    return out


@dataclass(frozen=True, slots=True)
class _Transfer:
    reader: int
    requester: int
    index: int  # position in the requester's list of needs
    role: str
    name: str
    dtype: str
    layout: Layout  # the requester's elements [a, b) of its local tensor, as a layout
    a: int
    b: int
    step: int


def _sub_layout(lay: Layout, a: int, b: int) -> Layout:
    """Local elements ``[a, b)`` of ``lay``: the same box, a narrower flat range."""
    f0 = lay.flat[0] if lay.flat is not None else 0
    return Layout(lay.shape, lay.offsets, lay.sizes, (f0 + a, f0 + b), lay.replica)


def _boundaries(man: Manifest, key: tuple[str, str]) -> np.ndarray:
    """Global element indices where a checksummed range of the stored tensor starts (the
    primary region: raw bytes, codes, low halves, or the model weight of a dropped master)."""
    st = man.tensors[key]
    model = st.coder.model_of(st.args)
    return st.coder.range_starts(st, man.tensors[("model", model)] if model is not None else None)


def _chunks(lay: Layout, bounds: np.ndarray, isz: int, bucket: int) -> list[tuple[int, int]]:
    """Local element ranges of ``lay``: cut only where a checksummed range starts (so a
    reader checks every range the requester would have read whole), merged up to
    ``bucket`` bytes; a range longer than the bucket stays whole."""
    n = lay.numel
    runs = lay.runs()
    cuts = {0, n}
    if len(bounds) and len(runs):
        i = np.searchsorted(runs.starts, bounds, side="right") - 1
        ok = i >= 0
        i, b = i[ok], bounds[ok]
        inside = b < runs.starts[i] + runs.lengths[i]
        pos = np.where(inside, runs.local[i] + b - runs.starts[i], runs.local[i] + runs.lengths[i])
        cuts.update(int(p) for p in pos if 0 < p < n)
    edges = sorted(cuts)
    out: list[tuple[int, int]] = []
    start = 0
    for a, b in zip(edges, edges[1:]):
        if b - start > max(1, bucket // isz) and a > start:
            out.append((start, a))
            start = a
    if n > start:
        out.append((start, n))
    return out


def _plan(needs: list[list], sees: list[set[str]], man: Manifest, bucket: int) -> list[_Transfer]:
    world = len(needs)
    load = [0] * world
    per_reader: dict[int, int] = {}
    out = []
    missing = []
    for r, mine in enumerate(needs):
        for i, (role, name, dt, lay_json) in enumerate(mine):
            st = man.tensors[(role, name)]
            lay = Layout.from_json(st.shape, lay_json)
            need = files_needed(man, (role, name))
            cands = [s for s in range(world) if need <= sees[s]]
            if not cands:
                missing.append((role, name, sorted(need)))
                continue
            isz = torch_dtype(dt).itemsize
            for a, b in _chunks(lay, _boundaries(man, (role, name)), isz, bucket):
                s = min(cands, key=lambda k: (load[k], k))
                nbytes = (b - a) * isz
                load[s] += nbytes
                done = per_reader.get(s, 0)
                per_reader[s] = done + nbytes
                out.append(_Transfer(s, r, i, role, name, dt, _sub_layout(lay, a, b), a, b, done // bucket))
    if missing:
        role, name, files = missing[0]
        where = {f: man.files[f].node for f in files}
        raise CheckpointNotFoundError(
            f"{len(missing)} tensor(s) cannot be read by any rank, e.g. {name!r} (role {role}) in {where} "
            "(file: node that wrote it): no rank's node directory holds the file"
        )
    return out


def load_remote(comm: Comm, remote: list[Entry], man: Manifest, sees_mine: set[str], read_fn, bucket: int,
                verify: str = "auto", counts: list[int] | None = None):
    """Collective. ``remote``: this rank's targets it cannot read; ``read_fn(entries, verify)``
    reads entries this rank can see and returns ``(bytes, verified, bad)``. ``verify``: this
    rank's own setting; a rank reading for peers verifies when any of them does, even with
    ``"none"`` for its own targets (a rank that checks never gets bytes a non-checking peer
    read unhashed). Returns the same figures for the reads this rank did for others, the
    bytes it received, and the first read error (raised by the caller after every step has
    run). ``counts``: every rank's ``len(remote)`` where an earlier all-gather carried them."""
    if counts is None:
        counts = comm.all_gather_int(len(remote), "load (pieces read for other nodes: how many)")
    if not any(counts):
        return 0, 0, [], 0, None  # every rank reads all it needs itself (the common case): one small all-gather
    mine = [[e.role, e.name, dtype_name(e.local.dtype), e.layout.to_json()] for e in remote]
    record = {"needs": mine, "sees": sorted(sees_mine), "checks": verify != "none"}
    gathered = [json.loads(b) for b in comm.all_gather_bytes(json.dumps(record).encode(), "load (pieces read for other nodes)")]
    needs = [g["needs"] for g in gathered]
    sees = [set(g["sees"]) for g in gathered]
    if not any(needs):
        return 0, 0, [], 0, None
    plan = _plan(needs, sees, man, bucket)
    n_steps = max((t.step for t in plan), default=-1) + 1
    outs = []
    for e in remote:
        local = e.local.detach()
        direct = local.device.type == "cpu" and local.is_contiguous()
        outs.append((local, local if direct else torch.empty(local.shape, dtype=local.dtype)))
    bytes_read = verified = received = 0
    bad: list = []
    error: BaseException | None = None
    for step in range(n_steps):
        todo = [t for t in plan if t.step == step]
        sends, recvs = [], []
        reads = [t for t in todo if t.reader == comm.rank]
        bufs = [torch.empty(t.b - t.a, dtype=torch_dtype(t.dtype)) for t in reads]
        if reads and error is None:
            try:
                mode = "auto" if verify == "none" and any(gathered[t.requester]["checks"] for t in reads) else verify
                b_, v_, bad_ = read_fn([Entry(t.role, t.name, buf, t.layout) for t, buf in zip(reads, bufs)], mode)
                bytes_read += b_
                verified += v_
                bad += bad_
            except Exception as e:  # keep serving the schedule; raise after the last step
                error = e
        for t, buf in zip(reads, bufs):
            sends.append((t.requester, as_bytes(buf)))
        for t in todo:
            if t.requester == comm.rank:
                out = outs[t.index][1]
                isz = out.element_size()
                recvs.append((t.reader, as_bytes(out)[t.a * isz : t.b * isz]))
                received += (t.b - t.a) * isz
        comm.exchange(sends, recvs)
    for local, out in outs:
        if out is not local:
            local.copy_(out)
    return bytes_read, verified, bad, received, error

