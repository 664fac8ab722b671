"""Making the plan (:func:`make_plan`): every tensor checked (dtype, shape, tiling of its pieces),
its writer chosen (bytes balanced, holders preferred), written in place or gathered."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..errors import LayoutError
from ..layout import Layout
from ..rules import FlatGeo, Unit, UnitSet, boxes_tile
from .files import make_chunks, make_files
from .model import SavePlan, TensorPlan, _rule_source_runs, gc_paused


BALANCE_SLACK = 1.1


DIRECT_MIN_RUN = 256 << 10
"""Pieces whose runs average at least this many bytes are written by their holder straight
into the writer's file (same node only) instead of travelling to the writer."""


def make_plan(
    summaries: list[dict], *, bucket_bytes: int, max_file_bytes: int | None = None, zstd: int | None = None,
    shared_writes: bool = True, rules: dict | None = None, lossless: bool = False,
) -> SavePlan:
    """``zstd``: level for the files of every role but ``model`` (model files stay plain);
    ``lossless``: every file byte-grouped (:mod:`unickpt.container`).
    ``shared_writes``: the storage lets several ranks write one file (its
    :attr:`~unickpt.io.storage.Capabilities.shared_writes`); without it every piece is gathered
    to its file's one writer. ``rules``: ``{"sets": {sid: [unit digest]}, "units": {digest:
    (template, names)}}`` (a body split by :func:`_template`), the rule bodies named by the summaries' claims ``"c": [[sid, index]]`` (see
    :func:`summarize` and :func:`assemble`); a claimed unit's pieces are never materialised
    unless its tensors fit no rule check (then they are planned as explicit pieces)."""
    with gc_paused():
        return _make_plan(summaries, bucket_bytes, max_file_bytes, zstd, shared_writes, rules, lossless)


def _make_plan(summaries, bucket_bytes, max_file_bytes, zstd, shared_writes, rules, lossless=False) -> SavePlan:
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
        t.direct = (shared_writes and _can_write_direct(t, nodes, node_of, memo)
                    and not lossless and not (zstd and t.role != "model"))
    files = make_files(tensors, world, nodes, max_file_bytes)
    for f in files:
        f.lossless = lossless
        f.zstd = zstd if f.role != "model" and not lossless else None
    chunks = make_chunks(files, world, bucket_bytes)
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
    if t.nbytes == 0:
        return False
    if t.quantized and not _group_aligned(t):
        return False  # a run that cuts a quantization group: the writer gathers and encodes it whole
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


def _group_aligned(t: TensorPlan) -> bool:
    """Whether every piece of quantized ``t`` is whole groups (its runs start on a group
    boundary and end on one or at the tensor's end): each holder can then encode its own
    runs and write their codes in place (codes do not depend on how a tensor is cut)."""
    g = t.codec["group"]
    if t.writer in t.full_holders:
        return True
    pairs = [(r.starts, r.lengths) for r in (lay.runs() for _, lay in t.explicit if lay.replica == 0 and lay.numel > 0)]
    if t.rules:  # (DTensors, named flat partitions: their runs in closed form, no Layout per piece)
        pairs.append(_rule_source_runs(t)[2:4])
    for starts, lengths in pairs:
        ends = starts + lengths
        if np.any(starts % g) or np.any((lengths % g != 0) & (ends != t.numel)):
            return False
    return True


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

