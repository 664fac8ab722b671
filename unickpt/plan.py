"""The routing table: which rank writes each full tensor, into which file, and how pieces
travel there. Pure code: every rank computes the same plan from the same summaries.

Flow: each rank encodes a compact *summary* of its entries (names, dtypes, shapes, layouts:
JSON, zstd-compressed; no object graphs); summaries are exchanged (see ``save``); then
:func:`make_plan` assigns writers (balancing bytes, preferring the rank that already holds
most of a tensor), groups tensors into per-role files, and cuts each writer's byte stream
into buckets of at most ``bucket_bytes``. :meth:`SavePlan.schedule` turns that into the
concrete sends, receives and copies of one rank, step by step.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np
import xxhash
import zstandard

from .errors import LayoutError
from .format import build_header, itemsize, order_key
from .compress import QUANT_CODECS, stored_parts
from .layout import Layout, Runs, intersect
from .state import Entry

__all__ = ["encode_summary", "decode_summary", "summary_digest", "make_plan", "SavePlan", "TensorPlan", "FilePlan"]

BALANCE_SLACK = 1.1
DIRECT_MIN_RUN = 256 << 10
"""Pieces whose runs average at least this many bytes are written by their holder straight
into the writer's file (same node only) instead of travelling to the writer."""


def encode_summary(entries: list[Entry], dtypes: list[str], node: str, tags: dict | None = None) -> bytes:
    """``tags``: codec tag per entry key (see :mod:`unickpt.compress`)."""
    tags = tags or {}
    rows = [
        [e.role, e.name, dt, list(e.layout.shape), *e.layout.to_json(), tags.get(e.key)]
        for e, dt in zip(entries, dtypes)
    ]
    raw = json.dumps({"node": node, "t": rows}, separators=(",", ":")).encode()
    return zstandard.ZstdCompressor(level=3).compress(raw)


def summary_digest(summary: bytes) -> bytes:
    return xxhash.xxh3_128_digest(summary)


def decode_summary(data: bytes) -> dict:
    return json.loads(zstandard.ZstdDecompressor().decompress(data))


@dataclass(slots=True)
class TensorPlan:
    role: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    pieces: list[tuple[int, Layout]]  # every rank's layout, replicas included
    full_holders: list[int]
    writer: int = -1
    file: str = ""
    begin: int = 0  # byte offsets inside the file's data section
    end: int = 0
    direct: bool = False  # holders write their own runs in place; nothing travels
    codec: dict | None = None  # codec tag (unickpt.compress); None: stored as is
    parts: dict[str, tuple[str, str, tuple[int, ...], int, int]] = field(default_factory=dict)
    """Quantized tensors: part -> (header key, dtype, shape, begin, end) in the file."""

    @property
    def quantized(self) -> bool:
        return self.codec is not None and self.codec["codec"] in QUANT_CODECS

    def stored(self) -> list[tuple[str, str, str, tuple[int, ...]]]:
        """``(part, header key, dtype, shape)`` of what the file holds for this tensor."""
        return stored_parts(self.name, self.dtype, self.shape, self.codec)

    @property
    def stored_bytes(self) -> int:
        return sum(math.prod(sh) * itemsize(dt) for _, _, dt, sh in self.stored())

    @property
    def key(self) -> tuple[str, str]:
        return (self.role, self.name)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def sources(self) -> list[tuple[int, Layout]]:
        """Ranks whose data is written: the writer alone if it holds the whole tensor, else
        the replica-0 pieces (validated to tile the tensor exactly)."""
        if self.writer in self.full_holders:
            return [(self.writer, Layout.full(self.shape))]
        return [(r, lay) for r, lay in self.pieces if lay.replica == 0 and lay.numel > 0]


def extents_of(t: "TensorPlan") -> list[tuple[int, int, int, int]]:
    """Direct tensors: ``(rank, local_elem, tensor_elem, count)`` runs, in tensor order."""
    out = []
    for r, lay in t.sources():
        runs = lay.runs()
        for g, n, lo in zip(runs.starts.tolist(), runs.lengths.tolist(), runs.local.tolist()):
            out.append((r, lo, g, n))
    out.sort(key=lambda e: e[2])
    return out


@dataclass(slots=True)
class FilePlan:
    name: str
    role: str
    writer: int
    node: str
    tensors: list[TensorPlan]
    header: bytes = b""
    zstd: int | None = None  # zstd level: the file is stored as zstd frames (unickpt.container)

    @property
    def data_bytes(self) -> int:
        return sum(t.stored_bytes for t in self.tensors)

    @property
    def size(self) -> int:
        return len(self.header) + self.data_bytes


@dataclass(slots=True)
class Segment:
    """Elements ``[start, stop)`` of a tensor, written as one contiguous piece of a file."""

    tensor: TensorPlan
    file_index: int
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        return (self.stop - self.start) * self.tensor.itemsize


@dataclass(slots=True)
class Step:
    """What one rank does in one step of the gather."""

    sends: list[tuple[int, TensorPlan, Runs]] = field(default_factory=list)  # (dst, tensor, local runs)
    recvs: list[tuple[int, TensorPlan, int, Runs]] = field(default_factory=list)  # (src, tensor, seg idx, runs in segment)
    copies: list[tuple[TensorPlan, int, Runs, Runs]] = field(default_factory=list)  # (tensor, seg idx, local runs, seg runs)
    segments: list[Segment] = field(default_factory=list)  # this rank's segments to write, in file order
    local_whole: list[int | None] = field(default_factory=list)  # local element offset when one local run holds the whole segment (zero copy)


@dataclass(slots=True)
class SavePlan:
    world: int
    nodes: list[str]
    tensors: dict[tuple[str, str], TensorPlan]
    files: list[FilePlan]
    chunks: dict[int, list[list[Segment]]]  # writer -> buckets of segments
    bucket_bytes: int
    held_by: list[list[tuple[TensorPlan, Layout]]] | None = None
    """Per rank, the ``(tensor, layout)`` of every piece it holds (None: found by scanning)."""
    _schedules: dict[int, list[Step]] = field(default_factory=dict)

    @property
    def n_steps(self) -> int:
        return max((len(c) for c in self.chunks.values()), default=0)

    def writer_loads(self) -> list[int]:
        loads = [0] * self.world
        for t in self.tensors.values():
            loads[t.writer] += t.nbytes
        return loads

    def files_of(self, rank: int) -> list[FilePlan]:
        return [f for f in self.files if f.writer == rank]

    def schedule(self, rank: int) -> list[Step]:
        if rank not in self._schedules:
            self._schedules[rank] = _schedule(self, rank)
        return self._schedules[rank]


def make_plan(
    summaries: list[dict], *, bucket_bytes: int, max_file_bytes: int | None = None, zstd: int | None = None,
    shared_writes: bool = True,
) -> SavePlan:
    """``zstd``: level for the files of every role but ``model`` (model files stay plain).
    ``shared_writes``: the storage lets several ranks write one file (its
    :attr:`~unickpt.storage.Capabilities.shared_writes`); without it every piece is gathered
    to its file's one writer."""
    world = len(summaries)
    nodes = [str(s["node"]) for s in summaries]
    tensors: dict[tuple[str, str], TensorPlan] = {}
    held_by: list[list[tuple[TensorPlan, Layout]]] = [[] for _ in range(world)]
    for rank, s in enumerate(summaries):
        mine = held_by[rank]
        for role, name, dtype, shape, offsets, sizes, flat, replica, tag in s["t"]:
            shape = tuple(shape)
            lay = Layout.from_json(shape, [offsets, sizes, flat, replica])
            t = tensors.get((role, name))
            if t is None:
                t = tensors[(role, name)] = TensorPlan(role, name, dtype, shape, [], [], codec=tag)
            elif t.codec != tag:
                raise LayoutError(f"tensor {name!r} (role {role}): ranks disagree on its codec ({t.codec} vs {tag})")
            elif t.dtype != dtype or t.shape != shape:
                first = t.pieces[0][0] if t.pieces else "?"
                raise LayoutError(
                    f"tensor {name!r} (role {role}): rank {first} has {t.dtype} {list(t.shape)} but rank {rank} "
                    f"has {dtype} {list(shape)}"
                )
            t.pieces.append((rank, lay))
            mine.append((t, lay))
            if lay.is_full:
                t.full_holders.append(rank)
    for t in tensors.values():
        if not t.full_holders:
            _check_tiling(t)
    _assign_writers(list(tensors.values()), world)
    for t in tensors.values():
        # framed files are written by their owner only, frame by frame
        t.direct = shared_writes and _can_write_direct(t, nodes) and not (zstd and t.role != "model")
    files = _make_files(tensors, world, nodes, max_file_bytes)
    if zstd:
        for f in files:
            f.zstd = zstd if f.role != "model" else None
    chunks = _make_chunks(files, world, bucket_bytes)
    return SavePlan(world, nodes, tensors, files, chunks, bucket_bytes, held_by)


def _check_tiling(t: TensorPlan) -> None:
    src = [(r, lay) for r, lay in t.pieces if lay.replica == 0 and lay.numel > 0]
    if not src and t.numel == 0:
        return
    singles = [lay.single_run() for _, lay in src]
    runs = [lay.runs() for (_, lay), one in zip(src, singles) if one is None]
    ones = np.array([one for one in singles if one is not None], np.int64).reshape(-1, 2)
    starts = np.concatenate([ones[:, 0], *(r.starts for r in runs)])
    lengths = np.concatenate([ones[:, 1], *(r.lengths for r in runs)])
    order = np.argsort(starts, kind="stable")
    starts, lengths = starts[order], lengths[order]
    ends = starts + lengths
    covered = int(lengths.sum())
    if len(starts) > 1 and np.any(starts[1:] < ends[:-1]):
        i = int(np.argmax(starts[1:] < ends[:-1]))
        raise LayoutError(
            f"tensor {t.name!r} (role {t.role}): replica-0 shards overlap at element {int(starts[i + 1])}; "
            "mark duplicate copies with replica > 0"
        )
    if covered != t.numel:
        raise LayoutError(
            f"tensor {t.name!r} (role {t.role}): replica-0 shards cover {covered} of {t.numel} elements "
            f"(ranks {sorted({r for r, _ in src})}); every element needs exactly one replica-0 owner"
        )


def _assign_writers(tensors: list[TensorPlan], world: int) -> None:
    """Largest tensors first; each goes to the rank holding most of it unless that would push
    the rank past BALANCE_SLACK x the mean load, else to the least-loaded candidate.

    That is: among candidates (ranks holding it whole, else every rank) whose load stays
    within the cap, the first by (most held, least loaded, lowest rank); if none, the first by
    (least loaded, most held, lowest rank). Vectorised over ranks: a tensor costs its pieces
    plus a few array operations, not a sort of every rank."""
    total = sum(t.nbytes for t in tensors)
    cap = BALANCE_SLACK * total / world if world else 0
    loads = np.zeros(world, np.int64)
    for t in sorted(tensors, key=lambda t: (-t.nbytes, t.role, t.name)):
        held: dict[int, int] = {}
        for r, lay in t.pieces:
            if lay.numel > held.get(r, 0):
                held[r] = lay.numel
        if t.full_holders:
            cands = np.unique(np.array(t.full_holders, np.int64))  # equal held (whole): by load, rank
            c_load = loads[cands]
            fit = cands[c_load + t.nbytes <= cap]
            choice = int(fit[np.argmin(loads[fit])]) if len(fit) else int(cands[np.argmin(c_load)])
        else:
            choice = _pick_any(t.nbytes, held, loads, cap)
        t.writer = choice
        loads[choice] += t.nbytes


def _pick_any(nbytes: int, held: dict[int, int], loads: np.ndarray, cap: float) -> int:
    """:func:`_assign_writers` when every rank is a candidate."""
    hr = np.fromiter(held.keys(), np.int64, len(held))
    hn = np.fromiter(held.values(), np.int64, len(held))
    keep = hn > 0
    hr, hn = hr[keep], hn[keep]
    fit = loads[hr] + nbytes <= cap
    if fit.any():  # a holder within the cap: most held, then least loaded, then lowest rank
        r, n = hr[fit], hn[fit]
        return int(r[np.lexsort((r, loads[r], -n))[0]])
    others = np.ones(len(loads), bool)
    others[hr] = False
    if others.any():  # holding nothing: least loaded, then lowest rank (argmin: the first)
        i = int(np.flatnonzero(others)[np.argmin(loads[others])])
        if loads[i] + nbytes <= cap:
            return i
    low = np.flatnonzero(loads == loads.min())  # over the cap everywhere: least loaded, most held
    return int(max(low.tolist(), key=lambda r: (held.get(r, 0), -r)))


def _can_write_direct(t: TensorPlan, nodes: list[str]) -> bool:
    if t.nbytes == 0 or t.quantized:  # quantized: the writer encodes whole groups
        return False
    srcs = t.sources()
    if any(nodes[r] != nodes[t.writer] for r, _ in srcs):
        return False  # other nodes may not see the writer's disk: gather
    n_runs = sum(lay.n_runs for _, lay in srcs)
    return t.nbytes / max(n_runs, 1) >= min(DIRECT_MIN_RUN, t.nbytes)


def _make_files(tensors, world, nodes, max_file_bytes) -> list[FilePlan]:
    by_role: dict[str, list[list[TensorPlan]]] = {}
    writers_of: dict[str, list[int]] = {}
    grouped: dict[str, dict[int, list[TensorPlan]]] = {}
    for t in tensors.values():
        grouped.setdefault(t.role, {}).setdefault(t.writer, []).append(t)
    for role in sorted(grouped):
        parts: list[list[TensorPlan]] = []
        owners: list[int] = []
        for w in sorted(grouped[role]):
            mine = sorted(grouped[role][w], key=lambda t: order_key(t.dtype, t.name))
            cur: list[TensorPlan] = []
            size = 0
            for t in mine:
                if cur and max_file_bytes and size + t.nbytes > max_file_bytes:
                    parts.append(cur)
                    owners.append(w)
                    cur, size = [], 0
                cur.append(t)
                size += t.nbytes
            parts.append(cur)
            owners.append(w)
        by_role[role] = parts
        writers_of[role] = owners
    files: list[FilePlan] = []
    for role, parts in by_role.items():
        n = len(parts)
        for i, (part, w) in enumerate(zip(parts, writers_of[role]), start=1):
            name = f"{role}-{i:05d}-of-{n:05d}.safetensors"
            meta = {"format": "pt", "unickpt_role": role}
            stored = sorted(
                ((key, dt, sh, t, p) for t in part for p, key, dt, sh in t.stored()),
                key=lambda x: order_key(x[1], x[0]),
            )
            header, infos = build_header(((k, dt, sh) for k, dt, sh, _, _ in stored), meta)
            for (key, dt, sh, t, p), info in zip(stored, infos):
                t.file = name
                if t.quantized:
                    t.parts[p] = (key, dt, sh, info.begin, info.end)
                else:
                    t.begin, t.end = info.begin, info.end
            for t in part:
                if t.quantized:  # the span of its parts (ordering only: parts are read by offset)
                    t.begin = min(x[3] for x in t.parts.values())
                    t.end = max(x[4] for x in t.parts.values())
            files.append(FilePlan(name, role, w, nodes[w], part, header))
    return files


def _make_chunks(files: list[FilePlan], world: int, bucket_bytes: int) -> dict[int, list[list[Segment]]]:
    chunks: dict[int, list[list[Segment]]] = {}
    by_writer: dict[int, list[tuple[int, FilePlan]]] = {}
    for fi, f in enumerate(files):
        by_writer.setdefault(f.writer, []).append((fi, f))
    for w in sorted(by_writer):
        out: list[list[Segment]] = []
        cur: list[Segment] = []
        room = bucket_bytes
        for fi, f in by_writer[w]:
            for t in f.tensors:
                if t.direct:
                    continue
                start, n, isz = 0, t.numel, t.itemsize
                g = t.codec["group"] if t.quantized else 1  # quantized: whole groups per segment
                while start < n or (n == 0 and start == 0):
                    take = min(n - start, max(room // isz, 0) // g * g)
                    if take == 0 and n > 0:
                        out.append(cur)
                        cur, room = [], bucket_bytes
                        take = min(n - start, max(bucket_bytes // isz // g * g, g))
                    cur.append(Segment(t, fi, start, start + take))
                    room -= take * isz
                    start += take
                    if n == 0:
                        break
        if cur:
            out.append(cur)
        if out:
            chunks[w] = out
    return chunks


def _own_sources(held: list[tuple[TensorPlan, Layout]], rank: int) -> dict[tuple[str, str], list[tuple[int, Layout]]]:
    """``rank``'s entries in :meth:`TensorPlan.sources`, from the pieces it holds."""
    out: dict[tuple[str, str], list[tuple[int, Layout]]] = {}
    for t, lay in held:
        if t.writer in t.full_holders:
            if t.writer == rank:
                out[t.key] = [(rank, Layout.full(t.shape))]
        elif lay.replica == 0 and lay.numel > 0:
            out.setdefault(t.key, []).append((rank, lay))
    return out


def _schedule(plan: SavePlan, rank: int) -> list[Step]:
    """The steps of one rank. Cost: every writer's segments are visited, but only the
    sources of this rank (its own pieces) and, for the segments it writes, every source of
    their tensors are intersected: never every rank's pieces of every tensor."""
    steps: list[Step] = []
    runs_cache: dict[tuple[tuple[str, str], int], Runs] = {}
    all_sources: dict[tuple[str, str], list[tuple[int, Layout]]] = {}
    if plan.held_by is not None:
        own = _own_sources(plan.held_by[rank], rank)
    else:
        own = {t.key: [(r, lay) for r, lay in t.sources() if r == rank] for t in plan.tensors.values()}

    def src_runs(t: TensorPlan, r: int, lay: Layout) -> Runs:
        k = (t.key, r)
        if k not in runs_cache:
            runs_cache[k] = lay.runs()
        return runs_cache[k]

    def sources(t: TensorPlan, w: int) -> list[tuple[int, Layout]]:
        if w != rank:
            return own.get(t.key, [])
        if t.key not in all_sources:
            all_sources[t.key] = t.sources()
        return all_sources[t.key]

    for s in range(plan.n_steps):
        step = Step()
        for w, chunk_list in sorted(plan.chunks.items()):
            if s >= len(chunk_list):
                continue
            for si, seg in enumerate(chunk_list[s]):
                t = seg.tensor
                seg_runs = Runs.single(seg.start, seg.stop)
                for r, lay in sources(t, w):
                    g, n, off_src, off_seg = intersect(src_runs(t, r, lay), seg_runs)
                    if len(n) == 0:
                        continue
                    if r == rank and w == rank:
                        step.copies.append((t, si, Runs(off_src, n), Runs(off_seg, n)))
                    elif r == rank:
                        step.sends.append((w, t, Runs(off_src, n)))
                    else:
                        step.recvs.append((r, t, si, Runs(off_seg, n)))
                if w == rank:
                    step.segments.append(seg)
        by_seg: dict[int, list] = {}
        for c in step.copies:
            by_seg.setdefault(c[1], []).append(c)
        for si, seg in enumerate(step.segments):
            mine = by_seg.get(si, [])
            whole = (
                len(mine) == 1
                and len(mine[0][2]) == 1
                and int(mine[0][2].lengths[0]) == seg.stop - seg.start
            )
            step.local_whole.append(int(mine[0][2].starts[0]) if whole else None)
        steps.append(step)
    return steps
