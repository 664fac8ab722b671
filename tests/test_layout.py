"""Layout model: runs of boxes and flat ranges, intersections, ZeRO partitions, DTensor."""

import math

import numpy as np
import pytest
import torch

from unickpt.errors import LayoutError
from unickpt.layout import Layout, Runs, intersect, partition_flat, shard


def _elements(lay: Layout) -> list[int]:
    """Reference: global flat indices of a layout's elements in local order (brute force)."""
    idx = torch.arange(math.prod(lay.shape)).reshape(lay.shape)
    box = idx[tuple(slice(o, o + s) for o, s in zip(lay.offsets, lay.sizes))].reshape(-1)
    if lay.flat is not None:
        box = box[lay.flat[0] : lay.flat[1]]
    return box.tolist()


def _expand(r: Runs) -> list[int]:
    return [int(s) + i for s, n in zip(r.starts, r.lengths) for i in range(int(n))]


CASES = [
    Layout((4, 6), (1, 2), (2, 3)),
    Layout((4, 6), (0, 0), (4, 6)),
    Layout((4, 6), (2, 0), (2, 6)),
    Layout((4, 6), (0, 0), (4, 6), (5, 17)),
    Layout((4, 6), (0, 3), (4, 3), (2, 11)),
    Layout((3, 4, 5), (1, 1, 0), (2, 2, 5), (3, 17)),
    Layout((3, 4, 5), (0, 1, 2), (3, 3, 2)),
    Layout((7,), (2,), (4,), (1, 3)),
    Layout((), (), ()),
    Layout((0, 3), (0, 0), (0, 3)),
]


@pytest.mark.parametrize("lay", CASES, ids=str)
def test_runs_match_brute_force(lay):
    r = lay.runs()
    assert _expand(r) == _elements(lay)
    assert r.numel == lay.numel
    assert list(r.local) == list(np.concatenate([[0], np.cumsum(r.lengths)[:-1]])) if len(r) else True


def test_random_boxes_and_ranges_match_brute_force():
    g = np.random.default_rng(0)
    for _ in range(300):
        nd = int(g.integers(1, 4))
        shape = tuple(int(x) for x in g.integers(1, 7, nd))
        offs = tuple(int(g.integers(0, s)) for s in shape)
        sizes = tuple(int(g.integers(1, s - o + 1)) for s, o in zip(shape, offs))
        n = math.prod(sizes)
        a = int(g.integers(0, n))
        flat = (a, int(g.integers(a, n + 1))) if g.random() < 0.5 else None
        lay = Layout(shape, offs, sizes, flat)
        assert _expand(lay.runs()) == _elements(lay), lay


def test_intersect_matches_set_intersection():
    g = np.random.default_rng(1)
    for _ in range(200):
        shape = (int(g.integers(2, 9)), int(g.integers(2, 9)))
        lays = []
        for _ in range(2):
            offs = tuple(int(g.integers(0, s)) for s in shape)
            sizes = tuple(int(g.integers(1, s - o + 1)) for s, o in zip(shape, offs))
            n = math.prod(sizes)
            a = int(g.integers(0, n))
            lays.append(Layout(shape, offs, sizes, (a, int(g.integers(a, n + 1)))))
        ea, eb = _elements(lays[0]), _elements(lays[1])
        start, length, off_a, off_b = intersect(lays[0].runs(), lays[1].runs())
        got = []
        for s, n, oa, ob in zip(start, length, off_a, off_b):
            for i in range(int(n)):
                assert ea[int(oa) + i] == int(s) + i and eb[int(ob) + i] == int(s) + i
                got.append(int(s) + i)
        assert sorted(got) == sorted(set(ea) & set(eb))


def test_partition_flat_covers_each_tensor_once():
    shapes = [(3, 5), (7,), (), (2, 2, 3)]
    world = 4
    covered = {i: [] for i in range(len(shapes))}
    for rank in range(world):
        parts = partition_flat(shapes, world, rank)
        for i, lay, a, b in parts:
            assert b - a == lay.numel
            covered[i] += _elements(lay)
    for i, s in enumerate(shapes):
        assert sorted(covered[i]) == list(range(math.prod(s)))


def test_bad_layouts_are_refused_with_a_reason():
    with pytest.raises(LayoutError, match="out of bounds"):
        Layout((4, 4), (3, 0), (2, 4))
    with pytest.raises(LayoutError, match="flat range"):
        Layout((4, 4), (0, 0), (4, 4), (3, 17))
    with pytest.raises(LayoutError, match="rank mismatch"):
        Layout((4, 4), (0,), (4, 4))
    with pytest.raises(LayoutError, match="elements"):
        shard(torch.zeros(5), (4, 4), flat=(0, 6))
    with pytest.raises(LayoutError, match="needs a torch.Tensor, got ndarray"):  # was AttributeError
        shard(np.zeros((2, 4), np.float32), (4, 4), offsets=(2, 0))


def test_windowed_copies_match_brute_force():
    """copy_window puts every element of the runs that a window holds where the runs say,
    and nothing else: for layouts whose middle runs are regular (placed by arithmetic) and
    for others (searched), against an element-by-element reference, over random windows."""
    from unickpt._copy import Windows, copy_window

    rng = np.random.default_rng(7)
    layouts = [Layout((40, 12), (0, 4), (40, 5)),  # column block: every run alike
               Layout((40, 12), (0, 4), (40, 5), (3, 187)),  # ZeRO range of it: clipped ends
               Layout((9, 8, 6), (1, 2, 1), (7, 5, 4)),  # 3-D box: steps change at plane ends
               Layout((30, 7), (3, 0), (20, 7), (5, 100)),  # flat range of rows: one run
               Layout((40, 12), (0, 0), (40, 1))]  # runs of one element
    regular = 0
    for lay in layouts:
        runs = lay.runs()
        win = Windows(runs.starts, runs.lengths, runs.local)
        regular += win.mid is not None
        elems = _expand(runs)
        total = math.prod(lay.shape)
        for isz in (1, 4):
            for _ in range(60):  # windows of every size, inside runs and across them
                lo = int(rng.integers(0, total))
                hi = int(rng.integers(lo, total + 1))
                src = torch.randint(0, 255, (total * isz,), dtype=torch.uint8)  # 255: never copied
                buf = src[lo * isz : hi * isz].clone()
                dst = torch.full((len(elems) * isz,), 255, dtype=torch.uint8)
                copy_window(buf, lo, hi, win, dst, isz)
                want = torch.full_like(dst, 255)
                for i, g in enumerate(elems):
                    if lo <= g < hi:
                        want[i * isz : (i + 1) * isz] = src[g * isz : (g + 1) * isz]
                assert torch.equal(dst, want), (lay, isz, lo, hi)
    assert regular == 3, regular  # both paths were taken


def test_partition_flat_gives_empty_tensors_to_one_rank(tmp_path):
    """A 0-element tensor in a ZeRO buffer has no element to cut: one rank (the one whose range
    is at its place) holds it as an empty piece, so a save stores it and a strict load of
    another layout finds it (found by an attacker's review: it was left out)."""
    import unickpt

    shapes, names = [(4, 3), (0, 5), (2,)], ["a", "empty", "b"]
    for world in (1, 2, 3, 7):
        held = [[i for i, *_ in partition_flat(shapes, world, r, names=names)] for r in range(world)]
        assert sum(h.count(1) for h in held) == 1, held
    buf = torch.arange(14, dtype=torch.float32)
    sd = {"model": {names[i]: unickpt.shard(buf[s:e], shapes[i], flat=(lay.flat[0], lay.flat[1]))
                    for i, lay, s, e in partition_flat(shapes, 1, 0, names=names)}}
    unickpt.save(sd, tmp_path / "c")
    t = {"model": {"a": torch.zeros(4, 3), "empty": torch.zeros(0, 5), "b": torch.zeros(2)}}
    unickpt.load(t, tmp_path / "c")
    assert torch.equal(t["model"]["a"], buf[:12].view(4, 3)) and torch.equal(t["model"]["b"], buf[12:])
