"""Where a local tensor sits inside its full (global) tensor. Pure code: no communication.

A :class:`Layout` is an N-D *box* of the full tensor (``offsets``, ``sizes``: tensor
parallelism cuts row or column blocks), optionally refined by a flat ``[start, stop)`` range
over the box's row-major flattening (ZeRO partitions of a flattened buffer cut ranges that
start mid-row), plus a ``replica`` index: among ranks holding the same elements, only
replica 0 is a source when saving; every replica is filled when loading.

Everything else works on *runs*: the contiguous pieces of the full tensor's row-major
flattening that a layout covers, in local order. Runs are numpy ``int64`` arrays, so a
column block of a 128k-row embedding is a few vector operations, not a Python loop.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from .errors import LayoutError, NotSupportedError

__all__ = ["Layout", "ShardedTensor", "shard", "partition_flat", "FlatUnit", "layout_of", "Runs", "intersect"]


@dataclass(frozen=True, slots=True)
class Layout:
    """How one rank's local tensor maps into the full tensor of shape ``shape``."""

    shape: tuple[int, ...]
    """Global (full) shape."""
    offsets: tuple[int, ...]
    """Start of the box in each dimension."""
    sizes: tuple[int, ...]
    """Extent of the box in each dimension."""
    flat: tuple[int, int] | None = None
    """Optional ``[start, stop)`` over the box's row-major flattening (ZeRO partitions)."""
    replica: int = 0
    """0 for the copy that is saved; >0 for further copies that are only loaded into."""
    hint: Any = field(default=None, compare=False, hash=False, repr=False)
    """Which rule made this layout (:func:`partition_flat` with ``names``, a DTensor), so
    the save planner can describe a rank's pieces by rule instead of one by one. Not part of
    equality; the planner checks a hinted layout equals its rule's piece before using it."""

    def __post_init__(self) -> None:
        if not (len(self.shape) == len(self.offsets) == len(self.sizes)):
            raise LayoutError(
                f"layout rank mismatch: shape {self.shape}, offsets {self.offsets}, sizes {self.sizes}"
            )
        for d, (n, o, s) in enumerate(zip(self.shape, self.offsets, self.sizes)):
            if n < 0 or o < 0 or s < 0 or o + s > n:
                raise LayoutError(
                    f"box out of bounds in dim {d}: offset {o} + size {s} exceeds {n} (shape {self.shape})"
                )
        if self.flat is not None:
            start, stop = self.flat
            if not (0 <= start <= stop <= math.prod(self.sizes)):
                raise LayoutError(
                    f"flat range [{start}, {stop}) outside the box of {math.prod(self.sizes)} elements"
                )
        if self.replica < 0:
            raise LayoutError(f"replica index must be >= 0, got {self.replica}")

    @staticmethod
    def full(shape: Sequence[int], replica: int = 0) -> "Layout":
        shape = tuple(int(s) for s in shape)
        return Layout(shape, (0,) * len(shape), shape, None, replica)

    @property
    def numel(self) -> int:
        """Number of elements held locally."""
        if self.flat is not None:
            return self.flat[1] - self.flat[0]
        return math.prod(self.sizes)

    @property
    def is_full(self) -> bool:
        """True when the local tensor is the whole tensor."""
        return self.numel == math.prod(self.shape)

    def runs(self) -> "Runs":
        return _box_runs(self.shape, self.offsets, self.sizes, self.flat)

    @property
    def n_runs(self) -> int:
        """``len(self.runs())``, computed without building the runs."""
        span = _run_span(self.shape, self.offsets, self.sizes, self.flat)
        return 0 if span is None else span[3] - span[2] + 1

    def single_run(self) -> tuple[int, int] | None:
        """``(start, length)`` when the layout covers one contiguous run of the full tensor's
        flattening (``len(self.runs()) == 1``), else None; no arrays are built."""
        span = _run_span(self.shape, self.offsets, self.sizes, self.flat)
        if span is None or span[2] != span[3]:
            return None
        k, run_len, first, _, base, lo, hi = span
        start = base + lo - first * run_len
        if k > 0:  # one run inside row `first` of the partial dimensions
            coords = np.unravel_index(first, self.sizes[:k])
            start += sum(int(c) * math.prod(self.shape[j + 1:]) for j, c in enumerate(coords))
        return start, hi - lo

    def to_json(self) -> list:
        return [list(self.offsets), list(self.sizes), list(self.flat) if self.flat else None, self.replica]

    @staticmethod
    def from_json(shape: Sequence[int], obj: list) -> "Layout":
        offsets, sizes, flat, replica = obj
        return Layout(tuple(shape), tuple(offsets), tuple(sizes), tuple(flat) if flat else None, int(replica))


@dataclass(frozen=True, slots=True)
class Runs:
    """Contiguous element ranges of a full tensor's flattening, sorted, in local order."""

    starts: np.ndarray
    lengths: np.ndarray

    @property
    def local(self) -> np.ndarray:
        """Offset of each run inside the local (flattened) tensor."""
        out = np.zeros_like(self.lengths)
        if len(out) > 1:
            np.cumsum(self.lengths[:-1], out=out[1:])
        return out

    @property
    def numel(self) -> int:
        return int(self.lengths.sum())

    def __len__(self) -> int:
        return len(self.starts)

    @staticmethod
    def single(start: int, stop: int) -> "Runs":
        if stop <= start:
            return Runs(np.zeros(0, np.int64), np.zeros(0, np.int64))
        return Runs(np.array([start], np.int64), np.array([stop - start], np.int64))


def _run_span(shape, offsets, sizes, flat):
    """``(k, run_len, first, last, base, lo, hi)`` of :func:`_box_runs` (k: last partial
    dimension, -1 when none; runs ``first..last`` of length ``run_len``), None when empty."""
    box_numel = math.prod(sizes)
    lo, hi = flat if flat is not None else (0, box_numel)
    if hi <= lo or box_numel == 0:
        return None
    k = len(shape) - 1
    while k >= 0 and offsets[k] == 0 and sizes[k] == shape[k]:
        k -= 1
    if k < 0:
        return (k, hi - lo, 0, 0, 0, lo, hi)
    stride = math.prod(shape[k + 1:])
    run_len = sizes[k] * stride
    base = sum(offsets[j] * math.prod(shape[j + 1:]) for j in range(k + 1))
    return (k, run_len, lo // run_len, (hi - 1) // run_len, base, lo, hi)


def _box_runs(shape, offsets, sizes, flat) -> Runs:
    empty = Runs(np.zeros(0, np.int64), np.zeros(0, np.int64))
    box_numel = math.prod(sizes)
    lo, hi = flat if flat is not None else (0, box_numel)
    if hi <= lo or box_numel == 0:
        return empty
    nd = len(shape)
    # k: last partial dimension; dims after it are fully covered, so one run spans them.
    k = nd - 1
    while k >= 0 and offsets[k] == 0 and sizes[k] == shape[k]:
        k -= 1
    if k < 0:
        return Runs.single(lo, hi)
    strides = [math.prod(shape[j + 1 :]) for j in range(nd)]
    run_len = sizes[k] * strides[k]
    base = sum(offsets[j] * strides[j] for j in range(k + 1))
    first, last = lo // run_len, (hi - 1) // run_len
    idx = np.arange(first, last + 1, dtype=np.int64)
    starts = np.full(len(idx), base, dtype=np.int64)
    if k > 0:
        coords = np.unravel_index(idx, sizes[:k])
        for j in range(k):
            starts += coords[j].astype(np.int64) * strides[j]
    lengths = np.full(len(idx), run_len, dtype=np.int64)
    head = lo - first * run_len
    starts[0] += head
    lengths[0] -= head
    lengths[-1] -= (last + 1) * run_len - hi
    return Runs(starts, lengths)


def intersect(a: Runs, b: Runs) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Overlaps of two run lists: ``(global_start, length, offset_in_a, offset_in_b)``.

    Offsets are element positions inside each side's local flattening. Vectorised: each run
    of ``a`` is paired with the runs of ``b`` it overlaps via two ``searchsorted`` calls.
    """
    if len(a) == 0 or len(b) == 0:
        z = np.zeros(0, np.int64)
        return z, z, z, z
    a_end = a.starts + a.lengths
    b_end = b.starts + b.lengths
    j_lo = np.searchsorted(b_end, a.starts, side="right")
    j_hi = np.searchsorted(b.starts, a_end, side="left")
    counts = np.maximum(j_hi - j_lo, 0)
    total = int(counts.sum())
    if total == 0:
        z = np.zeros(0, np.int64)
        return z, z, z, z
    ii = np.repeat(np.arange(len(a), dtype=np.int64), counts)
    group_start = np.repeat(np.cumsum(counts) - counts, counts)
    jj = np.repeat(j_lo, counts) + (np.arange(total, dtype=np.int64) - group_start)
    start = np.maximum(a.starts[ii], b.starts[jj])
    end = np.minimum(a_end[ii], b_end[jj])
    keep = end > start
    ii, jj, start, end = ii[keep], jj[keep], start[keep], end[keep]
    off_a = a.local[ii] + (start - a.starts[ii])
    off_b = b.local[jj] + (start - b.starts[jj])
    return start, end - start, off_a, off_b


class ShardedTensor:
    """A local tensor together with its :class:`Layout` in the full tensor.

    Put these in a state dict where a value is one rank's piece of a larger tensor. Build
    them with :func:`shard`.
    """

    __slots__ = ("local", "layout")

    def __init__(self, local: torch.Tensor, layout: Layout) -> None:
        if not isinstance(local, torch.Tensor):
            raise LayoutError(f"ShardedTensor needs a torch.Tensor, got {type(local).__name__}")
        if local.numel() != layout.numel:
            raise LayoutError(
                f"local tensor has {local.numel()} elements but its layout covers {layout.numel} "
                f"(shape {layout.shape}, offsets {layout.offsets}, sizes {layout.sizes}, flat {layout.flat})"
            )
        self.local = local
        self.layout = layout

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    def __repr__(self) -> str:
        return f"ShardedTensor(local={tuple(self.local.shape)}, dtype={self.local.dtype}, layout={self.layout})"


def shard(
    local: torch.Tensor,
    shape: Sequence[int],
    *,
    offsets: Sequence[int] | None = None,
    sizes: Sequence[int] | None = None,
    flat: tuple[int, int] | None = None,
    replica: int = 0,
) -> ShardedTensor:
    """Describe ``local`` as a piece of a full tensor of ``shape``.

    Examples::

        # TP column block: columns [512, 1024) of a (4096, 1024) weight
        shard(w_local, (4096, 1024), offsets=(0, 512))
        # ZeRO partition: elements [1000, 3000) of a (64, 100) tensor, flattened
        shard(buf[0:2000], (64, 100), flat=(1000, 3000))
    """
    if not isinstance(local, torch.Tensor):  # (ShardedTensor says so too, but local.dim() comes first)
        raise LayoutError(f"shard() needs a torch.Tensor, got {type(local).__name__}")
    shape = tuple(int(s) for s in shape)
    nd = len(shape)
    offsets = tuple(int(o) for o in offsets) if offsets is not None else (0,) * nd
    if sizes is None:
        if flat is None and local.dim() == nd:
            sizes = tuple(local.shape)
        else:
            sizes = tuple(n - o for n, o in zip(shape, offsets))
    sizes = tuple(int(s) for s in sizes)
    flat_t = (int(flat[0]), int(flat[1])) if flat is not None else None
    return ShardedTensor(local, Layout(shape, offsets, sizes, flat_t, int(replica)))


def partition_flat(
    shapes: Sequence[Sequence[int]], world: int, rank: int, *, total: int | None = None,
    names: Sequence[str] | None = None, boxes: Sequence[tuple[Sequence[int], Sequence[int], int]] | None = None,
) -> list[tuple[int, Layout, int, int]]:
    """ZeRO-style partition of tensors flattened back to back into one buffer.

    The buffer of ``total`` elements (default: the sum of the tensors, padded up to a
    multiple of ``world``) is cut into ``world`` equal ranges. Returns, for rank ``rank``,
    ``(tensor_index, layout, buf_start, buf_stop)`` for every tensor its range touches, where
    ``[buf_start, buf_stop)`` is the slice of the rank's partition holding that piece.

    ``boxes``: ``(offsets, sizes, replica)`` per tensor when the buffer holds a block of each
    tensor (tensor parallelism, then ZeRO over the blocks); default the whole tensors.
    ``names``: the state-dict names of the tensors, in order. With them, the layouts carry a
    hint naming their unit, and a save describes this rank's pieces of the unit by one rule
    (O(1) per rank in the plan exchange instead of one row per piece).
    """
    if type(world) is not int or type(rank) is not int or world < 1 or not 0 <= rank < world:
        raise LayoutError(f"partition_flat: need an integer world >= 1 and 0 <= rank < world, got world={world!r}, "
                          f"rank={rank!r}")
    if isinstance(shapes, (str, bytes)) or not all(
            isinstance(s, (list, tuple, torch.Size)) and all(type(d) is int and d >= 0 for d in s) for s in shapes):
        raise LayoutError(f"partition_flat: shapes must be a list of shapes (tuples of ints >= 0), got {shapes!r}")
    if boxes is None:
        boxes = [((0,) * len(s), tuple(s), 0) for s in shapes]
    boxes = [(tuple(int(o) for o in b[0]), tuple(int(z) for z in b[1]), int(b[2])) for b in boxes]
    if len(boxes) != len(shapes) or (names is not None and len(names) != len(shapes)):
        raise LayoutError(f"partition_flat: {len(shapes)} shapes, {len(boxes)} boxes, "
                          f"{len(names) if names is not None else '-'} names")
    numels = [math.prod(b[1]) for b in boxes]
    used = sum(numels)
    if total is None:
        total = -(-used // world) * world
    if total < used or total % world:
        raise LayoutError(f"flat buffer of {total} elements cannot hold {used} split over {world} ranks")
    unit = None
    if names is not None:
        unit = FlatUnit(tuple(str(n) for n in names), tuple(tuple(int(d) for d in s) for s in shapes),
                        tuple(boxes), int(total), int(world))
    part = total // world
    lo, hi = rank * part, (rank + 1) * part
    out = []
    t0 = 0
    for i, (shape, n, (offs, sizes, rep)) in enumerate(zip(shapes, numels, boxes)):
        t1 = t0 + n
        s, e = max(lo, t0), min(hi, t1)
        if e > s:
            hint = None if unit is None else (unit, rank, i)
            lay = Layout(tuple(shape), offs, sizes, (s - t0, e - t0), rep, hint)
            out.append((i, lay, s - lo, e - lo))
        elif n == 0 and rank == (min(t0 // part, world - 1) if part else 0):
            # an empty block: held by the rank whose range is at its place (an explicit piece:
            # the unit's rule gives pieces of elements only), so that it is saved and loaded
            out.append((i, Layout(tuple(shape), offs, sizes, (0, 0), rep), t0 - lo, t0 - lo))
        t0 = t1
    return out


@dataclass(frozen=True, slots=True)
class FlatUnit:
    """The rule of a :func:`partition_flat` buffer: tensors ``names`` of ``shapes``, blocks
    ``boxes`` ``(offsets, sizes, replica)`` flattened back to back into ``total`` elements
    cut into ``world`` equal ranges. Hints of its layouts: ``(unit, rank, tensor index)``."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    boxes: tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...]
    total: int
    world: int


def layout_of(value: Any) -> tuple[torch.Tensor, Layout]:
    """Return ``(local_tensor, layout)`` for a state-dict leaf.

    Plain tensors are full tensors replicated on every rank of the group: each rank's copy is
    a valid source (the planner picks one); ``DTensor`` placements are translated.
    """
    if isinstance(value, ShardedTensor):
        return value.local, value.layout
    if _is_dtensor(value):
        return _dtensor_layout(value)
    if isinstance(value, torch.Tensor):
        return value, Layout.full(tuple(value.shape))
    raise LayoutError(f"not a tensor: {type(value).__name__}")


def _is_dtensor(value: Any) -> bool:
    # A DTensor can only exist once its module is imported; importing it here would cost ~1 s.
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(value, mod.DTensor)


def _dtensor_layout(dt) -> tuple[torch.Tensor, Layout]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = dt.device_mesh
    placements = tuple(dt.placements)
    strided = False
    for p in placements:
        if type(p) is not Shard and not isinstance(p, Replicate):
            if "Partial" in type(p).__name__:
                raise LayoutError(f"DTensor with a Partial placement cannot be saved; reduce it first ({placements})")
            if type(p).__name__ == "_StridedShard" and hasattr(p, "_split_tensor"):
                strided = True  # FSDP2 over TP: shards of shards (_strided_box)
                continue
            raise NotSupportedError(f"DTensor placement {p!r} is not supported ({placements})")
    shape = tuple(dt.shape)
    local = dt.to_local()
    coord = mesh.get_coordinate()
    if coord is None:  # this rank is not part of the mesh: holds nothing
        return local, Layout(shape, (0,) * len(shape), (0,) * len(shape), None, 1)
    if strided:
        local_shape, offsets = _strided_box(shape, mesh, placements, coord)
        if tuple(local_shape) != tuple(local.shape):
            raise LayoutError(f"DTensor placements {placements}: the local tensor has shape {list(local.shape)}, the "
                              f"placements give {list(local_shape)}")
    else:
        local_shape, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
    replica = 0
    for dim, p in enumerate(placements):
        if isinstance(p, Replicate):
            replica = replica * mesh.size(dim) + coord[dim]
    # the grid rule (plan.py, rules.GridGeo): torch.chunk cuts, one mesh dimension after another,
    # each inside the range the earlier ones left: in mesh order for Shard placements; FSDP2's
    # _StridedShard cuts inside the blocks of the Shard placements after it, so it comes after
    # them (reversed among themselves). The plan claims the rule only where this rank's own box
    # is the rule's piece (plan.summarize), so an order that does not fit (uneven strided cuts)
    # costs explicit pieces, never a wrong box.
    pl = tuple(-1 if isinstance(p, Replicate) else p.dim for p in placements)
    hint = None
    if all(isinstance(p, Replicate) or 0 <= p.dim < len(shape) for p in placements):
        mesh_shape = tuple(int(mesh.size(m)) for m in range(mesh.ndim))
        order = None
        if strided:
            order = (tuple(m for m, p in enumerate(placements) if type(p) is Shard)
                     + tuple(m for m, p in enumerate(placements) if type(p) is not Shard and not isinstance(p, Replicate))[::-1]
                     + tuple(m for m, p in enumerate(placements) if isinstance(p, Replicate)))
        hint = ("grid", mesh_shape, pl, int(np.ravel_multi_index(tuple(int(c) for c in coord), mesh_shape)), order)
    return local, Layout(shape, tuple(offsets), tuple(local_shape), None, replica, hint)


def _strided_box(shape: tuple, mesh, placements: tuple, coord) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(sizes, offsets)`` of this rank's piece of a DTensor with ``_StridedShard``
    placements (FSDP2 over tensor parallelism: FSDP's shard of each TP shard). The rows of
    each sharded dimension are found by splitting that dimension's indices as the placements
    do, left to right (each placement's own split, the order torch's
    ``compute_local_shape_and_global_offset`` applies them): a box when every dimension's
    rows are one contiguous, increasing range (FSDP2 x TP: always), else
    :class:`NotSupportedError` (the local tensor is no box of the full one)."""
    from torch.distributed.tensor import Replicate

    offsets, sizes = [0] * len(shape), list(shape)
    for d in sorted({p.dim for p in placements if not isinstance(p, Replicate)}):
        idx = torch.arange(shape[d]).reshape((1,) * d + (-1,))  # the indices along dimension d (split on d)
        for m, p in enumerate(placements):
            if not isinstance(p, Replicate) and p.dim == d:
                parts = p._split_tensor(idx, mesh.size(m), with_padding=False)[0]
                idx = parts[coord[m]] if coord[m] < len(parts) else idx.narrow(d, 0, 0)
        idx = idx.reshape(-1)
        n = idx.numel()
        if n and not torch.equal(idx, torch.arange(int(idx[0]), int(idx[0]) + n)):
            raise NotSupportedError(
                f"DTensor placements {placements} give this rank rows {idx[:8].tolist()}... of dimension {d}, not one "
                "contiguous range: such a local tensor is no box of the full tensor")
        offsets[d], sizes[d] = (int(idx[0]) if n else 0), n
    return tuple(sizes), tuple(offsets)
