"""Checksums on the read side: a stream of checksummed ranges fed as bytes arrive
(:class:`StreamCheck`: ranges larger than one read of the load's pieces, coded tensors),
whole stored tensors (:func:`check_stored`) and the share of ``verify="full"``
(:func:`verify_share`)."""

from __future__ import annotations

import json

import numpy as np
import torch

from ..format import Hasher
from ..io.files import Files
from ..io.storage import RandomReader
from ..manifest import Manifest, TensorEntry
from ..transport import Comm


WINDOW = 16 << 20  # scratch of check_stored (verify="full", the CLI's verify)


class StreamCheck:
    """Verifies the checksummed ranges of one stored region from reads arriving in ascending
    order (reads may overlap or leave gaps). Readers first :meth:`touch` the bytes they will
    return, which widens them to whole checksummed ranges; :attr:`ok` is true only when every
    touched range was fed whole and matched."""

    def __init__(self, checksums) -> None:
        self.ranges = list(checksums)
        self.begins = np.array([c[0] for c in self.ranges], dtype=np.int64)
        self.ends = np.array([c[1] for c in self.ranges], dtype=np.int64)
        self.touched = np.zeros(len(self.ranges), dtype=bool)
        self.done = np.zeros(len(self.ranges), dtype=bool)
        self.i = 0
        self.pos = -1  # bytes before pos have been fed to the current range
        self.h: Hasher | None = None
        self.checked = 0
        self.matched = True
        self.mismatched: list[tuple[int, int]] = []  # (begin, end) of the ranges that did not match

    def touch(self, b: int, e: int) -> tuple[int, int]:
        """Mark the ranges that bytes ``[b, e)`` fall in; return the span they cover."""
        bs, es = self.touch_runs(np.array([b], dtype=np.int64), np.array([e], dtype=np.int64))
        return int(bs[0]), int(es[0])

    def touch_runs(self, b: np.ndarray, e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`touch` for sorted, disjoint byte runs ``[b[i], e[i])`` at once (vectorized)."""
        if not len(self.ranges) or not len(b):
            return b, e
        i0 = np.maximum(np.searchsorted(self.begins, b, side="right") - 1, 0)
        i1 = np.maximum(np.searchsorted(self.begins, np.maximum(e - 1, b), side="right") - 1, i0)
        live = e > b
        marks = np.zeros(len(self.ranges) + 1, dtype=np.int64)
        np.add.at(marks, i0[live], 1)
        np.add.at(marks, i1[live] + 1, -1)
        self.touched |= np.cumsum(marks[:-1]) > 0
        return np.where(live, np.minimum(b, self.begins[i0]), b), np.where(live, np.maximum(e, self.ends[i1]), e)

    @property
    def ok(self) -> bool:
        return self.matched and not bool((self.touched & ~self.done).any())

    def feed(self, b: int, data: torch.Tensor) -> None:
        e = b + data.numel()
        if b > self.pos:  # gap (or start): only ranges beginning at or after b can complete
            self.h = None
            self.pos = b
            self.i = max(int(np.searchsorted(self.ends, b, side="right")), 0) if len(self.ranges) else 0
        while self.i < len(self.ranges) and self.pos < e:
            rb, re_, hx = self.ranges[self.i]
            if self.pos >= re_:
                self.i += 1
                self.h = None
                continue
            if self.pos < rb:
                self.pos = min(rb, e)
                continue
            if self.pos == rb and self.h is None:
                self.h = Hasher()
            stop = min(e, re_)
            if self.h is not None:
                self.h.update(memoryview(data[self.pos - b : stop - b].numpy()))
            self.pos = stop
            if stop == re_:
                if self.h is not None:
                    self.checked += 1
                    self.done[self.i] = True
                    if self.h.hexdigest() != hx:
                        self.matched = False
                        self.mismatched.append((rb, re_))
                self.h = None
                self.i += 1


def feed_file(reader, base: int, b: int, e: int, check: StreamCheck, scratch: torch.Tensor) -> None:
    """Feed bytes ``[b, e)`` of a region (at ``base`` in the file) to ``check`` through ``scratch``."""
    cap = scratch.numel()
    while b < e:
        k = min(cap, e - b)
        buf = scratch[:k]
        reader.readinto(base + b, memoryview(buf.numpy()))
        check.feed(b, buf)
        b += k


def check_stored(reader: RandomReader, data_start: int, st: TensorEntry, buf: torch.Tensor) -> list[tuple[str, int, int]]:
    """Read every checksummed range of ``st`` (each part of a coded tensor) through ``buf``
    (:class:`StreamCheck`, as every read of a load is checked); return ``(part, begin, end)``
    of the ranges that differ."""
    bad = []
    for part, _, _, _, begin, end, checksums in st.stored():
        check = StreamCheck(checksums)
        check.touch(0, end - begin)
        feed_file(reader, data_start + begin, 0, end - begin, check, buf)
        bad += [(part, b, e) for b, e in check.mismatched]
    return bad


def verify_share(man: Manifest, storage, ckpt, comm: Comm, already: set, sees: set | None = None) -> tuple[int, int, list]:
    """verify="full": tensors are dealt to ranks (that see their file) by size; each checks its
    share whole."""
    loads = [0] * comm.world
    mine: list[TensorEntry] = []
    if sees is None:  # shared storage: every rank sees every file
        sees_all = [set(man.files)] * comm.world
    else:  # node-local: every rank takes part, whatever it sees
        sees_all = [set(json.loads(b)) for b in comm.all_gather_bytes(json.dumps(sorted(sees)).encode(), "load (the files each node sees)")]
    for t in sorted(man.tensors.values(), key=lambda t: (-t.nbytes, t.role, t.name)):
        if not t.coder.stores:
            continue
        cands = [k for k in range(comm.world) if t.file in sees_all[k]] or list(range(comm.world))
        r = min(cands, key=lambda k: (loads[k], k))
        loads[r] += t.nbytes
        if r == comm.rank and t.key not in already:
            mine.append(t)
    files = Files(storage, ckpt, man)
    buf = torch.empty(WINDOW, dtype=torch.uint8)
    bad, n = [], 0
    try:
        for t in sorted(mine, key=lambda t: (t.file, t.begin)):
            reader = files.get(t.file)
            if check_stored(reader, man.files[t.file].data_start, t, buf):
                bad.append((t.file, t.name))
            n += t.nbytes
    finally:
        files.close()
    return files.bytes_read, len(mine), bad

