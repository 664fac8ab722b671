"""The read path's pieces (issue #39): each checksummed range a target touches is read once,
hashed and placed in one pass; pieces straight into the target lie inside one run; every
byte returned is verified whatever the piece size, layout or verification mode."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import unickpt
from unickpt.errors import ChecksumError
from unickpt.format import CHECK_BLOCK
from unickpt.layout import Layout
from unickpt.loading import session
from unickpt.loading.session import plan_pieces

ROWS, COLS = 1536, 1024  # fp32: 6 MiB, six checksum blocks of 1 MiB (256 rows each)


class _Stored:
    """The parts of a TensorEntry that plan_pieces reads."""

    def __init__(self, nbytes: int, block: int) -> None:
        self.begin, self.end = 0, nbytes
        self.checksums = tuple((b, min(b + block, nbytes), f"{b:016x}") for b in range(0, nbytes, block))


def _layouts(rng: np.random.Generator, n: int, m: int):
    for _ in range(40):
        kind = rng.integers(3)
        if kind == 0:  # a box
            r0, c0 = int(rng.integers(n)), int(rng.integers(m))
            yield Layout((n, m), (r0, c0), (int(rng.integers(1, n - r0 + 1)), int(rng.integers(1, m - c0 + 1))))
        elif kind == 1:  # a flat range
            a = int(rng.integers(n * m))
            yield Layout((n, m), (0, 0), (n, m), (a, int(rng.integers(a + 1, n * m + 1))))
        else:  # a flat range of a column block (TP x ZeRO)
            c0 = int(rng.integers(m))
            w = int(rng.integers(1, m - c0 + 1))
            a = int(rng.integers(n * w))
            yield Layout((n, m), (0, c0), (n, w), (a, int(rng.integers(a + 1, n * w + 1))))


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("size", [4096, 3 * 4096, 1 << 20])
def test_pieces_read_each_touched_range_once_and_direct_pieces_stay_in_one_run(verify, size):
    rng = np.random.default_rng(size + verify)
    n, m, isz, block = 96, 40, 4, 4096  # 15 KiB: ranges of 4 KiB (the last one shorter)
    st = _Stored(n * m * isz, block)
    for lay in _layouts(rng, n, m):
        runs = lay.runs()
        pieces = plan_pieces(st, runs, isz, verify, size)
        rb, re_ = runs.starts * isz, (runs.starts + runs.lengths) * isz
        need = np.zeros(n * m * isz, dtype=bool)
        for b, e in zip(rb.tolist(), re_.tolist()):
            need[b:e] = True
        covered = np.zeros(n * m * isz, dtype=np.int64)
        seen = []
        for b, e, ranges, at in pieces:
            covered[b:e] += 1
            if verify:
                assert ranges and ranges[0][0] <= b + isz and ranges[-1][1] >= e - isz
                assert len(ranges) == 1 or e - b <= size + 2 * isz  # full, or one range of its own
                seen += [r[0] for r in ranges]
            if at >= 0:  # inside one run, at the right place in the target
                i = int(np.searchsorted(rb, b, side="right")) - 1
                assert rb[i] <= b and e <= re_[i]
                assert at == int(runs.local[i]) * isz + b - int(rb[i])
        assert (covered[need] >= 1).all(), "every needed byte is read"
        assert covered.max() <= 1, "no byte is read twice"
        if verify:
            touched = {c[0] for c in st.checksums if need[c[0]:c[1]].any()}
            assert sorted(seen) == sorted(touched) and len(seen) == len(set(seen))


def _state():
    g = torch.Generator().manual_seed(3)
    return {"model": {"w": torch.randn(ROWS, COLS, generator=g)}}


@pytest.fixture
def ck(tmp_path):
    p = tmp_path / "ck"
    unickpt.save(_state(), p)
    return p


def _targets():
    full = _state()["model"]["w"]
    yield "rows across blocks", unickpt.shard(torch.zeros(700, COLS), (ROWS, COLS), offsets=(100, 0)), full[100:800]
    yield "columns", unickpt.shard(torch.zeros(ROWS, 300), (ROWS, COLS), offsets=(0, 500)), full[:, 500:800]
    flat = full.reshape(-1)[123_457:1_234_567]
    yield "flat", unickpt.ShardedTensor(torch.zeros(flat.numel()), Layout((ROWS, COLS), (0, 0), (ROWS, COLS),
                                                                          (123_457, 1_234_567))), flat
    yield "whole", torch.zeros(ROWS, COLS), full
    yield "non-contiguous", torch.zeros(COLS, ROWS).t(), full


@pytest.mark.parametrize("piece", [256 << 10, 2 << 20, 4 << 20, 65537])  # (65537: rounded to whole elements)
@pytest.mark.parametrize("verify", ["auto", "none"])
def test_every_layout_loads_exactly_with_any_piece_size(ck, monkeypatch, piece, verify):
    monkeypatch.setattr(session, "PIECE", piece)  # 256 KiB: each 1 MiB range streamed through 4 reads
    monkeypatch.setattr(session, "LONG_PIECE", piece)  # (files not in memory)
    for what, t, want in _targets():
        res = unickpt.load({"model": {"w": t}}, ck, group="local", options=unickpt.LoadOptions(verify=verify))
        got = t.local if isinstance(t, unickpt.ShardedTensor) else t
        assert torch.equal(got.reshape(want.shape), want), what
        assert res.bytes_read <= ROWS * COLS * 4 + 8 * CHECK_BLOCK, what
        if verify == "auto":
            assert res.verified >= 1


@pytest.mark.parametrize("piece", [256 << 10, 4 << 20])
def test_a_flip_outside_the_run_but_inside_a_touched_range_fails_the_load(ck, monkeypatch, piece):
    monkeypatch.setattr(session, "PIECE", piece)
    monkeypatch.setattr(session, "LONG_PIECE", piece)
    _, man = unickpt.read_manifest(ck)
    st = man.tensors[("model", "w")]
    with open(ck / st.file, "r+b") as f:  # row 90 (block 0): before the rows 100.. the target reads
        off = man.files[st.file].data_start + st.begin + 90 * COLS * 4 + 7
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 1]))
    t = unickpt.shard(torch.zeros(700, COLS), (ROWS, COLS), offsets=(100, 0))
    with pytest.raises(ChecksumError, match="'w'"):
        unickpt.load({"model": {"w": t}}, ck, group="local")
    far = unickpt.shard(torch.zeros(256, COLS), (ROWS, COLS), offsets=(1024, 0))  # block 4 only: intact
    unickpt.load({"model": {"w": far}}, ck, group="local")
    assert torch.equal(far.local, _state()["model"]["w"][1024:1280])


def test_threads_follow_where_the_bytes_are(ck):
    from unickpt.io.files import Files
    from unickpt.io.storage import storage_for
    from unickpt.state import flatten

    storage, p = storage_for(ck)
    ckpt, man = unickpt.read_manifest(ck)
    entries, _ = flatten({"model": {"w": torch.zeros(ROWS, COLS)}})
    files = Files(storage, ckpt, man)
    try:
        unickpt.load({"model": {"w": torch.zeros(ROWS, COLS)}}, ck, group="local")  # now in the page cache
        warm = session._threads(files, man, entries, 1)
        assert 1 <= warm <= session.READ_THREADS
        reader = files.get(man.tensors[("model", "w")].file)
        reader.resident = lambda offset, n: None  # a reader that cannot tell (an object store)
        assert session._threads(files, man, entries, 1) == 0  # READ_THREADS threads, LONG_PIECE reads
    finally:
        files.close()


def _load_own_tensor(rank, world, ck, names):
    import unickpt

    t = torch.zeros(1 << 21)
    try:
        unickpt.load({"model": {names[rank]: t}}, ck, options=unickpt.LoadOptions(timeout_s=30))
    except Exception as e:
        return type(e).__name__, str(e)
    return None


def test_a_missing_file_that_only_one_rank_needs_fails_every_rank(tmp_path):
    from tests import dist

    ck = tmp_path / "ck"
    g = torch.Generator().manual_seed(1)
    unickpt.save({"model": {n: torch.randn(1 << 21, generator=g) for n in ("a", "b")}}, ck,
                 options=unickpt.SaveOptions(max_file_bytes=10 << 20))
    _, man = unickpt.read_manifest(ck)
    fa, fb = man.tensors[("model", "a")].file, man.tensors[("model", "b")].file
    assert fa != fb, "the two tensors should be in two files"
    os.remove(ck / fb)  # only rank 1 needs it
    out = dist.run(_load_own_tensor, 2, str(ck), ["a", "b"], timeout=120)
    assert all(o is not None for o in out), out  # rank 0 does not go on alone (nor wait forever)
    assert out[1][0] == "CheckpointNotFoundError" and fb in out[1][1], out
    # rank 0 learns why (not "the ranks reached different collective calls")
    assert out[0][0] == "DistributedError" and "failed on rank 1" in out[0][1] and fb in out[0][1], out


def test_one_memory_under_two_roles_is_read_once_or_refused(tmp_path):
    from unickpt.errors import StateDictError

    g = torch.Generator().manual_seed(2)
    x = torch.randn(1000, 1000, generator=g)  # 4 MB: several pieces, which would race in one memory
    unickpt.save({"model": {"w": x}, "master": {"w": x.clone()}}, tmp_path / "same")
    unickpt.save({"model": {"w": x}, "master": {"w": x + 1}}, tmp_path / "apart")
    y = torch.zeros(1000, 1000)
    res = unickpt.load({"model": {"w": y}, "master": {"w": y}}, tmp_path / "same", group="local")
    assert torch.equal(y, x) and res.bytes_read <= x.numel() * 4 + 4096  # same checksums: read once
    for _ in range(5):  # never a mix of the two stored tensors
        y.zero_()
        with pytest.raises(StateDictError, match="same memory"):
            unickpt.load({"model": {"w": y}, "master": {"w": y}}, tmp_path / "apart", group="local")
