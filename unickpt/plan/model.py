"""What a plan is (:class:`SavePlan`: tensors, files, buckets) and its per-rank schedule
(:meth:`SavePlan.schedule`: the sends, receives and copies of each gather step)."""

from __future__ import annotations

import contextlib
import gc
import math
from dataclasses import dataclass, field

import numpy as np

from .. import codecs
from ..codecs import stored_parts
from ..format import itemsize
from ..layout import Layout, Runs, intersect
from ..rules import UnitSet


@contextlib.contextmanager
def gc_paused():
    """Pause the cyclic garbage collector. Planning allocates 1e5-1e6 small objects without
    cycles (reference counting frees them); each allocation burst would start collections
    that walk the whole process's heap (0.3-0.5 s of a plan at 10,000 ranks)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            if gc.get_freeze_count() == 0:
                # the plan's objects would all be in the youngest generation, whose next
                # collection (at the first allocation) walks every one of them, then again in
                # the middle one: they live as long as the cached plan, so put them straight
                # into the oldest (freeze + unfreeze moves lists, walks nothing). Skipped when
                # the process froze objects itself: unfreeze would thaw those too.
                gc.freeze()
                gc.unfreeze()
            gc.enable()


@dataclass(slots=True)
class TensorPlan:
    role: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    explicit: list[tuple[int, Layout]]  # pieces named one by one, replicas included
    full_holders: list[int]
    writer: int = -1
    file: str = ""
    begin: int = 0  # byte offsets inside the file's data section
    end: int = 0
    direct: bool = False  # holders write their own runs in place; nothing travels
    codec: dict | None = None  # codec tag (unickpt.codecs); None: stored as is
    parts: dict[str, tuple[str, str, tuple[int, ...], int, int]] = field(default_factory=dict)
    """Quantized tensors: part -> (header key, dtype, shape, begin, end) in the file."""
    copies: list = field(default_factory=list)
    """Blocks that several ranks presented as the saved copy (replica 0) and the plan made
    copies of (:func:`_mark_copies`): ``(offsets, sizes, flat, ranks)``, the first rank's
    block saved; the save compares the others' values with it (``saving.checks.check_replicas``)."""
    rules: list = field(default_factory=list)
    """``(unit, slot)`` of the rules whose members hold pieces of this tensor (lazy pieces:
    never materialised in the plan); empty once the tensor is planned from explicit pieces."""
    numel: int = field(init=False)
    itemsize: int = field(init=False)
    nbytes: int = field(init=False)
    """(numel, itemsize, nbytes: of the dtype and shape, which never change; kept, not
    recomputed: planning reads them ~10 times per tensor)"""

    def __post_init__(self) -> None:
        self.numel = math.prod(self.shape)
        self.itemsize = itemsize(self.dtype)
        self.nbytes = self.numel * self.itemsize

    @property
    def pieces(self) -> list[tuple[int, Layout]]:
        """Every rank's layout, replicas included, in rank order (materialised: O(pieces))."""
        if not self.rules:
            return self.explicit
        out = list(self.explicit)
        for u, j in self.rules:
            out += u.claimed_pieces(j)
        out.sort(key=lambda p: p[0])
        return out

    def full_pieces(self) -> list[tuple[int, Layout]]:
        """``(rank, layout)`` of the pieces that are the whole tensor: O(full holders)."""
        if not self.rules:
            return [(r, lay) for r, lay in self.explicit if lay.is_full]
        out = [(r, u.piece(j, i)) for u, j in self.rules for r in u.full_ranks(j) for i in u.indices_of(r)]
        return sorted(out, key=lambda p: p[0])

    def sources_of(self, rank: int) -> list[tuple[int, Layout]]:
        """``rank``'s entries in :meth:`sources`, without visiting other ranks' pieces."""
        if self.writer in self.full_holders:
            return [(rank, Layout.full(self.shape))] if rank == self.writer else []
        out = [(r, lay) for r, lay in self.explicit if r == rank and lay.replica == 0 and lay.numel > 0]
        for u, j in self.rules:
            for i in u.indices_of(rank):
                lay = u.piece(j, i)
                if lay is not None and lay.replica == 0 and lay.numel > 0:
                    out.append((rank, lay))
        return out

    @property
    def quantized(self) -> bool:
        return self.codec is not None and codecs.get(self.codec["codec"]).quantized

    def stored(self) -> list[tuple[str, str, str, tuple[int, ...]]]:
        """``(part, header key, dtype, shape)`` of what the file holds for this tensor."""
        return stored_parts(self.name, self.dtype, self.shape, self.codec)

    @property
    def stored_bytes(self) -> int:
        return sum(math.prod(sh) * itemsize(dt) for _, _, dt, sh in self.stored())

    @property
    def key(self) -> tuple[str, str]:
        return (self.role, self.name)

    def sources(self) -> list[tuple[int, Layout]]:
        """Ranks whose data is written: the writer alone if it holds the whole tensor, else
        the replica-0 pieces (validated to tile the tensor exactly)."""
        if self.writer in self.full_holders:
            return [(self.writer, Layout.full(self.shape))]
        return [(r, lay) for r, lay in self.pieces if lay.replica == 0 and lay.numel > 0]


def extents_of(t: "TensorPlan", rank: int | None = None) -> list[tuple[int, int, int, int]]:
    """Direct tensors: ``(rank, local_elem, tensor_elem, count)`` runs, in tensor order; of
    ``rank`` only when given (its own pieces: no other rank's piece is visited)."""
    out = []
    for r, lay in (t.sources() if rank is None else t.sources_of(rank)):
        runs = lay.runs()
        for g, n, lo in zip(runs.starts.tolist(), runs.lengths.tolist(), runs.local.tolist()):
            out.append((r, lo, g, n))
    out.sort(key=lambda e: e[2])
    return out


@dataclass(slots=True)
class FilePlan:
    name: str
    role: str
    writer: int
    node: str
    tensors: list[TensorPlan]
    header: bytes = b""
    zstd: int | None = None  # zstd level: the file is stored as zstd frames (unickpt.container)
    lossless: bool = False  # stored as byte-grouped frames (unickpt.container)

    @property
    def framed(self) -> bool:
        """Stored as frames (zstd or byte-grouped): written by its owner alone, frame by frame."""
        return self.zstd is not None or self.lossless

    @property
    def data_bytes(self) -> int:
        return sum(t.stored_bytes for t in self.tensors)

    @property
    def size(self) -> int:
        return len(self.header) + self.data_bytes


@dataclass(slots=True)
class Segment:
    """Elements ``[start, stop)`` of a tensor, written as one contiguous piece of a file."""

    tensor: TensorPlan
    file_index: int
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        return (self.stop - self.start) * self.tensor.itemsize


@dataclass(slots=True)
class Step:
    """What one rank does in one step of the gather."""

    sends: list[tuple[int, TensorPlan, Runs]] = field(default_factory=list)  # (dst, tensor, local runs)
    recvs: list[tuple[int, TensorPlan, int, Runs]] = field(default_factory=list)  # (src, tensor, seg idx, runs in segment)
    copies: list[tuple[TensorPlan, int, Runs, Runs]] = field(default_factory=list)  # (tensor, seg idx, local runs, seg runs)
    segments: list[Segment] = field(default_factory=list)  # this rank's segments to write, in file order
    local_whole: list[int | None] = field(default_factory=list)  # local element offset when one local run holds the whole segment (zero copy)


@dataclass(slots=True)
class SavePlan:
    world: int
    nodes: list[str]
    tensors: dict[tuple[str, str], TensorPlan]
    files: list[FilePlan]
    chunks: dict[int, list[list[Segment]]]  # writer -> buckets of segments
    bucket_bytes: int
    held_by: list[list[tuple[TensorPlan, Layout]]] | None = None
    """Per rank, the ``(tensor, layout)`` of every explicit piece it holds (None: found by scanning)."""
    claims: list[list[tuple["UnitSet", int]]] | None = None
    """Per rank, its rule claims ``(set, index)``: its other pieces, computed on demand."""
    _schedules: dict[int, list[Step]] = field(default_factory=dict)
    _replica_groups: list | None = None  # saving.checks._replica_groups, once per (cached) plan

    @property
    def n_steps(self) -> int:
        return max((len(c) for c in self.chunks.values()), default=0)

    def writer_loads(self) -> list[int]:
        loads = [0] * self.world
        for t in self.tensors.values():
            loads[t.writer] += t.nbytes
        return loads

    def files_of(self, rank: int) -> list[FilePlan]:
        return [f for f in self.files if f.writer == rank]

    def pieces_of(self, rank: int) -> list[tuple[TensorPlan, Layout]]:
        """``(tensor, layout)`` of every piece ``rank`` holds: O(its own pieces)."""
        out = self.explicit_of(rank)
        for t, u, j, i in self.rule_pieces_of(rank):
            lay = u.piece(j, i)
            if lay is not None:
                out.append((t, lay))
        return out

    def explicit_of(self, rank: int) -> list[tuple[TensorPlan, Layout]]:
        """``(tensor, layout)`` of the explicit pieces ``rank`` holds."""
        return list(self.held_by[rank]) if self.held_by is not None else [
            (t, lay) for t in self.tensors.values() for r, lay in t.explicit if r == rank]

    def rule_pieces_of(self, rank: int):
        """``(tensor, unit, slot, member index)`` of each rule piece ``rank`` holds."""
        for st, i in (self.claims[rank] if self.claims else ()):
            for u in st.units:
                for j in u.slots_of(i):
                    if u.span(j)[0] == u.span(j)[1]:
                        continue
                    t = self.tensors[(u.body["role"], u.slots[j][0])]
                    if any(x is u and y == j for x, y in t.rules):
                        yield t, u, j, i

    def page_phases(self, rank: int, page: int = 4096) -> dict[tuple[str, str], int]:
        """Where ``rank``'s local copy of each tensor it writes in place would sit in memory,
        modulo ``page``, for its bytes to have the same offset within a page as in the file
        (so an O_DIRECT write can take them without a copy): tensor key -> the file offset,
        modulo ``page``, of its local element 0. A piece of several runs whose offsets differ
        gets the phase that matches most of its bytes."""
        header = {f.name: len(f.header) for f in self.files}
        out = {}
        for t in self.tensors.values():
            if not t.direct or t.quantized:  # (quantized: the file holds its codes, not these bytes)
                continue
            weight: dict[int, int] = {}
            for _, lo, g, n in extents_of(t, rank):
                phase = (header[t.file] + t.begin + (g - lo) * t.itemsize) % page
                weight[phase] = weight.get(phase, 0) + n
            if weight:
                out[t.key] = max(weight, key=weight.__getitem__)
        return out

    def schedule(self, rank: int) -> list[Step]:
        if rank not in self._schedules:
            with gc_paused():
                self._schedules[rank] = _schedule(self, rank)
        return self._schedules[rank]


def _own_sources(plan: SavePlan, rank: int) -> dict[tuple[str, str], list[tuple[int, tuple]]]:
    """``rank``'s entries in :meth:`TensorPlan.sources`, from the pieces it holds, as runs:
    ``(start, length)`` for one run, else ``(starts, lengths, local offsets)`` arrays (rule
    pieces: views of their geometry's arrays, no :class:`Layout` built)."""
    out: dict[tuple[str, str], list[tuple[int, tuple]]] = {}

    def full(t: TensorPlan) -> bool:  # the writer holds it whole: the only source
        if t.writer == rank:
            out[t.key] = [(rank, (0, t.numel))]
        return True

    for t, lay in plan.explicit_of(rank):
        if t.writer in t.full_holders and full(t):
            continue
        if lay.replica == 0 and lay.numel > 0:
            one = lay.single_run()
            runs = lay.runs() if one is None else None
            out.setdefault(t.key, []).append((rank, one or (runs.starts, runs.lengths, runs.local)))
    for t, u, j, i in plan.rule_pieces_of(rank):
        if t.writer in t.full_holders and full(t):
            continue
        runs = u.member_runs(j, i)
        if runs is not None:
            out.setdefault(t.key, []).append((rank, (int(runs[0][0]), int(runs[1][0])) if len(runs[0]) == 1 else runs))
    return out


def _cut_one(runs: tuple, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``(n, off_src, off_seg)`` of one source's runs (see :func:`_own_sources`) cut to
    elements ``[start, stop)``; None when they do not meet."""
    if len(runs) == 2:  # one run: no arrays to intersect
        g, end = max(runs[0], start), min(runs[0] + runs[1], stop)
        if end <= g:
            return None
        return np.array([end - g], np.int64), np.array([g - runs[0]], np.int64), np.array([g - start], np.int64)
    starts, lengths, local = runs
    if not len(starts):
        return None
    if starts[0] >= start and starts[-1] + lengths[-1] <= stop:  # all inside
        return lengths.copy(), local.copy(), starts - start
    g, n, off_src, off_seg = intersect(Runs(starts, lengths), Runs.single(start, stop))
    return (n, off_src, off_seg) if len(n) else None


def _rule_source_runs(t: TensorPlan) -> tuple[np.ndarray, ...]:
    """Every run of a rule tensor's sources, in :meth:`TensorPlan.sources` order (by rank;
    one rank's pieces in rule order; runs in local order): ``(piece, rank, start, length,
    local offset)`` arrays, built per rule without a :class:`Layout` per piece."""
    parts = [u.source_runs(j) for u, j in t.rules]
    piece = np.concatenate([m + (q << 40) for q, (m, *_) in enumerate(parts)])
    ranks, starts, lengths, local = (np.concatenate([p[f] for p in parts]) for f in range(1, 5))
    order = np.argsort(ranks, kind="stable")
    return piece[order], ranks[order], starts[order], lengths[order], local[order]


def _cut_runs(piece, ranks, starts, lengths, local, start: int, stop: int):
    """:func:`_rule_source_runs` cut to elements ``[start, stop)``: ``(rank, n, off_src,
    off_seg)`` per piece overlapping it."""
    idx = np.flatnonzero((starts < stop) & (starts + lengths > start))
    if not len(idx):
        return
    s0 = starts[idx]
    g = np.maximum(s0, start)
    n = np.minimum(s0 + lengths[idx], stop) - g
    off_src, off_seg = local[idx] + (g - s0), g - start
    p = piece[idx]
    bounds = [0, *(np.flatnonzero(p[1:] != p[:-1]) + 1).tolist(), len(idx)]
    rk = ranks[idx].tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        yield rk[a], n[a:b], off_src[a:b], off_seg[a:b]


def _schedule(plan: SavePlan, rank: int) -> list[Step]:
    """The steps of one rank. Cost: every writer's segments are visited, but only the
    sources of this rank (its own pieces) and, for the segments it writes, every source of
    their tensors are intersected: never every rank's pieces of every tensor."""
    steps: list[Step] = []
    all_sources: dict[tuple[str, str], list[tuple[int, tuple]]] = {}
    rule_sources: dict[tuple[str, str], tuple] = {}
    own = _own_sources(plan, rank)

    def cuts(t: TensorPlan, w: int, seg: Segment):
        """``(source rank, n, off_src, off_seg)`` per source overlapping ``seg``, in
        :meth:`TensorPlan.sources` order; a written rule tensor's sources are cut at once."""
        if w != rank:
            srcs = own.get(t.key, [])
        elif t.rules and t.writer not in t.full_holders:
            if t.key not in rule_sources:
                rule_sources[t.key] = _rule_source_runs(t)
            yield from _cut_runs(*rule_sources[t.key], seg.start, seg.stop)
            return
        else:
            if t.key not in all_sources:
                all_sources[t.key] = [(r, (x.starts, x.lengths, x.local)) for r, x in
                                      ((r, lay.runs()) for r, lay in t.sources())]
            srcs = all_sources[t.key]
        for r, runs in srcs:
            c = _cut_one(runs, seg.start, seg.stop)
            if c is not None:
                yield (r, *c)

    for s in range(plan.n_steps):
        step = Step()
        for w, chunk_list in sorted(plan.chunks.items()):
            if s >= len(chunk_list):
                continue
            for si, seg in enumerate(chunk_list[s]):
                t = seg.tensor
                for r, n, off_src, off_seg in cuts(t, w, seg):
                    if r == rank and w == rank:
                        step.copies.append((t, si, Runs(off_src, n), Runs(off_seg, n)))
                    elif r == rank:
                        step.sends.append((w, t, Runs(off_src, n)))
                    else:
                        step.recvs.append((r, t, si, Runs(off_seg, n)))
                if w == rank:
                    step.segments.append(seg)
        by_seg: dict[int, list] = {}
        for c in step.copies:
            by_seg.setdefault(c[1], []).append(c)
        for si, seg in enumerate(step.segments):
            mine = by_seg.get(si, [])
            whole = (
                len(mine) == 1
                and len(mine[0][2]) == 1
                and int(mine[0][2].lengths[0]) == seg.stop - seg.start
            )
            step.local_whole.append(int(mine[0][2].starts[0]) if whole else None)
        steps.append(step)
    return steps

