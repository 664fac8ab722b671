"""Layout rules: pieces of many ranks described by one rule, never materialised one by one.

A *unit* is a rule (``flat``: a ZeRO buffer of named tensors' blocks cut into ``n`` equal
ranges; ``grid``: one tensor sharded over a DTensor mesh) plus the ranks that claimed its
members (:mod:`unickpt.plan` reads the claims). What depends only on a unit's geometry
(spans, held sizes, run counts, the sources' runs) is shared by every unit of that geometry,
e.g. the same tensors in every layer, and cached between plans.
"""

from __future__ import annotations

import bisect
import itertools
import math

import numpy as np

from .errors import LayoutError
from .layout import Layout, _box_runs, _run_span

__all__ = ["Unit", "UnitSet", "FlatGeo", "GridGeo", "boxes_tile", "MAX_GRID_MEMBERS"]


MAX_GRID_MEMBERS = 1 << 22
"""Members a grid rule may have (a mesh of 4 million ranks): its geometry holds a few int64
arrays of that many entries; a hint claiming a larger mesh is no rule."""


def _ints(v, lo: int, hi: int | None = None) -> bool:
    """``v`` is a list or tuple of ints in ``[lo, hi)`` (a rule body from a peer, or a hint)."""
    return isinstance(v, (list, tuple)) and all(type(x) is int and lo <= x and (hi is None or x < hi) for x in v)


def _chunk(n: int, parts: int, i):
    """torch.chunk / DTensor Shard sizes: ``(offset, size)`` of part ``i`` (arrays work)."""
    c = -(-n // parts) if parts else 0
    lo = np.minimum(i * c, n)
    return lo, np.minimum(lo + c, n) - lo


class UnitSet:
    """Claims of one set of units: member index -> rank (and back)."""

    __slots__ = ("sid", "units", "index_of", "claims")

    def __init__(self, sid: str, units: list) -> None:
        self.sid, self.units, self.index_of = sid, units, {}
        self.claims: list[tuple[int, int]] = []  # (index, rank)


class Unit:
    """A rule: ``flat`` (named tensors' blocks flattened back to back, ``total`` elements cut
    into ``n`` equal ranges; member ``i`` holds range ``i``) or ``grid`` (one tensor sharded
    over a mesh of ``n`` members, torch.chunk sizes; member ``i``: row-major coordinate).
    What depends only on the geometry (not on names or claims) lives in a shared
    :class:`FlatGeo` / :class:`GridGeo`."""

    __slots__ = ("body", "kind", "n", "slots", "geo", "sets", "members", "counts", "regular", "complete_slots")

    def __init__(self, body: dict, names: list[str], geo: "FlatGeo | None" = None) -> None:
        """``body``: the rule without its tensor names (:func:`_template`), ``names``: them;
        ``geo``: the geometry of ``body`` when already known (units of one template)."""
        self.body, self.kind, self.n = body, body["k"], int(body["n"])
        self.sets: list[UnitSet] = []
        self.members: np.ndarray | None = None  # index -> rank (-1: unclaimed), shared by units of the same sets
        self.counts: np.ndarray | None = None  # claimed members before each index
        self.regular = True
        self.complete_slots: list[bool] = []  # per slot: every member touching it claimed once
        self.geo: FlatGeo | GridGeo | None = None
        if len(names) != len(body["t"]) or (self.kind == "grid" and len(names) != 1):
            raise LayoutError(f"layout rule of {len(body['t'])} tensors comes with {len(names)} names")
        if self.kind == "flat":
            self.geo = geo or _flat_geo(int(body["total"]), self.n,
                                        tuple((tuple(sh), tuple(o), tuple(z), int(r)) for sh, o, z, r in body["t"]))
            self.slots = [(name, *g) for name, g in zip(names, self.geo.slots)]
        elif self.kind == "grid":
            (sh,) = body["t"][0]
            self.slots = [(names[0], tuple(sh), None, None, 0)]
            mesh, pl, order = body.get("mesh"), body.get("pl"), body.get("order", None)
            if not (_ints(mesh, 1) and _ints(pl, -1, len(sh)) and _ints(sh, 0) and len(pl) == len(mesh)):
                raise LayoutError(f"grid rule of {names[0]!r}: malformed (mesh {mesh!r}, placements {pl!r}, shape {sh!r})")
            if math.prod(mesh) != self.n or self.n > MAX_GRID_MEMBERS:
                raise LayoutError(f"grid rule of {names[0]!r}: mesh {mesh} does not have {self.n} members (at most "
                                  f"{MAX_GRID_MEMBERS})")
            if order is not None and not (_ints(order, 0) and sorted(order) == list(range(len(mesh)))):
                raise LayoutError(f"grid rule of {names[0]!r}: order {order!r} is not an order of the mesh's "
                                  f"{len(mesh)} dimensions")
        else:
            raise LayoutError(f"unknown layout rule {self.kind!r}")

    def _grid(self) -> "GridGeo":
        if self.geo is None:
            self.geo = _grid_geo(self.slots[0][1], tuple(self.body["mesh"]), tuple(self.body["pl"]),
                                 tuple(self.body["order"]) if "order" in self.body else None)
        return self.geo

    @property
    def claims(self):
        """``(index, rank)`` of every claim on this unit (duplicates included)."""
        return [c for st in self.sets for c in st.claims]

    def first_rank(self) -> int:
        return min((r for _, r in self.claims), default=-1)

    def indices_of(self, rank: int) -> list[int]:
        return [s.index_of[rank] for s in self.sets if rank in s.index_of]

    def span(self, j: int) -> tuple[int, int]:
        """Members ``[a, b)`` whose pieces of slot ``j`` are rows of the summary today."""
        if self.kind == "grid":
            return 0, self.n
        return self.geo.a[j], self.geo.b[j]

    def piece(self, j: int, i: int) -> Layout | None:
        name, shape, offs, sizes, rep = self.slots[j]
        if self.kind == "flat":
            t0, part = self.geo.t0, self.geo.part
            lo = max(i * part, t0[j])
            hi = min((i + 1) * part, t0[j + 1])
            if hi <= lo:
                return None
            return Layout(shape, offs, sizes, (lo - t0[j], hi - t0[j]), rep)
        offs, sizes, rep = self._grid().box(i)
        return Layout(shape, offs, sizes, None, rep)

    def slots_of(self, i: int) -> range:
        """Slots member ``i`` holds a piece of."""
        if self.kind == "grid":
            return range(1)
        t0, part = self.geo.t0, self.geo.part
        lo, hi = i * part, (i + 1) * part
        a = bisect.bisect_right(t0, lo) - 1
        b = bisect.bisect_left(t0, hi)
        return range(max(a, 0), min(b, len(self.slots)))

    def claimed_pieces(self, j: int) -> list[tuple[int, Layout]]:
        a, b = self.span(j)
        out = []
        for i, r in self.claims:
            if a <= i < b:
                lay = self.piece(j, i)
                if lay is not None:
                    out.append((r, lay))
        return out

    def complete(self, j: int) -> bool:
        return self.complete_slots[j]

    def arrays(self, j: int):
        """Over members ``[a, b)`` of slot ``j``: ``(ranks, held, replica, runs, full)``
        (flat: replica and runs may be one number for all, full is None: see full_ranks)."""
        a, b = self.span(j)
        ranks = self.members[a:b]
        if self.kind == "flat":
            held, runs = self.geo.held_runs(j)
            return ranks, held, self.slots[j][4], runs, None
        g = self._grid()
        return ranks, g.held, g.rep, g.runs, g.full

    def top(self, j: int) -> tuple[int, np.ndarray]:
        """The most elements a member holds of slot ``j`` and the ranks holding that many."""
        if self.kind == "flat":
            h, lo, hi = self.geo.top[j]
            return h, self.members[lo:hi]
        g = self._grid()
        return g.top, self.members[g.top_at]

    def levels(self, j: int) -> list[tuple[int, np.ndarray]]:
        """``(held, ranks)`` of the members holding elements of slot ``j``, per held size."""
        if self.kind == "flat":
            return [(h, self.members[lo:hi]) for h, lo, hi in self.geo.levels(j)]
        return [(h, self.members[at]) for h, at in self._grid().levels()]

    def source_counts(self, j: int) -> tuple[int, int]:
        """Replica-0 members holding elements of slot ``j``, and their runs in total."""
        if self.kind == "flat":
            if self.slots[j][4] != 0:
                return 0, 0
            a, b = self.span(j)
            return b - a, self.geo.runs_total(j)
        g = self._grid()
        return g.n_src, g.src_runs

    def member_runs(self, j: int, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """``(starts, lengths, local offsets)`` of member ``i``'s piece of slot ``j`` when it
        is a source (replica 0, elements held), else None. Views of cached arrays."""
        if self.kind == "flat":
            m, starts, lengths, local, at = self.geo.source_runs(j)
            k = i - self.geo.a[j]
        else:
            m, starts, lengths, local, at = self._grid().source_runs()
            k = i
        if not 0 <= k < len(at) - 1 or at[k] == at[k + 1]:
            return None
        lo, hi = int(at[k]), int(at[k + 1])
        return starts[lo:hi], lengths[lo:hi], local[lo:hi]

    def source_runs(self, j: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Runs of the replica-0 pieces of slot ``j``, in member order then local order:
        ``(member, rank, start, length, local offset)`` per run."""
        if self.kind == "flat":
            m, starts, lengths, local, _ = self.geo.source_runs(j)
            return m, self.members[self.geo.a[j] + m], starts, lengths, local
        m, starts, lengths, local, _ = self._grid().source_runs()
        return m, self.members[m], starts, lengths, local

    def full_ranks(self, j: int) -> list[int]:
        """Ranks whose piece of slot ``j`` is the whole tensor."""
        if self.kind == "flat":
            name, shape, offs, sizes, rep = self.slots[j]
            a, b = self.span(j)
            return [int(self.members[a])] if b == a + 1 and sizes == shape else []
        return self.members[self._grid().full_at].tolist()

    def tiles(self, j: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """The box this unit's replica-0 pieces of slot ``j`` tile (None: no replica-0 piece)."""
        name, shape, offs, sizes, rep = self.slots[j]
        if self.kind == "grid":
            return (0,) * len(shape), shape
        return (offs, sizes) if rep == 0 else None


class FlatGeo:
    """What flat units of one geometry share, their names apart (a model's layers do): per
    slot, the members ``[a, b)`` touching it, the most one holds and which, held sizes and
    run counts (arrays built on first use)."""

    __slots__ = ("slots", "bn", "t0", "part", "a", "b", "top", "_held", "_runs", "_src")

    def __init__(self, total: int, n: int, slots: tuple) -> None:
        self.slots = slots  # (shape, offsets, sizes, replica) per slot
        self.bn = [math.prod(z) for _, _, z, _ in slots]
        self.t0 = [0, *itertools.accumulate(self.bn)]
        if n < 1 or self.t0[-1] > total or total % n:
            raise LayoutError(f"flat unit of {self.t0[-1]} elements does not fit {total} over {n}")
        part = self.part = total // n
        self.a, self.b, self.top = [], [], []
        for t0, bn in zip(self.t0, self.bn):
            if bn == 0:
                self.a.append(0)
                self.b.append(0)
                self.top.append((0, 0, 0))
                continue
            a, b = t0 // part, (t0 + bn - 1) // part + 1
            first = min((a + 1) * part, t0 + bn) - t0  # held by members a and b - 1
            last = t0 + bn - max((b - 1) * part, t0)
            h = part if b - a > 2 else max(first, last)  # members in between hold `part`
            self.a.append(a)
            self.b.append(b)
            self.top.append((h, a + (first < h), b - (last < h)))
        self._held: dict[int, tuple] = {}
        self._runs: dict[int, int] = {}
        self._src: dict[int, tuple] = {}

    def held_runs(self, j: int) -> tuple[np.ndarray, np.ndarray | int]:
        """Per member of ``[a, b)``: elements held of slot ``j`` and their runs (a number when
        every piece is one run)."""
        if j not in self._held:
            shape, offs, sizes, _ = self.slots[j]
            a, b, t0 = self.a[j], self.b[j], self.t0[j]
            lo = np.arange(a, b, dtype=np.int64) * self.part - t0
            hi = lo + self.part
            lo[0], hi[-1] = 0, self.bn[j]
            np.maximum(lo, 0, out=lo)
            span = _run_span(shape, offs, sizes, None)
            runs = 1 if span is None or span[0] < 0 else (hi - 1) // span[1] - lo // span[1] + 1
            self._held[j] = (hi - lo, runs)
        return self._held[j]

    def source_runs(self, j: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`Unit.source_runs` with members counted from ``a`` (none if replica > 0),
        and where each member's runs start (``b - a + 1`` offsets): the members' flat ranges
        and the box's runs, both cutting ``[0, bn)``, merged."""
        if j not in self._src:
            shape, offs, sizes, rep = self.slots[j]
            if rep != 0 or self.bn[j] == 0:
                z = np.zeros(0, np.int64)
                self._src[j] = (z, z, z, z, np.zeros(1, np.int64))
                return self._src[j]
            a, b, t0, bn = self.a[j], self.b[j], self.t0[j], self.bn[j]
            lo = np.maximum(np.arange(a, b, dtype=np.int64) * self.part - t0, 0)  # each member's first element
            box = _box_runs(shape, offs, sizes, None)
            box_lo = box.local
            cuts = np.union1d(lo, box_lo)
            m = np.searchsorted(lo, cuts, side="right") - 1
            r = np.searchsorted(box_lo, cuts, side="right") - 1
            ends = np.append(cuts[1:], bn)
            at = np.searchsorted(m, np.arange(b - a + 1))
            self._src[j] = (m, box.starts[r] + (cuts - box_lo[r]), ends - cuts, cuts - lo[m], at)
        return self._src[j]

    def levels(self, j: int) -> list[tuple[int, int, int]]:
        """``(held, lo, hi)``: members ``[lo, hi)`` hold ``held`` elements of slot ``j``."""
        h, lo, hi = self.top[j]
        if h == 0:
            return []
        out = [(h, lo, hi)]
        a, b = self.a[j], self.b[j]
        if lo > a:  # member a holds less
            out.append((min((a + 1) * self.part, self.t0[j + 1]) - self.t0[j], a, a + 1))
        if hi < b:  # member b - 1 holds less
            out.append((self.t0[j + 1] - max((b - 1) * self.part, self.t0[j]), b - 1, b))
        return out

    def runs_total(self, j: int) -> int:
        if j not in self._runs:
            _, runs = self.held_runs(j)
            self._runs[j] = int(runs.sum()) if isinstance(runs, np.ndarray) else runs * (self.b[j] - self.a[j])
        return self._runs[j]


_CACHED = 64
"""Geometries kept between plans (a model has a few tensor shapes; each geometry holds
arrays over its members, ~1 MB at 10,000 ranks once its runs are built)."""
_FLAT: dict = {}


def _cached(cache: dict, key, make):
    """``cache[key]``, made by ``make()`` when absent; the cache is emptied when it is full."""
    v = cache.get(key)
    if v is None:
        if len(cache) >= _CACHED:
            cache.clear()
        v = cache[key] = make()
    return v


def _flat_geo(total: int, n: int, slots: tuple) -> FlatGeo:
    return _cached(_FLAT, (total, n, slots), lambda: FlatGeo(total, n, slots))


class GridGeo:
    """Per member of a grid (row-major coordinates): held, replica, runs, full; the members
    holding most, and the sources' count and runs. Shared by tensors of one shape on one mesh."""

    __slots__ = ("shape", "offs", "sizes", "held", "rep", "runs", "full", "top", "top_at", "full_at", "n_src",
                 "src_runs", "_src", "_levels")

    def __init__(self, shape: tuple, mesh: tuple, pl: tuple, order: tuple | None = None) -> None:
        """``pl``: the tensor dimension each mesh dimension shards (-1: replicates);
        ``order``: the order in which the mesh dimensions cut (default: mesh order, as DTensor
        ``Shard`` placements do). Each cut is torch.chunk of the range the earlier ones left,
        so a tensor dimension may be cut by several mesh dimensions (FSDP2 over TP, whose
        ``_StridedShard`` cuts inside the TP block: order ``(1, 0)``)."""
        nd = len(shape)
        offs = [np.zeros(mesh, np.int64) for _ in range(nd)]
        sizes = [np.full(mesh, shape[d], np.int64) for d in range(nd)]
        rep = np.zeros(mesh, np.int64)
        coords = [np.arange(mesh[m], dtype=np.int64).reshape([-1 if k == m else 1 for k in range(len(mesh))])
                  for m in range(len(mesh))]
        for m, d in enumerate(pl):
            if d < 0:
                rep = rep * mesh[m] + coords[m]
        for m in (order if order is not None else range(len(mesh))):
            d = pl[m]
            if d >= 0:
                o, z = _chunk(sizes[d], mesh[m], coords[m])
                offs[d] = np.broadcast_to(offs[d] + o, mesh).copy()
                sizes[d] = np.broadcast_to(z, mesh).copy()
        held = np.ones(mesh, np.int64)
        for z in sizes:
            held = held * z
        runs = np.ones(mesh, np.int64)  # runs of a box: product of the sizes before its last partial dim
        partial_seen = np.zeros(mesh, bool)
        for d in reversed(range(nd)):
            partial = (offs[d] != 0) | (sizes[d] != shape[d])
            runs = np.where(partial_seen, runs * sizes[d], runs)
            partial_seen |= partial
        runs = np.where(held > 0, runs, 0)
        self.shape = shape
        self.offs = [o.ravel() for o in offs]
        self.sizes = [z.ravel() for z in sizes]
        self.held, self.rep, self.runs = held.ravel(), np.broadcast_to(rep, mesh).ravel(), runs.ravel()
        self.full = self.held == math.prod(shape)
        self.top = int(self.held.max()) if self.held.size else 0
        self.top_at = np.flatnonzero(self.held == self.top)
        self.full_at = np.flatnonzero(self.full)
        src = (self.rep == 0) & (self.held > 0)
        self.n_src, self.src_runs = int(src.sum()), int(self.runs[src].sum())
        self._src: tuple | None = None
        self._levels: list | None = None

    def levels(self) -> list[tuple[int, np.ndarray]]:
        """``(held, members)`` per held size > 0, most first."""
        if self._levels is None:
            self._levels = [(int(h), np.flatnonzero(self.held == h)) for h in np.unique(self.held)[::-1] if h > 0]
        return self._levels

    def source_runs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(member, start, length, local offset)`` of every run of the replica-0 members
        holding elements, in member order then local order, and where each member's runs
        start (``n + 1`` offsets). Boxes of one size have the same
        runs shifted by their first element, so the runs are built once per size."""
        if self._src is None:
            src = np.flatnonzero((self.rep == 0) & (self.held > 0))
            strides = [math.prod(self.shape[d + 1:]) for d in range(len(self.shape))]
            base = np.zeros(len(src), np.int64)
            for d, stride in enumerate(strides):
                base += self.offs[d][src] * stride
            sizes = list(zip(*(z[src].tolist() for z in self.sizes))) if self.shape else [()] * len(src)
            kinds: dict[tuple, int] = {}
            which = np.array([kinds.setdefault(z, len(kinds)) for z in sizes], np.int64)
            per_kind = [_box_runs(self.shape, (0,) * len(self.shape), k, None) for k in kinds]
            n = np.array([len(r) for r in per_kind], np.int64)[which]  # runs per member
            first = np.repeat(np.cumsum(n) - n, n)
            k_of = np.repeat(which, n)
            pos = np.arange(int(n.sum()), dtype=np.int64) - first  # run index inside its box
            offs = np.cumsum([0] + [len(r) for r in per_kind])[:-1]
            cat = [np.concatenate([getattr(r, f) for r in per_kind]) if per_kind else np.zeros(0, np.int64)
                   for f in ("starts", "lengths", "local")]
            at = offs[k_of] + pos if len(pos) else pos
            member = np.repeat(src, n)
            self._src = (member, np.repeat(base, n) + cat[0][at], cat[1][at], cat[2][at],
                         np.searchsorted(member, np.arange(len(self.held) + 1)))
        return self._src

    def box(self, i: int) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        """``(offsets, sizes, replica)`` of member ``i``."""
        return tuple(int(o[i]) for o in self.offs), tuple(int(z[i]) for z in self.sizes), int(self.rep[i])


_GEO: dict = {}


def _grid_geo(shape, mesh, pl, order=None) -> GridGeo:
    """Cached by geometry (tensors of one shape on one mesh share it)."""
    return _cached(_GEO, (shape, mesh, pl, order), lambda: GridGeo(shape, mesh, pl, order))


def boxes_tile(shape, boxes) -> bool:
    """Whether ``boxes`` ``(offsets, sizes)`` tile a tensor of ``shape`` exactly (cached)."""
    key = (tuple(shape), tuple(sorted(boxes)))
    if key not in _TILES:
        if len(_TILES) > 4096:
            _TILES.clear()
        _TILES[key] = _tiles(shape, boxes)
    return _TILES[key]


_TILES: dict = {}


def _tiles(shape, boxes) -> bool:
    runs = [Layout(tuple(shape), tuple(o), tuple(z)).runs() for o, z in boxes]
    if not runs:
        return False
    starts = np.concatenate([r.starts for r in runs])
    lengths = np.concatenate([r.lengths for r in runs])
    order = np.argsort(starts, kind="stable")
    starts, lengths = starts[order], lengths[order]
    return bool(int(lengths.sum()) == math.prod(shape) and starts[0] == 0
                and np.array_equal(starts[1:], (starts + lengths)[:-1]))
