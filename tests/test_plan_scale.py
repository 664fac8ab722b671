"""The planner at 10,000 simulated ranks: ZeRO-3 units, TP 8 x ZeRO, DTensor 2-D. Checks the
plan, not its speed (bench/plan_scale.py measures): every element has exactly one source,
each sampled rank's schedule moves exactly its pieces, every written segment is filled
exactly once, files and offsets are consistent."""

from __future__ import annotations

import math

import numpy as np
import pytest

from unickpt.layout import Layout, partition_flat
from unickpt.plan import extents_of, make_plan

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
            for i, lay, _, _ in partition_flat([s for _, s, _ in unit], WORLD, rank):
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
            sizes = [math.prod(b[1]) for b in boxes]
            groups = WORLD // TP
            part = -(-sum(sizes) // groups)
            lo, hi, t0 = dp * part, (dp + 1) * part, 0
            for (name, shape, _), (offs, bsz, rep), n in zip(unit, boxes, sizes):
                s, e = max(lo, t0), min(hi, t0 + n)
                if e > s:
                    out.append((name, Layout(shape, offs, bsz, (s - t0, e - t0), rep)))
                t0 += n
    else:  # dtensor2d: (WORLD/8, 8) mesh, (Shard(0), Shard(1)); 1-D: (Shard(0), Replicate())
        mesh, coord = (WORLD // TP, TP), divmod(rank, TP)
        for name, shape, _ in tensors:
            offs, sizes, replica = [0] * len(shape), list(shape), 0
            for m in range(2):
                if m < len(shape):
                    offs[m], sizes[m] = _chunk(shape[m], mesh[m], coord[m])
                else:
                    replica = replica * mesh[m] + coord[m]
            out.append((name, Layout(shape, tuple(offs), tuple(sizes), None, replica)))
    return out


def _summaries(kind):
    return [
        {"node": f"n{r // 8}", "t": [["model", n, "BF16", list(lay.shape), *lay.to_json(), None]
                                      for n, lay in _layouts(kind, r)]}
        for r in range(WORLD)
    ]


def _tiles(starts, lengths, total) -> bool:
    order = np.argsort(starts, kind="stable")
    s, n = np.asarray(starts)[order], np.asarray(lengths)[order]
    return int(n.sum()) == total and (len(s) == 0 or (s[0] == 0 and np.array_equal(s[1:], (s + n)[:-1])))


@pytest.fixture(scope="module", params=["zero3", "tp8-zero", "dtensor2d"])
def plan(request):
    return make_plan(_summaries(request.param), bucket_bytes=64 << 10)


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
