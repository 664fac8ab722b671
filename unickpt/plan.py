"""The routing table: which rank writes each full tensor, into which file, and how pieces
travel there. Pure code: every rank computes the same plan from the same summaries.

Flow: each rank encodes a compact *summary* of its entries (names, dtypes, shapes, layouts:
JSON, zstd-compressed; no object graphs); summaries are exchanged (see ``save``); then
:func:`make_plan` assigns writers (balancing bytes, preferring the rank that already holds
most of a tensor), groups tensors into per-role files, and cuts each writer's byte stream
into buckets of at most ``bucket_bytes``. :meth:`SavePlan.schedule` turns that into the
concrete sends, receives and copies of one rank, step by step.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import operator
from dataclasses import dataclass, field, replace

import numpy as np
import xxhash
import zstandard

from .errors import LayoutError
from .fileset import file_name, pack, split_by_size
from .format import itemsize, order_key
from . import codecs
from .codecs import stored_parts
from .layout import FlatUnit, Layout, Runs, intersect
from .rules import FlatGeo, Unit, UnitSet, boxes_tile
from .state import Entry

__all__ = ["encode_summary", "decode_summary", "summary_digest", "summarize", "assemble", "LocalSummary", "make_plan",
           "SavePlan", "TensorPlan", "FilePlan"]

BALANCE_SLACK = 1.1
DIRECT_MIN_RUN = 256 << 10
"""Pieces whose runs average at least this many bytes are written by their holder straight
into the writer's file (same node only) instead of travelling to the writer."""


def summary_digest(summary: bytes) -> bytes:
    return xxhash.xxh3_128_digest(summary)


def decode_summary(data: bytes) -> dict:
    return json.loads(zstandard.ZstdDecompressor().decompress(data))


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
            if not t.direct:
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
            with _gc_paused():
                self._schedules[rank] = _schedule(self, rank)
        return self._schedules[rank]


def make_plan(
    summaries: list[dict], *, bucket_bytes: int, max_file_bytes: int | None = None, zstd: int | None = None,
    shared_writes: bool = True, rules: dict | None = None,
) -> SavePlan:
    """``zstd``: level for the files of every role but ``model`` (model files stay plain).
    ``shared_writes``: the storage lets several ranks write one file (its
    :attr:`~unickpt.storage.Capabilities.shared_writes`); without it every piece is gathered
    to its file's one writer. ``rules``: ``{"sets": {sid: [unit digest]}, "units": {digest:
    (template, names)}}`` (a body split by :func:`_template`), the rule bodies named by the summaries' claims ``"c": [[sid, index]]`` (see
    :func:`summarize` and :func:`assemble`); a claimed unit's pieces are never materialised
    unless its tensors fit no rule check (then they are planned as explicit pieces)."""
    with _gc_paused():
        return _make_plan(summaries, bucket_bytes, max_file_bytes, zstd, shared_writes, rules)


@contextlib.contextmanager
def _gc_paused():
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


def _make_plan(summaries, bucket_bytes, max_file_bytes, zstd, shared_writes, rules) -> SavePlan:
    world = len(summaries)
    nodes = [str(s["node"]) for s in summaries]
    tensors: dict[tuple[str, str], TensorPlan] = {}
    held_by: list[list[tuple[TensorPlan, Layout]]] = [[] for _ in range(world)]
    for rank, s in enumerate(summaries):
        mine = held_by[rank]
        for role, name, dtype, shape, offsets, sizes, flat, replica, tag in s["t"]:
            shape = tuple(shape)
            lay = Layout.from_json(shape, [offsets, sizes, flat, replica])
            t = _tensor(tensors, role, name, dtype, shape, tag, rank)
            t.explicit.append((rank, lay))
            mine.append((t, lay))
            if lay.is_full:
                t.full_holders.append(rank)
    claims = _read_claims(summaries, rules or {}, tensors)
    memo = _RuleMemo()
    renamed: dict[int, dict[tuple[int, int], Layout]] = {}  # rank -> (id(tensor), id(old)) -> its copy
    kept = []  # the replaced layouts, alive until held_by is updated (their ids are keys)
    for t in tensors.values():
        if t.rules:
            _settle(t, held_by, memo)
        if not t.full_holders or (not t.rules and len(t.explicit) > len(t.full_holders) and _parts_to_tile(t)):
            for r, old, new in _check_tiling(t):
                renamed.setdefault(r, {})[(id(t), id(old))] = new
                kept.append(old)
    for r, m in renamed.items():
        held_by[r] = [(t, m.get((id(t), id(lay)), lay)) for t, lay in held_by[r]]
    del kept
    _assign_writers(list(tensors.values()), world, memo)
    node_id = {n: i for i, n in enumerate(dict.fromkeys(nodes))}
    node_of = np.array([node_id[n] for n in nodes], np.int64)
    for t in tensors.values():
        # framed files are written by their owner only, frame by frame
        t.direct = shared_writes and _can_write_direct(t, nodes, node_of, memo) and not (zstd and t.role != "model")
    files = _make_files(tensors, world, nodes, max_file_bytes)
    if zstd:
        for f in files:
            f.zstd = zstd if f.role != "model" else None
    chunks = _make_chunks(files, world, bucket_bytes)
    return SavePlan(world, nodes, tensors, files, chunks, bucket_bytes, held_by, claims)


def _tensor(tensors, role, name, dtype, shape, tag, rank) -> TensorPlan:
    t = tensors.get((role, name))
    if t is None:
        t = tensors[(role, name)] = TensorPlan(role, name, dtype, shape, [], [], codec=tag)
    elif t.codec != tag:
        raise LayoutError(f"tensor {name!r} (role {role}): ranks disagree on its codec ({t.codec} vs {tag})")
    elif t.dtype != dtype or t.shape != shape:
        first = t.explicit[0][0] if t.explicit else (t.rules[0][0].first_rank() if t.rules else "?")
        rank = rank.first_rank() if isinstance(rank, Unit) else rank
        raise LayoutError(
            f"tensor {name!r} (role {role}): rank {first} has {t.dtype} {list(t.shape)} but rank {rank} "
            f"has {dtype} {list(shape)}"
        )
    return t


def _sources_runs(t: TensorPlan) -> tuple[np.ndarray, np.ndarray, int | None]:
    """Starts and lengths of the runs of ``t``'s explicit replica-0 pieces, by start, and
    the first element two of them both hold (None: they do not overlap)."""
    src = [lay for _, lay in t.explicit if lay.replica == 0 and lay.numel > 0]
    singles = [lay.single_run() for lay in src]
    runs = [lay.runs() for lay, one in zip(src, singles) if one is None]
    ones = np.array([one for one in singles if one is not None], np.int64).reshape(-1, 2)
    starts = np.concatenate([ones[:, 0], *(r.starts for r in runs)])
    lengths = np.concatenate([ones[:, 1], *(r.lengths for r in runs)])
    order = np.argsort(starts, kind="stable")
    starts, lengths = starts[order], lengths[order]
    over = starts[1:] < (starts + lengths)[:-1]
    return starts, lengths, int(starts[1:][np.argmax(over)]) if over.any() else None


def _mark_copies(t: TensorPlan) -> list[tuple[int, Layout, Layout]]:
    """Replica-0 pieces of ``t`` that are the very same block on several ranks are copies,
    not a tiling: DTensors on a tensor-parallel sub-mesh under DDP (a DTensor knows only its
    own mesh, so every data-parallel group presents its blocks as replica 0). The lowest
    rank's stays the saved copy; the others become replica 1, 2, ... Recorded in
    :attr:`TensorPlan.copies`, so the save compares their values as it does for plain
    tensors held whole by several ranks. Returns ``(rank, old layout, new layout)`` of each
    piece remarked."""
    groups: dict[tuple, list[int]] = {}  # block -> indices into t.explicit
    for k, (_, lay) in enumerate(t.explicit):
        if lay.replica == 0 and lay.numel > 0:
            groups.setdefault((lay.offsets, lay.sizes, lay.flat), []).append(k)
    out = []
    for (offsets, sizes, flat), idx in groups.items():
        if len(idx) < 2 or len({t.explicit[k][0] for k in idx}) < len(idx):
            continue  # (one rank holding a block twice is no copy: left to the overlap error)
        idx.sort(key=lambda k: t.explicit[k][0])
        t.copies.append((offsets, sizes, flat, [t.explicit[k][0] for k in idx]))
        for n, k in enumerate(idx[1:], 1):
            r, old = t.explicit[k]
            new = replace(old, replica=n)
            t.explicit[k] = (r, new)
            out.append((r, old, new))
    return out


def _parts_to_tile(t: TensorPlan) -> bool:
    """A tensor some rank holds whole, and other ranks hold parts of as the saved copy
    (replica 0): True when those parts must tile it (no whole copy is replica 0; the rank
    writing it whole writes the same values: copies, but the saved copies are the parts, so
    they are checked and compared as when nobody holds it whole). A whole replica-0 copy
    beside a replica-0 part is two sources for the same elements: refused."""
    whole = [r for r, lay in t.explicit if lay.replica == 0 and lay.is_full]
    part = [r for r, lay in t.explicit if lay.replica == 0 and 0 < lay.numel < t.numel]
    if whole and part:
        raise LayoutError(
            f"tensor {t.name!r} (role {t.role}): rank {whole[0]} holds it whole as the saved copy (replica 0) and "
            f"rank {part[0]} holds a part of it also as replica 0; mark the part a copy (replica > 0) or save the "
            "whole tensor from one place")
    return bool(part)


def _check_tiling(t: TensorPlan) -> list[tuple[int, Layout, Layout]]:
    """Check ``t``'s explicit replica-0 pieces tile it exactly, once copies of one block are
    marked (:func:`_mark_copies`, whose result this returns)."""
    if t.rules:
        return []  # _settle checked the rules tile it
    src = [(r, lay) for r, lay in t.explicit if lay.replica == 0 and lay.numel > 0]
    if not src and t.numel == 0:
        return []
    _, lengths, at = _sources_runs(t)
    marked = []
    if at is not None:
        marked = _mark_copies(t)
        if marked:
            _, lengths, at = _sources_runs(t)
    if at is not None:
        raise LayoutError(
            f"tensor {t.name!r} (role {t.role}): replica-0 shards overlap at element {at} without being the same "
            "block; every element needs exactly one replica-0 owner (mark copies with replica > 0)")
    covered = int(lengths.sum())
    if covered != t.numel:
        raise LayoutError(
            f"tensor {t.name!r} (role {t.role}): replica-0 shards cover {covered} of {t.numel} elements "
            f"(ranks {sorted({r for r, _ in src})}); every element needs exactly one replica-0 owner"
        )
    return marked


def _assign_writers(tensors: list[TensorPlan], world: int, memo: "_RuleMemo | None" = None) -> None:
    """Largest tensors first; each goes to the rank holding most of it unless that would push
    the rank past BALANCE_SLACK x the mean load, else to the least-loaded candidate.

    That is: among candidates (ranks holding it whole, else every rank) whose load stays
    within the cap, the first by (most held, least loaded, lowest rank); if none, the first by
    (least loaded, most held, lowest rank). Vectorised over ranks: a tensor costs its pieces
    (or, for rules, a few array operations over the members holding it), not a sort of
    every rank."""
    memo = memo or _RuleMemo()
    sized = sorted(((t.nbytes, t) for t in tensors), key=lambda x: (-x[0], x[1].role, x[1].name))
    total = sum(nb for nb, _ in sized)
    cap = BALANCE_SLACK * total / world if world else 0
    loads = np.zeros(world, np.int64)
    for nbytes, t in sized:
        if t.full_holders:
            cands = np.unique(np.array(t.full_holders, np.int64))  # equal held (whole): by load, rank
            c_load = loads[cands]
            fit = cands[c_load + nbytes <= cap]
            choice = int(fit[np.argmin(loads[fit])]) if len(fit) else int(cands[np.argmin(c_load)])
        elif t.rules:
            choice = _pick_rules(t, loads, cap, memo)
        else:
            held: dict[int, int] = {}
            for r, lay in t.explicit:
                if lay.numel > held.get(r, 0):
                    held[r] = lay.numel
            hr = np.fromiter(held.keys(), np.int64, len(held))
            hn = np.fromiter(held.values(), np.int64, len(held))
            choice = _pick_any(nbytes, hr, hn, loads, cap)
        t.writer = choice
        loads[choice] += nbytes


def _pick_any(nbytes: int, hr: np.ndarray, hn: np.ndarray, loads: np.ndarray, cap: float) -> int:
    """:func:`_assign_writers` when every rank is a candidate; ``hr``/``hn``: the ranks
    holding part of the tensor (each once) and how many elements."""
    keep = hn > 0
    hr, hn = hr[keep], hn[keep]
    fit = loads[hr] + nbytes <= cap
    if fit.any():  # a holder within the cap: most held, then least loaded, then lowest rank
        r, n = hr[fit], hn[fit]
        r = r[n == n.max()]
        lr = loads[r]
        return int(r[lr == lr.min()].min())
    others = np.ones(len(loads), bool)
    others[hr] = False
    if others.any():  # holding nothing: least loaded, then lowest rank (argmin: the first)
        i = int(np.flatnonzero(others)[np.argmin(loads[others])])
        if loads[i] + nbytes <= cap:
            return i
    low = np.flatnonzero(loads == loads.min())  # over the cap everywhere: least loaded, most held
    held = np.zeros(len(loads), np.int64)
    held[hr] = hn
    h = held[low]
    return int(low[h == h.max()].min())


def _pick_rules(t: TensorPlan, loads: np.ndarray, cap: float, memo: "_RuleMemo | None" = None) -> int:
    """:func:`_pick_any` for a rule tensor, level by level of held size (a slice of members
    per rule and level) instead of over every rank: the first level with a rank within the
    cap gives the least loaded, lowest of them; else, when a rank fits, the least loaded
    rank holds nothing; else (nothing fits) the least loaded ranks, by most held."""
    nb = t.nbytes
    memo = memo or _RuleMemo()
    best, cands = memo.get(t, "top", _top)
    low = loads.min()
    if best > 0:
        lr = loads[cands]
        m = lr.min()
        if m + nb <= cap or m == low:  # (m == low: nothing fits anywhere, see below)
            return int(cands[lr == m].min())
    levels = memo.get(t, "levels", _levels)
    if low + nb <= cap:
        for h, ranks in levels[1:]:  # a lower level within the cap (no rank of a higher one fits)
            lr = loads[ranks]
            m = lr.min()
            if m + nb <= cap:
                return int(ranks[lr == m].min())
        return int(np.argmin(loads))  # no holder fits, a rank does: it holds nothing
    holders = np.zeros(len(loads), bool)  # nothing fits anywhere: least loaded, most held, lowest
    for h, ranks in levels:
        lr = loads[ranks]
        if lr.min() == low:
            return int(ranks[lr == low].min())
        holders[ranks] = True
    least = np.flatnonzero(loads == low)
    return int(least[~holders[least]].min())


def _top(t: TensorPlan) -> tuple[int, np.ndarray]:
    """The most a rank holds of ``t`` (0: nobody holds an element) and the ranks holding it."""
    best, parts = 0, []
    for u, j in t.rules:
        h, ranks = u.top(j)
        if h > best:
            best, parts = h, []
        if h == best and len(ranks):
            parts.append(ranks)
    if best == 0 or not parts:
        return 0, np.zeros(0, np.int64)
    return best, parts[0] if len(parts) == 1 else np.concatenate(parts)


def _levels(t: TensorPlan) -> list[tuple[int, np.ndarray]]:
    """``(held, ranks)`` of a rule tensor's holders, most held first (a rank holding pieces
    of several rules may appear at several levels: its first is its own)."""
    by: dict[int, list[np.ndarray]] = {}
    for u, j in t.rules:
        for h, ranks in u.levels(j):
            by.setdefault(h, []).append(ranks)
    return [(h, np.concatenate(by[h])) for h in sorted(by, reverse=True)]


def _can_write_direct(t: TensorPlan, nodes: list[str], node_of: np.ndarray | None = None,
                      memo: "_RuleMemo | None" = None) -> bool:
    if t.nbytes == 0 or t.quantized:  # quantized: the writer encodes whole groups
        return False
    if t.rules and t.writer not in t.full_holders:
        memo = memo or _RuleMemo()
        n_runs = memo.get(t, "runs", lambda t: sum(u.source_counts(j)[1] for u, j in t.rules))
        if t.nbytes / max(n_runs, 1) < min(DIRECT_MIN_RUN, t.nbytes):
            return False  # (checked first: closed forms, no rank visited)
        ranks, _ = memo.get(t, "sources", _rule_sources)
        if node_of is None:
            node_of = np.array([hash(n) for n in nodes], np.int64)
        return not (len(ranks) and np.any(node_of[ranks] != node_of[t.writer]))
    srcs = t.sources()
    if any(nodes[r] != nodes[t.writer] for r, _ in srcs):
        return False  # other nodes may not see the writer's disk: gather
    n_runs = sum(lay.n_runs for _, lay in srcs)
    return t.nbytes / max(n_runs, 1) >= min(DIRECT_MIN_RUN, t.nbytes)


def _read_claims(summaries: list[dict], rules: dict, tensors: dict) -> list[list[tuple[UnitSet, int]]]:
    """Claims ``"c": [[sid, index]]`` of every rank: members of the units, rule tensors."""
    claims: list[list[tuple[UnitSet, int]]] = [[] for _ in summaries]
    if not any(s.get("c") for s in summaries):
        return claims
    units: dict[str, Unit] = {}
    geos: dict[int, FlatGeo] = {}  # units of one template (shared by identity) share its geometry
    for d, (body, names) in rules.get("units", {}).items():
        u = units[d] = Unit(body, names, geos.get(id(body)))
        if u.kind == "flat":
            geos[id(body)] = u.geo
    sets: dict[str, UnitSet] = {}
    for sid, digests in rules.get("sets", {}).items():
        try:
            sets[sid] = UnitSet(sid, [units[d] for d in digests])
        except KeyError as e:
            raise LayoutError(f"layout rule {e} is claimed but was not sent") from None
        for u in sets[sid].units:
            u.sets.append(sets[sid])
    for rank, s in enumerate(summaries):
        for sid, index in s.get("c", ()):
            st = sets.get(sid)
            if st is None:
                raise LayoutError(f"rank {rank} claims layout rule set {sid} that was not sent")
            if rank in st.index_of:
                raise LayoutError(f"rank {rank} claims layout rule set {sid} twice")
            st.index_of[rank] = int(index)
            st.claims.append((int(index), rank))
            claims[rank].append((st, int(index)))
    shared: dict[tuple, tuple[np.ndarray, np.ndarray, bool]] = {}
    by_geo: dict[tuple, tuple[list[bool], list[bool]]] = {}  # per slot: complete, held by a claimed member
    for u in units.values():
        if not any(st.claims for st in u.sets):
            continue
        key = (u.n, tuple(sorted(st.sid for st in u.sets)))
        if key not in shared:
            members = np.full(u.n, -1, np.int64)
            ok = True
            for st in u.sets:
                idx = np.array([i for i, _ in st.claims], np.int64)
                rk = np.array([r for _, r in st.claims], np.int64)
                inside = (idx >= 0) & (idx < u.n)
                ok = ok and bool(inside.all())
                idx, rk = idx[inside], rk[inside]
                if len(np.unique(idx)) != len(idx) or np.any(members[idx] >= 0):
                    ok = False
                    for i, r in zip(idx.tolist(), rk.tolist()):
                        if members[i] < 0:
                            members[i] = r
                else:
                    members[idx] = rk
            claimed = members >= 0
            ok = ok and len(np.unique(members[claimed])) == int(claimed.sum())
            counts = np.concatenate([[0], np.cumsum(claimed, dtype=np.int64)])
            shared[key] = (members, counts, ok)
        u.members, u.counts, u.regular = shared[key]
        if u.kind == "grid":
            u.complete_slots = [u.regular and int(u.counts[-1]) == u.n]
            held = [int(u.counts[-1]) > 0]
        else:  # the same for every unit of this geometry and these sets
            gk = (id(u.geo), key)
            if gk not in by_geo:
                a, b = np.array(u.geo.a, np.int64), np.array(u.geo.b, np.int64)
                n = u.counts[b] - u.counts[a]
                by_geo[gk] = ((n == b - a) & u.regular).tolist(), (n > 0).tolist()
            u.complete_slots, held = by_geo[gk]
        role, dtype, tag = u.body["role"], u.body["dtype"], u.body.get("tag")
        for j, slot in enumerate(u.slots):
            if not held[j]:
                continue  # no element, or no claimed member holds one: no piece (no row either)
            name, shape = slot[0], slot[1]
            t = tensors.get((role, name))
            if t is None or t.dtype != dtype or t.shape != shape or t.codec != tag:
                t = _tensor(tensors, role, name, dtype, shape, tag, u)
            t.rules.append((u, j))
    return claims


def _settle(t: TensorPlan, held_by: list, memo: "_RuleMemo | None" = None) -> None:
    """Keep ``t``'s pieces as rules when the rules alone tile it (every member holding a
    piece claimed once; the replica-0 boxes tile the tensor) and they give its full
    holders; else materialise them as explicit pieces (planned exactly as before)."""
    if not t.explicit:
        ok, full = (memo or _RuleMemo()).get(t, "settle", _rules_tile)
        if ok:
            t.full_holders = list(full)
            return
    for u, j in t.rules:
        for r, lay in u.claimed_pieces(j):
            t.explicit.append((r, lay))
            held_by[r].append((t, lay))
    t.explicit.sort(key=lambda p: p[0])
    t.full_holders = [r for r, lay in t.explicit if lay.is_full]
    t.rules = []


def _rules_tile(t: TensorPlan) -> tuple[bool, list[int]]:
    """Whether ``t``'s rules alone tile it, and then its full holders."""
    ok = all(u.complete(j) for u, j in t.rules)
    if ok and t.numel > 0:
        boxes = [u.tiles(j) for u, j in t.rules]
        ok = boxes_tile(t.shape, [b for b in boxes if b is not None])
    return ok, sorted(r for u, j in t.rules for r in u.full_ranks(j)) if ok else []


class _RuleMemo:
    """What planning computes from a rule tensor's rules alone (never from loads), kept per
    *rule key*: the rules' templates, member sets and slots. The same tensor of every layer
    has the same key, so each is computed once per model, not once per tensor."""

    def __init__(self) -> None:
        self._done: dict[tuple[str, int], object] = {}
        self._keys: dict[int, int] = {}  # id(tensor) -> the number of its rule key (tensors outlive the memo)
        self._numbers: dict[tuple, int] = {}  # rule key -> its number (a key is hashed once per tensor)

    def get(self, t: TensorPlan, what: str, compute):
        rk = self._keys.get(id(t))
        if rk is None:
            key = tuple([(id(u.body), id(u.members), j) for u, j in t.rules])
            rk = self._keys[id(t)] = self._numbers.setdefault(key, len(self._numbers))
        done = self._done.get((what, rk), _NOT_YET)
        if done is _NOT_YET:
            done = self._done[(what, rk)] = compute(t)
        return done


_NOT_YET = object()


def _rule_sources(t: TensorPlan) -> tuple[np.ndarray, int]:
    """Ranks of a rule tensor's replica-0 pieces and their run count in total."""
    ranks, n_runs = [], 0
    for u, j in t.rules:
        r, held, rep, runs, _ = u.arrays(j)
        keep = (rep == 0) & (held > 0)
        ranks.append(r[keep])
        n_runs += int(runs[keep].sum()) if isinstance(runs, np.ndarray) else runs * int(keep.sum())
    if not ranks:
        return np.zeros(0, np.int64), 0
    return np.concatenate(ranks), n_runs


# -- the summary of one rank: explicit rows and rule claims --------------------------------


def _digest(obj) -> str:
    return xxhash.xxh3_128_hexdigest(json.dumps(obj, separators=(",", ":")).encode())


def _rows(entries, dtypes, tags):
    return [[e.role, e.name, dt, list(e.layout.shape), *e.layout.to_json(), tags.get(e.key)]
            for e, dt in zip(entries, dtypes)]


@dataclass
class LocalSummary:
    """One rank's description of its entries: explicit rows for what fits no rule, and
    claims ``(set id, member index)`` on sets of rule units. :meth:`head` travels first
    (digest and claims: who sends which rule body), then :meth:`payload`."""

    node: str
    rows: list  # explicit rows
    claims: list[tuple[str, int]]  # (set id, index)
    sets: dict[str, list[str]]  # set id -> unit digests
    units: dict[str, dict]  # digest -> body
    fallback: dict[str, list]  # set id -> the rows of its pieces (sent if the claim is ambiguous)

    def digest(self) -> bytes:
        # a set id is the digest of its units' digests, a unit's digest that of its body
        return xxhash.xxh3_128_digest(json.dumps([self.node, self.rows, self.claims], separators=(",", ":")).encode())

    def head(self) -> bytes:
        return json.dumps([self.digest().hex(), self.claims], separators=(",", ":")).encode()

    def payload(self, heads: list[bytes], rank: int, owners: tuple | None = None) -> bytes:
        """``owners``: :func:`_claim_owners` of ``heads`` when already computed."""
        lowest, ambiguous = owners if owners is not None else _claim_owners(heads)
        rows = list(self.rows)
        sets, units = {}, {}
        for sid, i in self.claims:
            if (sid, i) in ambiguous:
                rows += self.fallback[sid]
            elif lowest.get(sid) == rank:
                sets[sid] = self.sets[sid]
                for d in self.sets[sid]:
                    units[d] = self.units[d]
        raw = json.dumps({"node": self.node, "t": rows, "s": sets, "u": _pack_units(units)},
                         separators=(",", ":")).encode()
        return zstandard.ZstdCompressor(level=3).compress(raw)


def _template(body: dict) -> tuple[dict, list[str]]:
    """A rule body without its tensor names, and the names. Units of one template (a
    model's layers) share their geometry, and travel as the template and lists of names."""
    tmpl = dict(body)
    tmpl["t"] = [t[1:] for t in body["t"]]
    return tmpl, [t[0] for t in body["t"]]


def _pack_units(units: dict[str, dict]) -> list:
    """``[[template, [[digest, names], ...]], ...]``: each template once."""
    groups: dict[str, list] = {}
    for d, body in units.items():
        tmpl, names = _template(body)
        groups.setdefault(json.dumps(tmpl, separators=(",", ":")), [tmpl, []])[1].append([d, names])
    return list(groups.values())


def _unpack_units(packed: list) -> dict[str, tuple[dict, list[str]]]:
    """Digest -> ``(template, names)``; units of one template share the template object."""
    return {d: (tmpl, names) for tmpl, members in packed for d, names in members}


def _claim_owners(heads: list[bytes], claims: list[list] | None = None) -> tuple[dict[str, int], set]:
    """From every rank's head: the lowest claimant of each set (it sends the set's body) and
    the claims ``(set, index)`` made by more than one rank (those ranks send rows instead).
    ``claims``: the heads' claims, when already parsed."""
    if claims is None:
        claims = [json.loads(h)[1] for h in heads]
    lowest: dict[str, int] = {}
    seen: dict[tuple[str, int], int] = {}
    ambiguous = set()
    for rank, cs in enumerate(claims):
        for sid, i in cs:
            k = (sid, int(i))
            if k in seen:
                ambiguous.add(k)
            seen[k] = rank
    for rank, cs in enumerate(claims):
        for sid, i in cs:
            if (sid, int(i)) not in ambiguous and sid not in lowest:
                lowest[sid] = rank
    return lowest, ambiguous


def assemble(heads: list[bytes], payloads: list[bytes]) -> tuple[list[dict], dict]:
    """``make_plan``'s ``summaries`` and ``rules`` from every rank's head and payload."""
    with _gc_paused():
        return _assemble(heads, payloads)


def _assemble(heads: list[bytes], payloads: list[bytes]) -> tuple[list[dict], dict]:
    claims = [json.loads(h)[1] for h in heads]
    _, ambiguous = _claim_owners(heads, claims)
    summaries, sets, units = [], {}, {}
    unzip = zstandard.ZstdDecompressor()
    for cs, p in zip(claims, payloads):
        d = json.loads(unzip.decompress(p))
        sets.update(d["s"])
        units.update(_unpack_units(d["u"]))
        c = [[sid, int(i)] for sid, i in cs if (sid, int(i)) not in ambiguous]
        summaries.append({"node": d["node"], "t": d["t"], "c": c})
    return summaries, {"sets": sets, "units": units}


def summarize(entries: list[Entry], dtypes: list[str], node: str, tags: dict | None = None) -> LocalSummary:
    """This rank's :class:`LocalSummary`. A layout's hint (:func:`~unickpt.layout.partition_flat`
    with names, a DTensor) proposes a rule; the rank claims it only when its own entries are
    exactly the rule's pieces at its index (every piece the rule gives it, each equal to its
    layout, same role, dtype and codec tag throughout); anything else is an explicit row."""
    with _gc_paused():
        return _summarize(entries, dtypes, node, tags or {})


def _summarize(entries: list[Entry], dtypes: list[str], node: str, tags: dict) -> LocalSummary:
    explicit: list[int] = []
    flat: dict[tuple, list[int]] = {}
    grid: dict[int, tuple[dict, int]] = {}
    for k, (e, dt) in enumerate(zip(entries, dtypes)):
        h = e.layout.hint
        if isinstance(h, tuple) and len(h) == 3 and isinstance(h[0], FlatUnit) and not e.per_rank:
            flat.setdefault((h[0], h[1], e.role, dt, json.dumps(tags.get(e.key))), []).append(k)
        elif isinstance(h, tuple) and len(h) in (4, 5) and h[0] == "grid" and not e.per_rank and math.prod(e.layout.shape) > 0:
            try:  # (a hint that is no sequence of the right kinds is no rule: explicit rows; Unit checks the rest)
                body = {"k": "grid", "n": math.prod(h[1]), "mesh": list(h[1]), "pl": list(h[2]),
                        "t": [[e.name, list(e.layout.shape)]], "role": e.role, "dtype": dt, "tag": tags.get(e.key)}
                if len(h) == 5 and h[4] is not None:  # the mesh dimensions cut in another order (FSDP2 over TP)
                    body["order"] = list(h[4])
                grid[k] = (body, operator.index(h[3]))
            except TypeError:
                explicit.append(k)
        else:
            explicit.append(k)
    by_index: dict[int, list[tuple[str, dict, list[int]]]] = {}
    for (unit, index, role, dt, tag), ks in flat.items():
        body = {"k": "flat", "n": unit.world, "total": unit.total, "role": role, "dtype": dt, "tag": json.loads(tag),
                "t": [[n, list(sh), list(b[0]), list(b[1]), b[2]] for n, sh, b in zip(unit.names, unit.shapes, unit.boxes)]}
        if _claim_ok(body, index, [entries[k] for k in ks]):
            by_index.setdefault(index, []).append((_digest(body), body, ks))
        else:
            explicit += ks
    # per tensor, by what its grid rule shares with the model's other layers: its piece depends
    # on mesh, placements, shape and index only, its body's JSON on the name besides
    pieces: dict[tuple, Layout | None] = {}
    texts: dict[tuple, tuple[str, str] | None] = {}
    for k, (body, index) in grid.items():
        geo = (tuple(body["mesh"]), repr((body["pl"], body.get("order"))), tuple(body["t"][0][1]))
        if geo + (index,) not in pieces:  # (a grid rule has one tensor: its piece, if any)
            pieces[geo + (index,)] = next(iter((_pieces_at(body, index) or {}).values()), None)
        want = pieces[geo + (index,)]
        if want is None or entries[k].layout != want:
            explicit.append(k)
            continue
        key = geo + (body["role"], body["dtype"], repr(body["tag"]))
        if key not in texts:
            texts[key] = _around_name(body)
        around = texts[key]
        digest = (xxhash.xxh3_128_hexdigest((around[0] + json.dumps(body["t"][0][0]) + around[1]).encode())
                  if around is not None else _digest(body))
        by_index.setdefault(index, []).append((digest, body, [k]))
    rows = _rows([entries[k] for k in sorted(explicit)], [dtypes[k] for k in sorted(explicit)], tags)
    claims, sets, units, fallback = [], {}, {}, {}
    for index in sorted(by_index):
        us = sorted(by_index[index], key=lambda x: x[0])
        digests = [d for d, _, _ in us]
        sid = _digest(digests)  # ranks holding the same units share it (one body sent)
        claims.append((sid, index))
        sets[sid] = digests
        units.update({d: b for d, b, _ in us})
        ks = sorted(k for _, _, ks in us for k in ks)
        fallback[sid] = _rows([entries[k] for k in ks], [dtypes[k] for k in ks], tags)
    return LocalSummary(node, rows, claims, sets, units, fallback)


_NAME_MARK = "\u0000unickpt tensor name\u0000"


def _around_name(body: dict) -> tuple[str, str] | None:
    """The text of a one-tensor rule body's JSON (as :func:`_digest` writes it) before and
    after the tensor's name, so the body of another tensor of the same geometry, role, dtype
    and tag is ``before + json.dumps(name) + after``: :func:`_digest`'s text, without
    encoding the whole body again (9,003 DTensors of a 1,000-layer model in one summary)."""
    text = json.dumps(dict(body, t=[[_NAME_MARK, *body["t"][0][1:]]]), separators=(",", ":"))
    parts = text.split(json.dumps(_NAME_MARK))
    return (parts[0], parts[1]) if len(parts) == 2 else None


def _pieces_at(body: dict, index: int) -> dict[str, Layout] | None:
    """The pieces rule ``body`` gives member ``index``, by tensor name (None: the rule is
    malformed, or has no such member)."""
    try:
        u = Unit(*_template(body))
    except LayoutError:
        return None
    if not 0 <= index < u.n:
        return None
    out = {}
    for j in u.slots_of(index):
        lay = u.piece(j, index)
        if lay is not None:
            out[u.slots[j][0]] = lay
    return out


def _claim_ok(body: dict, index: int, mine: list[Entry]) -> bool:
    want = _pieces_at(body, index)
    have = {e.name: e.layout for e in mine}
    return want is not None and len(have) == len(mine) and have == want


def encode_summary(entries: list[Entry], dtypes: list[str], node: str, tags: dict | None = None) -> bytes:
    """Explicit rows only (one per entry): the summary before rules, kept for tools/tests."""
    raw = json.dumps({"node": node, "t": _rows(entries, dtypes, tags or {})}, separators=(",", ":")).encode()
    return zstandard.ZstdCompressor(level=3).compress(raw)


def _make_files(tensors, world, nodes, max_file_bytes) -> list[FilePlan]:
    by_role: dict[str, list[list[TensorPlan]]] = {}
    writers_of: dict[str, list[int]] = {}
    grouped: dict[str, dict[int, list[TensorPlan]]] = {}
    for t in tensors.values():
        grouped.setdefault(t.role, {}).setdefault(t.writer, []).append(t)
    for role in sorted(grouped):
        parts: list[list[TensorPlan]] = []
        owners: list[int] = []
        for w in sorted(grouped[role]):
            mine = sorted(grouped[role][w], key=lambda t: order_key(t.dtype, t.name))
            for part in split_by_size(mine, lambda t: t.nbytes, max_file_bytes):
                parts.append(part)
                owners.append(w)
        by_role[role] = parts
        writers_of[role] = owners
    files: list[FilePlan] = []
    for role, parts in by_role.items():
        n = len(parts)
        for i, (part, w) in enumerate(zip(parts, writers_of[role]), start=1):
            name = file_name(role, i, n)
            header, stored = pack(((key, dt, sh, (t, p)) for t in part for p, key, dt, sh in t.stored()),
                                     {"format": "pt", "unickpt_role": role})
            for key, dt, sh, (t, p), info in stored:
                t.file = name
                if t.quantized:
                    t.parts[p] = (key, dt, sh, info.begin, info.end)
                else:
                    t.begin, t.end = info.begin, info.end
            for t in part:
                if t.quantized:  # the span of its parts (ordering only: parts are read by offset)
                    t.begin = min(x[3] for x in t.parts.values())
                    t.end = max(x[4] for x in t.parts.values())
            files.append(FilePlan(name, role, w, nodes[w], part, header))
    return files


def _make_chunks(files: list[FilePlan], world: int, bucket_bytes: int) -> dict[int, list[list[Segment]]]:
    chunks: dict[int, list[list[Segment]]] = {}
    by_writer: dict[int, list[tuple[int, FilePlan]]] = {}
    for fi, f in enumerate(files):
        by_writer.setdefault(f.writer, []).append((fi, f))
    for w in sorted(by_writer):
        out: list[list[Segment]] = []
        cur: list[Segment] = []
        room = bucket_bytes
        for fi, f in by_writer[w]:
            for t in f.tensors:
                if t.direct:
                    continue
                start, n, isz = 0, t.numel, t.itemsize
                g = t.codec["group"] if t.quantized else 1  # quantized: whole groups per segment
                while start < n or (n == 0 and start == 0):
                    take = min(n - start, max(room // isz, 0) // g * g)
                    if take == 0 and n > 0:
                        out.append(cur)
                        cur, room = [], bucket_bytes
                        take = min(n - start, max(bucket_bytes // isz // g * g, g))
                    cur.append(Segment(t, fi, start, start + take))
                    room -= take * isz
                    start += take
                    if n == 0:
                        break
        if cur:
            out.append(cur)
        if out:
            chunks[w] = out
    return chunks


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
