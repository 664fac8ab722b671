"""Byte-level copies of run lists between flat uint8 tensors.

Runs from a box are regular: equal lengths at a constant stride, except possibly a clipped
first and last run. Regular stretches are copied with one strided ``copy_`` (releases the
GIL, no Python loop per row); anything else falls back to a loop.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["copy_runs", "copy_window", "as_bytes"]


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
        rows = hi - lo
        s = src.as_strided((rows, k), (s_stride, 1), src.storage_offset() + int(so[lo]))
        d = dst.as_strided((rows, k), (d_stride, 1), dst.storage_offset() + int(do[lo]))
        d.copy_(s)
        return
    for a, b, kk in zip(so[mid].tolist(), do[mid].tolist(), ln[mid].tolist()):
        dst[b : b + kk].copy_(src[a : a + kk])


def copy_window(buf: torch.Tensor, lo: int, hi: int, starts: np.ndarray, ends: np.ndarray, local: np.ndarray,
                dst: torch.Tensor, isz: int) -> None:
    """Scatter a window of a stored tensor: ``buf`` holds its elements ``[lo, hi)``; copy into
    ``dst`` the parts of the runs ``[starts[i], ends[i])`` (sorted, disjoint; element ``starts[i]``
    goes to ``dst`` element ``local[i]``) that fall inside the window. Elements of ``isz`` bytes."""
    a_i, b_i = int(np.searchsorted(ends, lo, side="right")), int(np.searchsorted(starts, hi, side="left"))
    if b_i > a_i:
        a = np.maximum(starts[a_i:b_i], lo)
        z = np.minimum(ends[a_i:b_i], hi)
        copy_runs(buf, a - lo, dst, local[a_i:b_i] + (a - starts[a_i:b_i]), z - a, isz)
