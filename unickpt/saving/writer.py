"""One rank's share of a save's files (:class:`RankWriter`): headers, the runs of tensors it
writes in place, and the tensors it gathers in bounded buckets from the ranks that hold their
pieces, each step's segments written (and encoded, for quantized tensors) on a writer thread
while the next step gathers. File errors never leave the communication schedule: the rank keeps
serving its peers until the last step and raises afterwards."""

from __future__ import annotations

import functools
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

import torch

from .._copy import as_bytes, copy_runs
from .._metrics import log
from ..codecs import encode_chunk
from .._coders import in_order
from ..compress import Compression, merge_error, save_args
from ..errors import UnickptError
from ..format import BlockHasher, block_sums, torch_dtype
from ..io.fileset import FileSet
from ..plan import SavePlan, Step, extents_of
from ..state import Entry
from ..transport import Comm


if TYPE_CHECKING:
    from .options import ProgressFn, SaveOptions

__all__ = ["RankWriter", "StagedBytes", "encode_fragments", "finish_files", "step_args"]


class RankWriter:
    """Writes this rank's share of ``plan`` into the save's files (``out``, created already):
    :meth:`run` returns this rank's report for the manifest
    (checksums, bytes per file, zstd frames, quantization errors) and the partial pages at the
    edges of its O_DIRECT runs, which the files' owners write (:func:`finish_files`)."""

    def __init__(self, plan: SavePlan, comm: Comm, entries: list[Entry], out: FileSet, *,
                 direct_io: bool | None = None, phase=None,
                 progress: "ProgressFn | None" = None, staged: "StagedBytes | None" = None,
                 step_args: dict | None = None) -> None:
        self.plan, self.comm, self.rank = plan, comm, comm.rank
        self.out, self.direct_io = out, direct_io
        self.phase, self.progress, self.staged, self.step_args = phase, progress, staged, step_args or {}
        self.by_key = {e.key: e for e in entries}
        files = self.files = plan.files
        index = {f.name: i for i, f in enumerate(files)}
        # (file index, tensor, local elem, tensor elem, count) of the runs this rank writes in place
        self.extents = sorted(((index[t.file], t, lo, g, n) for t in plan.tensors.values() if t.direct
                               for _, lo, g, n in extents_of(t, self.rank)),
                              key=lambda e: (e[0], e[1].begin + e[3] * e[1].itemsize))
        self.owned = [i for i, f in enumerate(files) if f.writer == self.rank]
        self.needed = sorted(set(self.owned) | {e[0] for e in self.extents})
        self.hashers = {t.key: BlockHasher() for i in self.owned for t in files[i].tensors
                        if not t.direct and not t.quantized}
        self.checks: dict[str, list] = {}
        self.qerr: dict[str, list] = {}  # quantized tensors: their encoding's error, merged in the manifest
        self.sources: dict[tuple[str, str], _Source] = {}
        self.error: BaseException | None = None  # the first; the schedule is still served after it
        self.pending: list[Future | None] = [None, None]
        self.in_place = sum(n * t.itemsize for _, t, _, _, n in self.extents) + sum(len(files[i].header) for i in self.owned)
        self.total = self.in_place + sum(t.nbytes for i in self.owned for t in files[i].tensors if not t.direct)
        self.done = 0

    def run(self) -> tuple[dict, list[tuple[int, int, bytes]]]:
        self._sources()
        io = ThreadPoolExecutor(1, thread_name_prefix="unickpt-write")
        try:
            try:
                self._open_files()
                if self.error is None:
                    self.pending[1] = io.submit(self._write_in_place)
                for s, step in enumerate(self.plan.schedule(self.rank)):
                    self._serve(io, s % 2, step)
                self._reap(0)
                self._reap(1)
                if self.error is not None:
                    raise self.error
                self._note(self.in_place)  # (written by _write_in_place): progress ends at total
                return self._close()
            except BaseException:
                for fut in self.pending:
                    if fut is not None:
                        fut.exception()
                self.out.abort()
                raise
        finally:
            io.shutdown(wait=True)

    def _fail(self, e: BaseException) -> None:
        if self.error is None:
            self.error = e

    def _sources(self) -> None:
        """Built up front, in this thread: the writer thread and the gather loop both read them
        (a lazy cache filled from two threads could copy a non-contiguous tensor twice)."""
        keys = {t.key for _, t, _, _, _ in self.extents} | {
            t.key for st in self.plan.schedule(self.rank) for t in [*(x[1] for x in st.sends), *(x[0] for x in st.copies)]}
        try:
            for k in keys:
                self.sources[k] = _Source(self.by_key[k], self.staged)
        except Exception as e:  # e.g. no memory for a contiguous copy: serve the steps, then raise
            self._fail(e)

    def _src(self, key) -> "_Source":
        return self.sources[key]

    def _open_files(self) -> None:
        """Every file this rank writes into (its own, whose headers it writes, and those its
        in-place runs fall into)."""
        try:
            for i in self.needed:
                f = self.files[i]
                mine = f.writer == self.rank
                self.out.open(i, f.name, f.size, header=f.header if mine else None, header_len=len(f.header),
                              zstd=f.zstd, lossless=f.lossless, direct=self.direct_io)
        except Exception as e:  # any error (not only OSError): the schedule must still be served
            self._fail(e)

    def _note(self, n: int) -> None:
        self.done += n
        if self.progress is not None:
            try:
                self.progress(self.done, self.total)
            except Exception as e:  # a callback must not take the save (and its peers) down
                log.warning("progress callback failed: %s", e)
                self.progress = None

    def _reap(self, slot: int) -> None:
        fut, self.pending[slot] = self.pending[slot], None
        if fut is not None and fut.exception() is not None:
            self._fail(fut.exception())

    def _write_in_place(self) -> None:
        """This rank's runs of direct tensors (on the writer thread). Quantized runs (whole
        groups) are encoded here, in pieces coded ahead on the coder threads, and their codes
        written in place: nothing travels, nothing is gathered."""
        coded = in_order(self._coded_pieces())
        try:
            for fi, t, lo, g, n in self.extents:
                isz = t.itemsize
                if t.quantized:
                    _write_coded(t, fi, _n_pieces(t, n), coded, self.out, self.checks, self.qerr)
                    continue
                mv = memoryview(self._src(t.key).host_range(lo * isz, (lo + n) * isz).numpy())
                # sources do not change during a save (the view stays referenced by the write): the
                # writer may take the bytes straight from memory, while this thread hashes them
                self.out.write(fi, t.begin + g * isz, mv, stable=True)
                self.checks.setdefault(f"{t.role}/{t.name}", []).extend(block_sums(mv, g * isz))
        finally:
            coded.close()  # (after an error: no coder still reads the sources)

    def _coded_pieces(self):
        """The coding jobs of this rank's quantized runs, one per piece, each piece's bytes
        taken only when the coder threads have room for it (a device tensor's are copied to
        the host per piece, never a whole run at once)."""
        for _, t, lo, g, n in self.extents:
            if t.quantized:
                src, isz = self._src(t.key), t.itemsize
                yield from _encode_jobs(t, lambda a, b, s=src, lo=lo, k=isz: s.host_range((lo + a) * k, (lo + b) * k),
                                        g, n, self.step_args)

    def _serve(self, io: ThreadPoolExecutor, slot: int, step: Step) -> None:
        """One step of the schedule: gather its segments into bucket ``slot`` (whose previous
        write is reaped first), hand them to the writer thread. After an error, take part
        in the step's transfers with the right sizes and write nothing."""
        self._reap(slot)
        if self.error is not None:
            _drain_step(step, self.comm)
            return
        need = sum(seg.nbytes for seg, whole in zip(step.segments, step.local_whole) if whole is None)
        try:
            with self.phase("gather"):
                items = _run_step(step, self.comm, self._src, _bucket(slot, need) if need else None)
        except _Unsent as e:  # failed before this step's transfers were posted
            self._fail(e.__cause__ or e)
            _drain_step(step, self.comm)
            return
        except Exception as e:  # after the transfers: later steps are drained
            self._fail(e)
            return
        self.pending[slot] = io.submit(_write_items, items, self.out, self.hashers, self.checks, self.qerr,
                                       self.step_args)
        self._note(sum(int(v.numel()) for _, _, v, _, _ in items))

    def _close(self) -> tuple[dict, list[tuple[int, int, bytes]]]:
        with self.phase("fsync"):
            written, framed, fragments = self.out.close()
        written = {self.files[i].name: n for i, n in written.items()}
        framed = {self.files[i].name: w for i, w in framed.items()}
        for k, h in self.hashers.items():
            self.checks[f"{k[0]}/{k[1]}"] = h.finish()
        zst = {n: {"stored": w.pos, "frames": w.frames} for n, w in framed.items()}
        stored = sum(written.values()) + sum(w.pos - w.logical for w in framed.values())
        return {"checksums": self.checks, "files": written, "bytes": stored, "zstd": zst, "qerr": self.qerr}, fragments


def encode_fragments(fragments: list[tuple[int, int, bytes]]) -> bytes:
    out = bytearray()
    for fi, off, data in fragments:
        out += struct.pack("<IQI", fi, off, len(data))
        out += data
    return bytes(out)


def finish_files(plan: SavePlan, rank: int, out: FileSet, blobs: list[bytes]) -> None:
    """The files this rank owns: every rank's page fragments (``blobs``, as
    :func:`encode_fragments` made them) merged, each file fsynced."""
    mine = {i for i, f in enumerate(plan.files) if f.writer == rank}
    frags: dict[int, list[tuple[int, bytes]]] = {i: [] for i in mine}
    for blob in blobs:
        pos = 0
        while pos < len(blob):
            fi, off, n = struct.unpack_from("<IQI", blob, pos)
            pos += 16
            if fi in mine:
                frags[fi].append((off, blob[pos : pos + n]))
            pos += n
    for fi in sorted(mine):
        f = plan.files[fi]
        if f.framed:  # written by its owner alone, fsynced on close
            if frags[fi]:
                raise UnickptError(f"{f.name}: framed file received in-place fragments")
            continue
        out.finish(f.name, frags[fi], f.size)


class StagedBytes(Protocol):
    """Entries whose bytes are still being copied in (the asynchronous writer's staging)."""

    def wait(self, key: tuple[str, str], nbytes: int) -> None:
        """Block until the first ``nbytes`` bytes of entry ``key`` are in place; raise if the
        copy failed before them (or did not get there within the save's timeout)."""

    def wait_all(self) -> None:
        """Block until the whole copy is done; raise if it failed."""


class _Source:
    """Host bytes of a local tensor, on demand (device tensors are copied per range). With
    ``staged``, each range waits for its bytes first."""

    def __init__(self, entry: Entry, staged: StagedBytes | None = None) -> None:
        t = entry.local.detach()
        self.device = t.device
        self.key, self.staged = entry.key, staged
        if staged is not None and not t.is_contiguous():  # the copy below reads every byte
            staged.wait(entry.key, t.numel() * t.element_size())
        self.flat = as_bytes(t if t.is_contiguous() else t.contiguous())  # (a device tensor stays on device)

    def host_range(self, start: int, stop: int) -> torch.Tensor:
        if self.staged is not None:
            self.staged.wait(self.key, stop)
        v = self.flat[start:stop]
        return v if self.device.type == "cpu" else v.to("cpu")


_BUCKETS: list[torch.Tensor] = []  # kept across saves: fresh memory costs 4-8x a copy


def _bucket(slot: int, need: int) -> torch.Tensor:
    while len(_BUCKETS) <= slot:
        _BUCKETS.append(torch.empty(0, dtype=torch.uint8))
    if _BUCKETS[slot].numel() < need:
        _BUCKETS[slot] = torch.empty(need, dtype=torch.uint8)
    return _BUCKETS[slot]


def step_args(plan: SavePlan, comp: Compression, opts: SaveOptions) -> dict[tuple[str, str], dict]:
    """Per quantized tensor, what this save adds to its (step-independent, cached) tag: the
    rounding seed of its step (compress.save_args)."""
    return {t.key: a for t in plan.tensors.values() if t.quantized
            for a in [save_args(t.codec, t.role, t.name, comp, opts.step)] if a}


class _Unsent(Exception):
    """Preparing a step failed before any of its transfers was posted."""


def _drain_step(step: Step, comm: Comm) -> None:
    """Take part in a step's transfers without data (after a local error), so that peers
    are not left waiting; what they receive from us is discarded with the failed save."""
    sends = [(dst, torch.zeros(runs.numel * t.itemsize, dtype=torch.uint8)) for dst, t, runs in step.sends]
    recvs = [(r, torch.empty(runs.numel * t.itemsize, dtype=torch.uint8)) for r, t, _, runs in step.recvs]
    comm.exchange(sends, recvs)


def _run_step(step: Step, comm: Comm, src, bucket: torch.Tensor | None):
    """Assemble this rank's segments of one step; return ``(file_index, key, bytes)`` items.
    Raises :class:`_Unsent` if it fails before posting the step's transfers."""
    try:
        sends, recvs, scatters, offs = _prepare_step(step, src, bucket)
    except Exception as e:
        raise _Unsent(str(e)) from e
    comm.exchange(sends, recvs)
    return _finish_step(step, src, bucket, scatters, offs)


def _prepare_step(step: Step, src, bucket):
    offs: list[int] = []
    pos = 0
    for seg, whole in zip(step.segments, step.local_whole):
        offs.append(pos)
        if whole is None:
            pos += seg.nbytes
    sends, recvs, scatters = [], [], []
    for dst, t, runs in step.sends:
        s = src(t.key)
        isz = t.itemsize
        if len(runs) == 1:
            a = int(runs.starts[0]) * isz
            sends.append((dst, s.host_range(a, a + int(runs.lengths[0]) * isz)))
        else:
            packed = torch.empty(runs.numel * isz, dtype=torch.uint8)
            lo = int(runs.starts[0]) * isz
            hi = int(runs.starts[-1] + runs.lengths[-1]) * isz
            window = s.host_range(lo, hi)
            copy_runs(window, runs.starts - lo // isz, packed, runs.local, runs.lengths, isz)
            sends.append((dst, packed))
    for r, t, si, runs in step.recvs:
        isz = t.itemsize
        base = offs[si]
        if len(runs) == 1:
            a = base + int(runs.starts[0]) * isz
            recvs.append((r, bucket[a : a + int(runs.lengths[0]) * isz]))
        else:
            tmp = torch.empty(runs.numel * isz, dtype=torch.uint8)
            recvs.append((r, tmp))
            scatters.append((tmp, base, runs, isz))
    for t, si, lruns, sruns in step.copies:
        if step.local_whole[si] is not None:
            continue
        s = src(t.key)
        isz = t.itemsize
        lo = int(lruns.starts[0]) * isz
        hi = int(lruns.starts[-1] + lruns.lengths[-1]) * isz
        window = s.host_range(lo, hi)
        base = offs[si]
        copy_runs(window, lruns.starts - lo // isz, bucket[base:], sruns.starts, lruns.lengths, isz)
    return sends, recvs, scatters, offs


def _finish_step(step: Step, src, bucket, scatters, offs):
    for tmp, base, runs, isz in scatters:
        copy_runs(tmp, runs.local, bucket[base:], runs.starts, runs.lengths, isz)
    items = []
    for si, (seg, whole) in enumerate(zip(step.segments, step.local_whole)):
        t = seg.tensor
        isz = t.itemsize
        if seg.nbytes == 0:
            view = torch.empty(0, dtype=torch.uint8)
        elif whole is not None:
            view = src(t.key).host_range(whole * isz, whole * isz + seg.nbytes)
        else:
            view = bucket[offs[si] : offs[si] + seg.nbytes]
        items.append((seg.file_index, t, view, t.begin + seg.start * isz, seg.start))
    return items


SUB_CHUNK = 16 << 20
"""Bytes of input per quantized piece coded on its own (whole groups): the unit of the coder
threads' work, so that coding one tensor proceeds while its earlier pieces are written."""


def _write_items(items, out: FileSet, hashers, checks, qerr, step_args) -> None:
    """Write one step's segments (runs on the writer thread); quantized segments (whole
    groups) are encoded here, so encoding overlaps the next step's gather, in pieces coded
    several at once on the coder threads (:mod:`unickpt._coders`) while the finished ones
    are written in order: on storage slower than the coder, the coding hides behind the
    writes. Codes do not depend on how a tensor is cut (the dither is addressed by element)."""
    # every item's pieces, coded ahead, in order
    coded = in_order(job for _, t, view, _, start in items if view.numel() and t.quantized
                     for job in _encode_jobs(t, lambda a, b, v=view, k=t.itemsize: v[a * k : b * k], start,
                                             view.numel() // t.itemsize, step_args))
    try:
        for fi, t, view, offset, start in items:
            if view.numel() == 0:
                continue
            if t.quantized:
                _write_coded(t, fi, _n_pieces(t, view.numel() // t.itemsize), coded, out, checks, qerr)
                continue
            mv = memoryview(view.numpy())
            hashers[t.key].update(mv)
            out.write(fi, offset, mv)
    finally:
        coded.close()  # (after an error: no coder still reads this step's bucket)


def _write_coded(t, fi: int, pieces: int, coded, out: FileSet, checks, qerr) -> None:
    """Write the next ``pieces`` coded pieces of ``coded`` (a segment or run of quantized
    ``t``): each part at its place in the file, hashed, the pieces' errors merged."""
    stats = qerr.setdefault(f"{t.role}/{t.name}", [])
    for _ in range(pieces):
        parts, st = next(coded)
        if st:
            merge_error(stats, st)
        for part, poff, data in parts:
            if data.numel() == 0:
                continue
            mv = memoryview(data.numpy())
            checks.setdefault(f"{t.role}/{t.name}#{part}", []).extend(block_sums(mv, poff))
            out.write(fi, t.parts[part][3] + poff, mv)


def _piece_elems(t) -> int:
    """Elements of quantized ``t`` per piece coded on its own: whole groups, about
    :data:`SUB_CHUNK` bytes of input."""
    g = t.codec["group"]
    return max(g, (SUB_CHUNK // t.itemsize // g) * g)


def _n_pieces(t, n: int) -> int:
    """How many pieces :func:`_encode_jobs` cuts ``n`` elements of ``t`` into."""
    return -(-n // _piece_elems(t))


def _encode_jobs(t, take, start: int, n: int, step_args):
    """The jobs coding elements ``[start, start + n)`` of quantized ``t`` (``start`` on a
    group boundary), one per piece of :func:`_piece_elems` elements, each a callable
    returning ``(parts, error stats)``. ``take(a, b)``: the bytes of the run's elements
    ``[a, b)``, asked for as each job is made (lazily: a device tensor's piece is copied to
    the host only when the coder threads have room for it)."""
    tag = {**t.codec, **step_args[t.key]} if t.key in step_args else t.codec
    what = f"tensor {t.name!r} (role {t.role})"
    step = _piece_elems(t)
    dtype = torch_dtype(t.dtype)
    for a in range(0, n, step):
        view = take(a, min(a + step, n))
        if view.data_ptr() % 8:
            view = view.clone()
        yield functools.partial(_encode_piece, tag, view.view(dtype), start + a, what)


def _encode_piece(tag: dict, x: torch.Tensor, start: int, what: str):
    st: list = []
    return encode_chunk(tag, x, start, what, st), st
