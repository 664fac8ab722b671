"""Byte-level copies of run lists between flat uint8 tensors.

Runs from a box are regular: equal lengths at a constant stride, except possibly a clipped
first and last run. Regular stretches are copied with one strided ``copy_`` (releases the
GIL, no Python loop per row); anything else falls back to a loop.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["Windows", "copy_runs", "copy_window", "as_bytes"]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Flat uint8 view of a contiguous tensor (any dtype, 0-d included)."""
    if not t.is_contiguous():
        raise ValueError("tensor must be contiguous")
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.uint8:
        return flat
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return flat.view(torch.uint8)


def _regular(offs: np.ndarray) -> int | None:
    if len(offs) < 2:
        return 0
    d = np.diff(offs)
    return int(d[0]) if np.all(d == d[0]) else None


def _copy_rows(src: torch.Tensor, s_off: int, s_stride: int, dst: torch.Tensor, d_off: int, d_stride: int,
               rows: int, k: int) -> None:
    """``rows`` runs of ``k`` bytes at constant strides, in one strided copy (no Python loop)."""
    s = src.as_strided((rows, k), (s_stride, 1), src.storage_offset() + s_off)
    dst.as_strided((rows, k), (d_stride, 1), dst.storage_offset() + d_off).copy_(s)


def copy_runs(src: torch.Tensor, src_offs, dst: torch.Tensor, dst_offs, lens, isz: int) -> None:
    """``dst[dst_offs[i]:+lens[i]] = src[src_offs[i]:+lens[i]]`` for every run, in elements of
    ``isz`` bytes, on flat uint8 tensors."""
    so = np.asarray(src_offs, dtype=np.int64) * isz
    do = np.asarray(dst_offs, dtype=np.int64) * isz
    ln = np.asarray(lens, dtype=np.int64) * isz
    n = len(ln)
    if n == 0:
        return
    if n <= 4:
        for a, b, k in zip(so.tolist(), do.tolist(), ln.tolist()):
            dst[b : b + k].copy_(src[a : a + k])
        return
    lo, hi = 0, n
    # peel clipped first/last runs so the middle is regular
    if ln[0] != ln[n // 2]:
        a, b, k = int(so[0]), int(do[0]), int(ln[0])
        dst[b : b + k].copy_(src[a : a + k])
        lo = 1
    if ln[-1] != ln[n // 2] and hi - 1 >= lo:
        a, b, k = int(so[-1]), int(do[-1]), int(ln[-1])
        dst[b : b + k].copy_(src[a : a + k])
        hi = n - 1
    mid = slice(lo, hi)
    k = int(ln[n // 2])
    s_stride, d_stride = _regular(so[mid]), _regular(do[mid])
    if hi > lo and np.all(ln[mid] == k) and s_stride is not None and d_stride is not None and s_stride >= 0 and d_stride >= 0:
        _copy_rows(src, int(so[lo]), s_stride, dst, int(do[lo]), d_stride, hi - lo, k)
        return
    for a, b, kk in zip(so[mid].tolist(), do[mid].tolist(), ln[mid].tolist()):
        dst[b : b + kk].copy_(src[a : a + kk])


class Windows:
    """Runs ``[starts[i], starts[i] + lengths[i])`` of a stored tensor (sorted, disjoint;
    element ``starts[i]`` goes to element ``local[i]`` of the target), prepared once for
    many :func:`copy_window` calls: the ends and local offsets are computed here, and where
    every run but the first and the last has one length at constant steps (row and column
    blocks, ZeRO ranges of them: the common case) a window is placed by arithmetic instead
    of searches and checks over its runs (5-16% of the user CPU time of a warm resharded
    load of 512-wide matrices, docs/performance.md)."""

    __slots__ = ("starts", "ends", "local", "mid")

    def __init__(self, starts: np.ndarray, lengths: np.ndarray, local: np.ndarray) -> None:
        self.starts = np.asarray(starts, dtype=np.int64)
        self.ends = self.starts + np.asarray(lengths, dtype=np.int64)
        self.local = np.asarray(local, dtype=np.int64)
        # (first start, step, length, first local, local step) of runs 1 .. n-2, or None
        self.mid: tuple[int, int, int, int, int] | None = None
        n = len(self.starts)
        if n >= 4:
            s, ln, lc = self.starts[1:-1], (self.ends - self.starts)[1:-1], self.local[1:-1]
            step, lstep = int(s[1] - s[0]), int(lc[1] - lc[0])
            k = int(ln[0])
            if (k > 0 and step >= k and lstep >= k and np.all(ln == k) and np.all(np.diff(s) == step)
                    and np.all(np.diff(lc) == lstep)):
                self.mid = (int(s[0]), step, k, int(lc[0]), lstep)


def _one(buf: torch.Tensor, lo: int, hi: int, start: int, end: int, local: int, dst: torch.Tensor, isz: int) -> None:
    """The part of run ``[start, end)`` (to ``local``) inside the window ``[lo, hi)``."""
    a, z = max(start, lo), min(end, hi)
    if z > a:
        dst[(local + a - start) * isz : (local + z - start) * isz].copy_(buf[(a - lo) * isz : (z - lo) * isz])


def copy_window(buf: torch.Tensor, lo: int, hi: int, runs: Windows, dst: torch.Tensor, isz: int) -> None:
    """Scatter a window of a stored tensor: ``buf`` holds its elements ``[lo, hi)``; copy into
    ``dst`` the parts of ``runs`` that fall inside the window. Elements of ``isz`` bytes."""
    starts, ends, local = runs.starts, runs.ends, runs.local
    if runs.mid is None:
        a_i, b_i = int(np.searchsorted(ends, lo, side="right")), int(np.searchsorted(starts, hi, side="left"))
        if b_i > a_i:
            a = np.maximum(starts[a_i:b_i], lo)
            z = np.minimum(ends[a_i:b_i], hi)
            copy_runs(buf, a - lo, dst, local[a_i:b_i] + (a - starts[a_i:b_i]), z - a, isz)
        return
    n = len(starts)
    for i in (0, n - 1):  # the first and last runs may be clipped: as they are
        if starts[i] < hi and ends[i] > lo:
            _one(buf, lo, hi, int(starts[i]), int(ends[i]), int(local[i]), dst, isz)
    s0, step, k, l0, lstep = runs.mid
    # middle run j (0-based) spans [s0 + j step, + k): those that meet the window
    ja = max(0, (lo - s0 - k) // step + 1)
    jb = min(n - 2, max(0, -((s0 - hi) // step)))
    if jb <= ja:
        return
    if s0 + ja * step < lo:  # clipped by the window's start
        _one(buf, lo, hi, s0 + ja * step, s0 + ja * step + k, l0 + ja * lstep, dst, isz)
        ja += 1
    if jb > ja and s0 + (jb - 1) * step + k > hi:  # clipped by its end
        _one(buf, lo, hi, s0 + (jb - 1) * step, s0 + (jb - 1) * step + k, l0 + (jb - 1) * lstep, dst, isz)
        jb -= 1
    if jb <= ja:
        return
    _copy_rows(buf, (s0 + ja * step - lo) * isz, step * isz, dst, (l0 + ja * lstep) * isz, lstep * isz, jb - ja, k * isz)
