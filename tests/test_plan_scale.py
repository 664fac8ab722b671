"""The planner at 10,000 simulated ranks: ZeRO-3 units, TP 8 x ZeRO, FSDP2 over TP (DTensor
2-D: ``(_StridedShard(0), Shard(0))`` and ``(Shard(0), Shard(1))`` grids). Checks the
plan, not its speed (bench/plan_scale.py measures): every element has exactly one source,
each sampled rank's schedule moves exactly its pieces, every written segment is filled
exactly once, files and offsets are consistent; the plan from rule summaries (layouts
described by rule, pieces never materialised) is identical to the plan from explicit rows,
at 10,000 ranks and on random small cases (gaps, overlaps, replicas, mixed rules and rows)."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch

from unickpt.errors import LayoutError
from unickpt.layout import Layout, partition_flat
from unickpt.plan import assemble, extents_of, make_plan, summarize
from unickpt.plan.summary import _claim_owners, _rows
from unickpt.state import Entry

WORLD = 10_000
TP = 8
SAMPLE = [0, 1, 7, 8, 4_999, 5_003, 9_992, 9_999]


def _model():
    h, kv, ffn, vocab = 64, 16, 176, 300
    p = "layers.0."
    return [
        ("embed.weight", (vocab, h), "row"), (p + "attn_norm.weight", (h,), "rep"), (p + "q.weight", (h, h), "row"),
        (p + "k.weight", (kv, h), "row"), (p + "o.weight", (h, h), "col"), (p + "down.weight", (h, ffn), "col"),
        (p + "up.weight", (ffn, h), "row"), ("norm.weight", (h,), "rep"), ("output.weight", (vocab, h), "row"),
    ]


def _chunk(n, parts, i):
    c = -(-n // parts)
    lo = min(i * c, n)
    return lo, min(lo + c, n) - lo


def _layouts(kind, rank):
    tensors = _model()
    units = [tensors[:1] + tensors[7:], tensors[1:7]]
    out = []
    if kind == "zero3":
        for unit in units:
            names = [n for n, _, _ in unit]
            for i, lay, _, _ in partition_flat([s for _, s, _ in unit], WORLD, rank, names=names):
                out.append((unit[i][0], lay))
    elif kind == "tp8-zero":
        dp, tp = divmod(rank, TP)
        for unit in units:
            boxes = []
            for _, shape, split in unit:
                if split == "rep":
                    boxes.append(((0,) * len(shape), shape, tp))
                    continue
                d = 0 if split == "row" else 1
                o, s = _chunk(shape[d], TP, tp)
                offs, sizes = [0] * len(shape), list(shape)
                offs[d], sizes[d] = o, s
                boxes.append((tuple(offs), tuple(sizes), 0))
            for i, lay, _, _ in partition_flat([s for _, s, _ in unit], WORLD // TP, dp, boxes=boxes,
                                               names=[n for n, _, _ in unit]):
                out.append((unit[i][0], lay))
    else:  # fsdp2tp: (WORLD/8, 8) mesh; column-parallel matrices (_StridedShard(0), Shard(0)): FSDP's
        # cut inside each TP block; row-parallel ones (Shard(0), Shard(1)); 1-D (Shard(0), Replicate())
        mesh, coord = (WORLD // TP, TP), divmod(rank, TP)
        for name, shape, split in tensors:
            if len(shape) == 1:
                out.append((name, grid_layout(shape, mesh, (0, -1), coord)))
            elif split == "row":
                out.append((name, grid_layout(shape, mesh, (0, 0), coord, order=(1, 0))))
            else:
                out.append((name, grid_layout(shape, mesh, (0, 1), coord)))
    return out


def grid_box(shape, mesh, pl, coord, order=None):
    """``(offsets, sizes, replica)``: torch.chunk cuts by each mesh dim in ``order`` (default
    mesh order), each inside the range the earlier ones left."""
    offs, sizes, replica = [0] * len(shape), list(shape), 0
    for m, d in enumerate(pl):
        if d < 0:
            replica = replica * mesh[m] + coord[m]
    for m in order if order is not None else range(len(mesh)):
        if pl[m] >= 0:
            o, z = _chunk(sizes[pl[m]], mesh[m], coord[m])
            offs[pl[m]], sizes[pl[m]] = offs[pl[m]] + o, z
    return tuple(offs), tuple(sizes), replica


def grid_layout(shape, mesh, pl, coord, order=None, hint_order="same"):
    """A DTensor's layout as ``unickpt.layout._dtensor_layout`` computes it, with its hint
    (``pl``: the tensor dim each mesh dim shards, -1: replicated; ``order``: the order of the
    cuts, as FSDP2's _StridedShard gives it). ``hint_order``: the order the hint says, when
    it differs from the box's (a rank whose real box is not the rule's piece)."""
    offs, sizes, replica = grid_box(shape, mesh, pl, coord, order)
    hint = ("grid", tuple(mesh), tuple(pl), int(np.ravel_multi_index(tuple(coord), mesh)),
            order if hint_order == "same" else hint_order)
    return Layout(tuple(shape), offs, sizes, None, replica, hint)


def _entries(pairs):
    return [Entry(role, name, torch.empty(0), lay) for role, name, lay in pairs]


def explicit_summaries(per_rank, node):
    """One row per piece: the summaries before rules."""
    return [{"node": node(r), "t": _rows(_entries(p), ["BF16"] * len(p), {})} for r, p in enumerate(per_rank)]


def rule_summaries(per_rank, node):
    """What the saver exchanges: every rank's head, then its payload (rules where hinted)."""
    local = [summarize(e, ["BF16"] * len(e), node(r)) for r, e in enumerate(map(_entries, per_rank))]
    heads = [x.head() for x in local]
    owners = _claim_owners(heads)  # (each rank computes it once; here once for all)
    return assemble(heads, [x.payload(heads, r, owners) for r, x in enumerate(local)])


def _summaries(kind):
    return rule_summaries([[("model", n, lay) for n, lay in _layouts(kind, r)] for r in range(WORLD)],
                          lambda r: f"n{r // 8}")


def _tiles(starts, lengths, total) -> bool:
    order = np.argsort(starts, kind="stable")
    s, n = np.asarray(starts)[order], np.asarray(lengths)[order]
    return int(n.sum()) == total and (len(s) == 0 or (s[0] == 0 and np.array_equal(s[1:], (s + n)[:-1])))


@pytest.fixture(scope="module", params=["zero3", "tp8-zero", "fsdp2tp"])
def plan(request):
    summaries, rules = _summaries(request.param)
    assert sum(len(s["t"]) for s in summaries) == 0  # every piece described by a rule
    plan = make_plan(summaries, bucket_bytes=64 << 10, rules=rules)
    assert all(t.rules for t in plan.tensors.values())  # and planned from the rules
    return plan


@pytest.mark.parametrize("kind", ["zero3", "tp8-zero", "fsdp2tp"])
def test_rule_plan_equals_explicit_plan_at_10000_ranks(kind):
    per_rank = [[("model", n, lay) for n, lay in _layouts(kind, r)] for r in range(WORLD)]
    node = lambda r: f"n{r // 8}"  # noqa: E731
    a = make_plan(explicit_summaries(per_rank, node), bucket_bytes=64 << 10)
    summaries, rules = rule_summaries(per_rank, node)
    b = make_plan(summaries, bucket_bytes=64 << 10, rules=rules)
    assert plan_key(a, SAMPLE) == plan_key(b, SAMPLE)


def plan_key(plan, ranks):
    """Everything a save does with a plan: files, offsets, writers, pieces, chunks, the
    schedules of ``ranks`` and their in-place extents."""
    files = [(f.name, f.writer, f.node, f.header, [t.key for t in f.tensors], f.zstd) for f in plan.files]
    tens = {k: (t.writer, t.file, t.begin, t.end, t.direct, sorted(set(t.full_holders)),
                [(r, lay.offsets, lay.sizes, lay.flat, lay.replica) for r, lay in t.pieces])
            for k, t in plan.tensors.items()}
    chunks = {w: [[(g.tensor.key, g.file_index, g.start, g.stop) for g in c] for c in cs] for w, cs in plan.chunks.items()}

    def runs(x):
        return x.starts.tolist(), x.lengths.tolist()

    sched = {}
    for r in ranks:
        sched[r] = [([(d, t.key, runs(x)) for d, t, x in st.sends],
                     [(a, t.key, si, runs(x)) for a, t, si, x in st.recvs],
                     [(t.key, si, runs(x), runs(y)) for t, si, x, y in st.copies],
                     [(g.tensor.key, g.file_index, g.start, g.stop) for g in st.segments], st.local_whole)
                    for st in plan.schedule(r)]
        sched[r, "ext"] = sorted((t.key, e) for t in plan.tensors.values() if t.direct for e in extents_of(t, r))
    return files, tens, chunks, sched


def _random_case(rng: random.Random):
    """Random small layouts on W ranks: ZeRO units (names, sometimes boxes, padding, a
    rank's piece mis-hinted or missing), DTensor grids (uneven, replicated dims), plain
    tensors, explicit shards."""
    W = rng.choice([1, 2, 3, 4, 6, 8])
    per_rank = [[] for _ in range(W)]
    n_units = rng.randint(0, 3)
    for u in range(n_units):
        shapes = [tuple(rng.randint(1, 9) for _ in range(rng.randint(1, 2))) for _ in range(rng.randint(1, 4))]
        names = [f"u{u}.t{i}" for i in range(len(shapes))]
        boxes, tp = None, 1
        if rng.random() < 0.3 and W % 2 == 0:  # TP 2 x ZeRO: each TP rank's row blocks
            tp = 2
        for g in range(tp):
            if tp > 1:
                boxes = []
                for sh in shapes:
                    if rng.random() < 0.3 or sh[0] < 2:
                        boxes.append(((0,) * len(sh), sh, g))  # replicated over TP
                    else:
                        o, z = (0, sh[0] // 2) if g == 0 else (sh[0] // 2, sh[0] - sh[0] // 2)
                        boxes.append(((o,) + (0,) * (len(sh) - 1), (z,) + sh[1:], 0))
            n = W // tp
            numel = sum(math.prod(b[1]) for b in boxes) if boxes else sum(math.prod(s) for s in shapes)
            total = -(-numel // n) * n + (n * rng.randint(0, 2) if rng.random() < 0.3 else 0)
            for i in range(n):
                rank = g + tp * i if tp > 1 else i
                for k, lay, _, _ in partition_flat(shapes, n, i, total=total, names=names, boxes=boxes):
                    if rng.random() < 0.05:
                        lay = Layout(lay.shape, lay.offsets, lay.sizes, lay.flat, lay.replica)  # no hint
                    if rng.random() < 0.02:
                        continue  # a gap
                    per_rank[rank].append(("model", names[k], lay))
    if W > 1 and rng.random() < 0.7:
        a = rng.choice([m for m in range(1, W + 1) if W % m == 0])
        mesh = (a, W // a)
        for k in range(rng.randint(1, 3)):
            sh = tuple(rng.randint(0 if rng.random() < 0.1 else 1, 7) for _ in range(rng.randint(1, 3)))
            pl = tuple(rng.choice([-1] + list(range(len(sh)))) for _ in mesh)
            # cut in mesh order (Shard) or the other way (FSDP2's _StridedShard over TP); one dim
            # may be cut by both; sometimes the hint says the other order than the boxes follow
            # (uneven strided cuts): ranks whose box is not the rule's piece send rows
            order = rng.choice([None, (1, 0)])
            said = rng.choice(["same", "same", (1, 0) if order is None else None])
            for r in range(W):
                per_rank[r].append(("optim", f"g{k}", grid_layout(sh, mesh, pl, divmod(r, mesh[1]), order, said)))
    for k in range(rng.randint(0, 2)):
        sh = (rng.randint(1, 5), 3)
        holders = [r for r in range(W) if rng.random() < 0.7] or [0]
        for r in holders:
            per_rank[r].append(("model", f"plain{k}", Layout.full(sh, replica=0 if rng.random() < 0.8 else 1)))
    return per_rank


def test_a_malformed_grid_hint_is_no_rule():
    """A hand-made Layout whose grid hint is malformed (negative or float mesh, a placement
    out of range, a float order) is planned from its explicit row; the rule is never built."""
    lay = lambda hint: Layout((6, 4), (0, 0), (6, 4), None, 0, hint)  # noqa: E731  (the whole tensor)
    for hint in (("grid", (-1, 2), (0, 1), 0), ("grid", (2, 2), (0, 7), 0), ("grid", (2.0, 1), (0, -1), 0),
                 ("grid", (1, 1), (0, 1), 0, (1.0, 0.0)), ("grid", (1, 1), (0, 1), "0", None),
                 ("grid", (1, 1), (0, 1), 0, 5), ("grid", (10 ** 6, 10 ** 6), (0, -1), 0)):
        s = summarize(_entries([("model", "w", lay(hint))]), ["BF16"], "n0")
        assert len(s.rows) == 1 and not s.claims, hint
        plan = make_plan([{"node": "n0", "t": s.rows}], bucket_bytes=4096)
        assert plan.tensors[("model", "w")].writer == 0


def _random_rule_plans(seed: int, cases: int):
    """``(case, world, plan)`` of the random cases that plan (from rule summaries, one node)."""
    rng = random.Random(seed)
    for case in range(cases):
        per_rank = _random_case(rng)
        summaries, rules = rule_summaries(per_rank, lambda r: "n0")
        try:
            yield case, len(per_rank), make_plan(summaries, bucket_bytes=64, rules=rules)
        except LayoutError:
            continue


def test_rule_plans_equal_explicit_plans_on_random_cases():
    rng = random.Random(13)
    n_err = 0
    for case in range(300):
        per_rank = _random_case(rng)
        node = (lambda r: "n0") if case % 2 else (lambda r: f"n{r // 2}")
        kw = dict(bucket_bytes=rng.choice([16, 64, 4096]), shared_writes=case % 5 != 0)
        try:
            a = make_plan(explicit_summaries(per_rank, node), **kw)
        except LayoutError:
            n_err += 1
            summaries, rules = rule_summaries(per_rank, node)
            with pytest.raises(LayoutError):  # (the first tensor checked may differ: tensors are
                make_plan(summaries, rules=rules, **kw)  # created in another order)
            continue
        summaries, rules = rule_summaries(per_rank, node)
        b = make_plan(summaries, rules=rules, **kw)
        assert plan_key(a, range(len(per_rank))) == plan_key(b, range(len(per_rank))), case
    assert 0 < n_err < 300


def test_every_element_has_exactly_one_source(plan):
    assert len(plan.tensors) == len(_model())
    for t in plan.tensors.values():
        runs = [lay.runs() for _, lay in t.sources()]
        assert _tiles(np.concatenate([r.starts for r in runs]), np.concatenate([r.lengths for r in runs]), t.numel), t.name


def test_files_and_offsets_are_consistent(plan):
    seen = set()
    for f in plan.files:
        pos = 0
        for t in sorted(f.tensors, key=lambda t: t.begin):
            assert t.file == f.name and t.writer == f.writer and t.begin == pos and t.end - t.begin == t.nbytes
            pos = t.end
            seen.add(t.key)
        assert pos == f.data_bytes and f.size == len(f.header) + pos and f.node == plan.nodes[f.writer]
    assert seen == set(plan.tensors)
    for w, chunks in plan.chunks.items():  # gathered tensors: segments tile each tensor once
        for chunk in chunks:
            assert sum(seg.nbytes for seg in chunk) <= plan.bucket_bytes
    segs: dict = {}
    for chunks in plan.chunks.values():
        for chunk in chunks:
            for seg in chunk:
                assert plan.files[seg.file_index].writer == seg.tensor.writer
                segs.setdefault(seg.tensor.key, []).append((seg.start, seg.stop - seg.start))
    for t in plan.tensors.values():
        if t.direct:
            assert t.key not in segs
        else:
            s = segs[t.key]
            assert _tiles([a for a, _ in s], [n for _, n in s], t.numel), t.name


def test_each_sampled_rank_moves_exactly_its_pieces(plan):
    for rank in SAMPLE:
        moved: dict = {}  # tensor -> local runs sent, copied or written in place
        for step in plan.schedule(rank):
            for _, t, runs in step.sends:
                moved.setdefault(t.key, []).append(runs)
            for t, _, runs, _ in step.copies:
                moved.setdefault(t.key, []).append(runs)
            filled = [[] for _ in step.segments]
            for _, t, si, runs in step.recvs:
                filled[si].append(runs)
            for t, si, _, runs in step.copies:
                filled[si].append(runs)
            for seg, runs in zip(step.segments, filled):  # every byte of a written segment, once
                assert plan.files[seg.file_index].writer == rank
                assert _tiles(np.concatenate([r.starts for r in runs]), np.concatenate([r.lengths for r in runs]),
                              seg.stop - seg.start), seg.tensor.name
        for t in plan.tensors.values():
            if t.direct:
                ext = [(lo, n) for r, lo, _, n in extents_of(t) if r == rank]
                if ext:
                    moved.setdefault(t.key, []).append(_runs_of(ext))
        expected = {t.key: lay.numel for t in plan.tensors.values() for r, lay in t.sources() if r == rank}
        assert set(moved) == set(expected), rank
        for key, runs in moved.items():
            assert _tiles(np.concatenate([r.starts for r in runs]), np.concatenate([r.lengths for r in runs]),
                          expected[key]), (rank, key)


def _runs_of(ext):
    from unickpt.layout import Runs

    return Runs(np.array([lo for lo, _ in ext], np.int64), np.array([n for _, n in ext], np.int64))


def test_writer_loads_stay_within_the_balance_bound(plan):
    loads = plan.writer_loads()
    assert sum(loads) == sum(t.nbytes for t in plan.tensors.values())
    assert max(loads) <= 1.1 * sum(loads) / WORLD + max(t.nbytes for t in plan.tensors.values())


def test_rule_writer_choice_equals_the_general_rule_under_any_loads():
    """``_pick_rules`` (level by level of held size) against ``_pick_any`` over every holder,
    with random loads and caps: fitting holders, lower-held holders, non-holders, nobody."""
    from unickpt.plan.make import _pick_any, _pick_rules

    def holders(t):  # every holder once, with the most it holds (from the rules' arrays)
        held: dict[int, int] = {}
        for u, j in t.rules:
            ranks, hn = u.arrays(j)[:2]
            for r, n in zip(ranks.tolist(), hn.tolist()):
                held[r] = max(held.get(r, 0), n)
        return np.array(list(held), np.int64), np.array(list(held.values()), np.int64)

    nprng = np.random.default_rng(7)
    n_checked = 0
    for case, world, plan in _random_rule_plans(7, 120):
        for t in plan.tensors.values():
            if not t.rules:
                continue
            for _ in range(10):
                loads = nprng.integers(0, 3, world) * nprng.choice([1, t.nbytes, 4 * t.nbytes + 1])
                cap = float(nprng.choice([0, t.nbytes, 2 * t.nbytes, loads.max() + t.nbytes, 10 * t.nbytes]))
                assert _pick_rules(t, loads, cap) == _pick_any(t.nbytes, *holders(t), loads, cap), (case, t.name)
                n_checked += 1
    assert n_checked > 500


def test_rule_plan_of_scalar_grid_tensors_equals_explicit_plan():
    """0-d DTensors (replicated on every mesh dim) next to a 1-d one: one rule each."""
    W, mesh = 4, (2, 2)
    per_rank = [[("optim", "step", grid_layout((), mesh, (-1, -1), divmod(r, 2))),
                 ("optim", "v", grid_layout((6,), mesh, (0, -1), divmod(r, 2)))] for r in range(W)]
    node = lambda r: "n0"  # noqa: E731
    a = make_plan(explicit_summaries(per_rank, node), bucket_bytes=64)
    summaries, rules = rule_summaries(per_rank, node)
    assert not any(s["t"] for s in summaries)
    b = make_plan(summaries, bucket_bytes=64, rules=rules)
    assert all(t.rules for t in b.tensors.values())
    assert plan_key(a, range(W)) == plan_key(b, range(W))


def _source_runs_match(t) -> None:
    """The vectorised runs of a rule tensor's sources equal its sources' Layout runs."""
    from unickpt.plan.model import _rule_source_runs

    piece, ranks, starts, lengths, local = _rule_source_runs(t)
    want = [(r, lay.runs()) for r, lay in t.sources()]
    assert ranks.tolist() == [r for r, x in want for _ in range(len(x))], t.name
    assert starts.tolist() == [v for _, x in want for v in x.starts.tolist()], t.name
    assert lengths.tolist() == [v for _, x in want for v in x.lengths.tolist()], t.name
    assert local.tolist() == [v for _, x in want for v in x.local.tolist()], t.name
    assert len(set(piece.tolist())) == len(want), t.name


def test_vectorised_source_runs_equal_layout_runs(plan):
    for t in plan.tensors.values():
        _source_runs_match(t)


def test_vectorised_source_runs_equal_layout_runs_on_random_cases():
    n_checked = 0
    for _, _, plan in _random_rule_plans(5, 150):
        for t in plan.tensors.values():
            if t.rules and t.writer not in t.full_holders:
                _source_runs_match(t)
                n_checked += 1
    assert n_checked > 100


def test_each_units_digest_is_the_digest_of_its_body():
    """summarize names each rule body by the digest of its JSON. Grid bodies are written from
    a text shared by the tensors of one geometry, role, dtype and tag: the digests are those
    of the whole bodies, for names that JSON escapes, per-tensor tags and several roles; a
    layout that is not its rule's piece is sent as a row."""
    from unickpt.plan.summary import _digest

    mesh, pl = (2, 4), (0, 1)
    names = ['w"0', "w\\1", "é2", "w\u00003", "plain"]
    pairs, tags = [], {}
    for role in ("model", "optim.exp_avg"):
        for i, name in enumerate(names):
            pairs.append((role, name, grid_layout((16, 8), mesh, pl, (1, 2))))
            if i % 2:
                tags[(role, name)] = {"codec": "int8", "group": i}
    good = grid_layout((16, 8), mesh, pl, (1, 2))
    bad = Layout(good.shape, good.offsets, (good.sizes[0] - 1, good.sizes[1]), None, 0, good.hint)
    pairs.append(("model", "off_by_one", bad))
    entries = _entries(pairs)
    ls = summarize(entries, ["BF16"] * len(entries), "n0", {e.key: tags.get(e.key) for e in entries})
    assert len(ls.units) == 10 and all(d == _digest(body) for d, body in ls.units.items())
    assert len({json.dumps(b["tag"]) for b in ls.units.values()}) == 3  # None and two tags
    assert [r[1] for r in ls.rows] == ["off_by_one"]
