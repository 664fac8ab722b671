"""One rank's reads of one load (:class:`ReadSession`): each target classified once (coded,
node-shared, or read alone in pieces) and its bytes read, verified and placed in one pass."""

from __future__ import annotations

import os
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from .._copy import Windows, as_bytes, copy_window
from ..errors import StateDictError
from ..format import CHECK_BLOCK, Hasher
from ..io.files import Files
from ..io.storage import RandomReader
from ..layout import Runs
from ..manifest import Manifest, TensorEntry
from ..noderead import SharedJob, bounds, eligible, read_shared, touched
from ..state import Entry
from ..transport import Comm
from .coded import read_coded
from .verify import StreamCheck


READ_THREADS = 4
"""Pieces in flight per rank when the bytes come from the disk or the network (the device
gets several requests at once); from the page cache or tmpfs, where each piece is pure CPU
work, a rank uses its share of the cores instead (:func:`_threads`)."""


PIECE = 4 << 20
"""Bytes of one read of a file in memory (page cache, tmpfs): read, hashed and placed while
they are in the CPU's cache (one pass over each byte; with 16 MiB pieces the hash and the
scatter ran from memory)."""


LONG_PIECE = 16 << 20
"""Bytes of one read from a disk or an object store: fewer, longer requests (4 MiB reads of a
cold file took up to 1.4x as long here; the hash after them is not what limits a disk)."""


READ_AHEAD = 512 << 20  # bytes of reads in flight before earlier targets are finished


DIRECT_RUN = 1 << 20  # runs at least this long on average: "long" (noderead shares them only to stream)


@dataclass(slots=True)
class _Job:
    """One raw target's read: its stored tensor, the file's reader and the tensor's offset in
    it, the runs it needs, and where they go (``dest``: the target's own bytes when
    ``direct``, else a temporary copied into ``local`` once read)."""

    st: TensorEntry
    reader: RandomReader
    base: int
    runs: Runs
    isz: int
    dest: torch.Tensor
    local: torch.Tensor
    direct: bool
    nbytes: int = -1
    """Bytes of the target's runs (set once: a load has hundreds of targets)."""
    dest_np: Any = None
    """``dest`` as a numpy array (a view: slicing it costs less than slicing the tensor)."""

    def __post_init__(self) -> None:
        if self.nbytes < 0:
            self.nbytes = self.runs.numel * self.isz
        if self.dest_np is None:
            self.dest_np = self.dest.numpy()


class ReadSession:
    """Reads the targets of one load (or of one share of a DCP load) from one checkpoint.

    Each target is classified once (:meth:`_issue`): **coded** (decoded window by window,
    :func:`~unickpt.loading.coded.read_coded`), **shared** (with ``comm``: ranks of a node
    whose needs overlap or interleave read them once through the node,
    :mod:`unickpt.noderead`; long runs wait for that decision, one small all-gather), or
    read alone in **pieces** (:func:`plan_pieces`): the whole checksummed ranges its runs
    touch, in pieces of :data:`PIECE` bytes (:data:`LONG_PIECE` from a disk or an object
    store), each read, hashed and placed by one of the rank's read threads (:func:`_threads`)
    in one pass while its bytes are in the cache: straight into the
    target where a piece lies inside one run of a contiguous target (then hashed there),
    else into the thread's buffer, hashed, and the needed bytes copied out (strided copies).
    Pieces are issued in file order (the kernel's read-ahead follows them). A target is
    finished (copied back from a temporary if needed, its checksums tallied) once its pieces
    are done; :meth:`run` returns ``(bytes read, checksums verified, [(file, tensor)] that
    failed)``. With ``comm`` the call is collective: every rank of it runs one session;
    ``record`` (a dict) rides the node-shared decision's all-gather (:func:`read_shared`)."""

    def __init__(self, man: Manifest, storage, ckpt: str, verify: str, progress=None, rank: int = 0, world: int = 1,
                 comm: Comm | None = None, record: dict | None = None) -> None:
        self.man, self.verify, self.progress, self.comm = man, verify, progress, comm
        self.record = record
        self.storage, self.ckpt = storage, ckpt
        self.rank, self.world = rank, world
        self.files = Files(storage, ckpt, man)
        self.bad: list[tuple[str, str]] = []
        self.verified = 0
        self.done = 0  # bytes of targets finished (progress)
        self.total = 0
        self.pending: deque = deque()  # (job, futures) of pieces, finished in order
        self.in_flight = 0  # bytes of targets whose pieces are not finished yet
        self.shared: list[SharedJob] = []  # targets read node-shared, if the node shares (with comm)
        self._local = threading.local()  # each read thread's buffer
        self._bounds: dict = {}  # stored tensor key -> its checksummed ranges' bounds

    def run(self, entries: list[Entry]) -> tuple[int, int, list[tuple[str, str]]]:
        todo, twins = _twins(self._order(entries))
        self.total = sum(e.layout.numel * e.local.element_size() for e in todo)
        threads = _threads(self.files, self.man, todo, self.world)
        self.piece = PIECE if threads else LONG_PIECE
        self.pool = ThreadPoolExecutor(threads or READ_THREADS, thread_name_prefix="unickpt-read")
        try:
            early: BaseException | None = None
            try:
                for e in todo:
                    self._issue(e)
            except Exception as e:
                if self.comm is None:
                    raise
                early = e  # the others are told at the first exchange below, then this rank raises
            if self.comm is not None and not self._share(early):
                return self.files.bytes_read, self.verified, self.bad
            while self.pending:
                self._finish(*self.pending.popleft())
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.files.close()
        extra = self._check_twins(twins) if twins and not self.bad else 0
        return self.files.bytes_read + extra, self.verified, self.bad

    def _check_twins(self, twins: list[tuple[Entry, Entry]]) -> int:
        """Targets that are one memory under two keys the checkpoint stores apart (one tensor
        under two roles, a tied weight the DCP reader was given twice): the first was read
        into it; each other must hold the same bytes, else the target cannot be filled from
        this checkpoint (:class:`StateDictError`, never a mix of the two). Stored tensors with
        the same checksums hold the same bytes; others are read alone, one at a time, into a
        temporary and compared. Returns the bytes read."""
        n = 0
        for first, e in twins:
            a, b = self.man.tensors[first.key], self.man.tensors[e.key]
            if (not a.coder.coded and not b.coder.coded and a.dtype == b.dtype and a.checksums
                    and a.checksums == b.checksums):
                continue
            tmp = torch.empty_like(e.local)
            got, verified, bad = ReadSession(self.man, self.storage, self.ckpt, self.verify, None, self.rank,
                                             self.world).run([Entry(e.role, e.name, tmp, e.layout)])
            n += got
            self.verified += verified
            self.bad += [x for x in bad if x not in self.bad]
            if not bad and not torch.equal(tmp, first.local):
                raise StateDictError(f"targets {first.role}/{first.name} and {e.role}/{e.name} are the same memory, but "
                                     f"{self.ckpt} stores different values for them: load them into separate tensors "
                                     "(or tie them only once the checkpoint agrees)")
        return n

    def _order(self, entries: list[Entry]) -> list[Entry]:
        """Ranks start on different files, so concurrent readers stream different files."""
        names = sorted(self.man.files)
        first = {n: (i - self.rank * len(names) // max(self.world, 1)) % max(len(names), 1) for i, n in enumerate(names)}
        return sorted(entries, key=lambda e: (first[self.man.tensors[e.key].file], self.man.tensors[e.key].begin))

    def _issue(self, e: Entry) -> None:
        """Classify target ``e`` and issue its reads (node-shared ones wait for :meth:`_share`)."""
        st = self.man.tensors[e.key]
        if st.coder.coded:
            failed, n_checked = read_coded(e, st, self.man, self.files, self.verify)
            self.verified += n_checked
            self.bad.extend(failed)
            self._progress(e.layout.numel * e.local.element_size())
            return
        if e.layout.numel == 0:  # nothing to read (its file may not even be on this node)
            return
        isz = e.local.element_size()
        local = e.local.detach()
        direct = local.device.type == "cpu" and local.is_contiguous()
        dest = as_bytes(local) if direct else torch.empty(local.numel() * isz, dtype=torch.uint8)
        job = _Job(st, self.files.get(st.file), self.man.files[st.file].data_start + st.begin, e.layout.runs(), isz,
                   dest, local, direct)
        runs = job.runs
        if not len(runs) or not runs.numel:  # nothing to read: finished as it is
            return self._read(job)
        long = len(runs) == 1 or runs.numel * isz / len(runs) >= DIRECT_RUN
        # node-shared when it can be (read_shared decides whether the node shares): short runs,
        # and long runs read straight into the target's own memory
        be = bounds(st) if self.comm is not None and (not long or direct) else None
        if be is not None and eligible(st, isz, long, be):
            mask = touched(be, runs.starts * isz, (runs.starts + runs.lengths) * isz)
            self.shared.append(SharedJob(st, job.reader, job.base, runs, isz, dest, mask, self._done_of(job), long,
                                         local, direct))
        else:
            self._read(job)

    def _share(self, early: BaseException | None) -> bool:
        """Node-shared reads (collective); the targets the node does not share are read
        alone. False when the node's reads were aborted (another rank failed)."""
        n, alone, aborted = read_shared(self.comm, self.shared, self.man, self.files, self.pool, self.verify != "none",
                                        early is not None, self.record)
        if early is not None:
            raise early
        if aborted:
            return False
        self.verified += n
        for j in alone:
            self._read(_Job(j.st, j.reader, j.base, j.runs, j.isz, j.dest, j.local, j.direct))
        return True

    def _read(self, job: _Job) -> None:
        """Issue the pieces of ``job`` on the pool; finish earlier targets while more than
        READ_AHEAD bytes (or 256 targets) are in flight."""
        size = max(job.isz, self.piece - self.piece % job.isz)  # whole elements: each read is placed from its start
        pieces = plan_pieces(job.st, job.runs, job.isz, self.verify != "none", size, self._bounds_of(job.st))
        # (placed through a buffer only where a piece is not inside one run)
        windows = Windows(job.runs.starts, job.runs.lengths, job.runs.local) if any(p[3] < 0 for p in pieces) else None
        futs = [self.pool.submit(self._piece, job, windows, size, *p) for p in pieces]
        self.in_flight += job.nbytes
        self.pending.append((job, futs))
        while self.pending and (self.in_flight > READ_AHEAD or not self.pending[0][1] or len(self.pending) > 256):
            self._finish(*self.pending.popleft())

    def _piece(self, job: _Job, windows: Windows, size: int, b: int, e: int, ranges: list, at: int) -> tuple[bool, int]:
        """One piece, bytes ``[b, e)`` of the stored tensor, on a read thread: read ``size``
        bytes at a time, each hashed and placed before the next is read (``at >= 0``: straight
        into the target's bytes at ``at``)."""
        if e - b <= size:  # the common case: one read, its ranges hashed whole (no stream state)
            if at >= 0:
                mv = memoryview(job.dest_np[at : at + e - b])
            else:
                buf, buf_np = self._buffers(size)
                mv = memoryview(buf_np[: e - b])
            job.reader.readinto(job.base + b, mv)
            ok = True
            if ranges:
                ok = all(Hasher.of(mv[rb - b : re_ - b]) == hx for rb, re_, hx in ranges)
            if at < 0:
                copy_window(buf[: e - b], b // job.isz, e // job.isz, windows, job.dest, job.isz)
            return ok, len(ranges)
        check = StreamCheck(ranges) if ranges else None  # a range larger than a read
        if check is not None:
            check.touch(b, e)
        pos = b
        while pos < e:
            k = min(size, e - pos)
            view = job.dest[at + pos - b : at + pos - b + k] if at >= 0 else self._buffer(size)[:k]
            job.reader.readinto(job.base + pos, memoryview(view.numpy()))
            if check is not None:
                check.feed(pos, view)
            if at < 0:
                copy_window(view, pos // job.isz, (pos + k) // job.isz, windows, job.dest, job.isz)
            pos += k
        return (True, 0) if check is None else (check.ok, check.checked)

    def _bounds_of(self, st: TensorEntry):
        """:func:`bounds` of ``st``, once per stored tensor (several targets may read one)."""
        be = self._bounds.get(st.key)
        if be is None and st.checksums:
            be = self._bounds[st.key] = bounds(st)
        return be

    def _buffer(self, size: int) -> torch.Tensor:
        return self._buffers(size)[0]

    def _buffers(self, size: int) -> tuple[torch.Tensor, Any]:
        """This read thread's buffer of at least ``size`` bytes, and its numpy view."""
        got = getattr(self._local, "buf", None)
        if got is None or got[0].numel() < size:
            t = torch.empty(size, dtype=torch.uint8)
            got = self._local.buf = (t, t.numpy())
        return got

    def _done_of(self, job: _Job) -> Callable[[tuple[bool, int]], None]:
        return lambda checked: self._finish(job, [], checked)

    def _finish(self, job: _Job, futs: list, checked: tuple[bool, int] | None = None) -> None:
        """A target whose pieces are done (or that the node read, ``checked``): its checksums
        tallied, copied into the target when read into a temporary."""
        results = [f.result() for f in futs]
        self.in_flight -= job.nbytes if futs or checked is None else 0
        for ok, n in results if checked is None else [checked]:
            self._tally(job.st, (ok, n))
        if not job.direct:
            job.local.copy_(job.dest.view(job.local.dtype).reshape(job.local.shape))
        self._progress(job.nbytes)

    def _tally(self, st: TensorEntry, checked: tuple[bool, int]) -> None:
        self.verified += checked[1]
        if not checked[0] and (st.file, st.name) not in self.bad:
            self.bad.append((st.file, st.name))

    def _progress(self, n: int) -> None:
        self.done += n
        if self.progress is not None:
            self.progress(self.done, self.total)


def _twins(entries: list[Entry]) -> tuple[list[Entry], list[tuple[Entry, Entry]]]:
    """The entries to read, and ``(first, other)`` for each entry whose target is the very
    memory of an earlier one (same storage, offset, shape, strides, dtype): read once, checked
    afterwards (:meth:`ReadSession._check_twins`). Two reads into one memory would race."""
    seen: dict[tuple, Entry] = {}
    todo, twins = [], []
    for e in entries:
        t = e.local
        try:
            k = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        except (RuntimeError, NotImplementedError):
            k = None
        if k is None or t.numel() == 0 or k not in seen:
            if k is not None and t.numel():
                seen[k] = e
            todo.append(e)
        else:
            twins.append((seen[k], e))
    return todo, twins


def _threads(files: Files, man: Manifest, entries: list[Entry], world: int) -> int:
    """This rank's share of the cores (at least 1) when the sampled bytes of ``entries`` are
    in memory already (page cache, tmpfs): there more threads than cores only take turns on
    them, each evicting the others' pieces from the cache; else 0 (READ_THREADS threads with
    LONG_PIECE reads: the device gets several long requests at once). A hint: anything
    that goes wrong here (a file that will not open) is left to the reads, which report it
    where every rank learns of it."""
    try:
        got = want = 0
        for e in entries[:: max(1, -(-len(entries) // 16))]:
            st = man.tensors[e.key]
            if st.coder.coded or not e.layout.numel:
                continue
            ask = getattr(files.get(st.file), "resident", None)
            n = min(4 << 20, st.end - st.begin)
            r = ask(man.files[st.file].data_start + st.begin, n) if ask is not None else None
            if r is None:
                return 0
            got, want = got + min(r, n), want + n
        if not want or got < 0.9 * want:
            return 0
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:
            cores = os.cpu_count() or 1
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world) or 1)
        return max(1, min(READ_THREADS, cores // max(1, ranks)))
    except Exception:
        return 0


def read_all(entries, man: Manifest, storage, ckpt, verify, progress=None, rank=0, world=1, comm: Comm | None = None,
             record: dict | None = None):
    """:meth:`ReadSession.run` of a new session (see there)."""
    return ReadSession(man, storage, ckpt, verify, progress, rank, world, comm, record).run(entries)


def plan_pieces(st: TensorEntry, runs: Runs, isz: int, verify: bool, size: int,
                be: tuple[np.ndarray, np.ndarray] | None = None) -> list[tuple[int, int, list, int]]:
    """The pieces that read the runs of a raw stored tensor: ``(begin, end, ranges, at)``.

    A piece covers whole checksummed ranges that the runs touch (with ``verify``; else 1 MiB
    blocks of the tensor, unchecked), consecutive in the file and up to ``size`` bytes (a
    larger range is a piece of its own, read ``size`` bytes at a time); ``ranges`` are the
    checksums to verify (empty without ``verify``). ``at >= 0``: the piece lies inside one run
    and goes straight to byte ``at`` of the target; else it goes through a buffer (the runs
    take part of it: a column block, the ends of a run). Each range is read once."""
    rb = runs.starts * isz
    re_ = (runs.starts + runs.lengths) * isz
    nbytes = st.end - st.begin
    if verify and st.checksums:
        be = be if be is not None else bounds(st)
        sums = st.checksums
    else:
        grid = np.arange(0, max(nbytes, 1), CHECK_BLOCK, dtype=np.int64)
        be, sums = (grid, np.minimum(grid + CHECK_BLOCK, nbytes)), None
    if len(rb) == 1:  # one run (a whole tensor, a row block): the ranges it touches by two searches
        b0, e0 = int(rb[0]), int(re_[0])
        lo = int(np.searchsorted(be[1], b0, side="right")) if e0 > b0 else 0
        hi = int(np.searchsorted(be[0], e0, side="left")) if e0 > b0 else 0
        idx = np.arange(lo, max(lo, hi), dtype=np.int64)
    else:
        idx = np.flatnonzero(touched(be, rb, re_))
    if not len(idx):
        return []
    B, E = be[0][idx], be[1][idx]
    run = np.searchsorted(rb, B, side="right") - 1  # the run a range begins in (or after)
    inside = (run >= 0) & (re_[np.maximum(run, 0)] >= E)
    at = np.where(inside, runs.local[np.maximum(run, 0)] * isz + B - rb[np.maximum(run, 0)], -1)
    run = np.where(inside, run, -1)
    # a new piece where the ranges stop being adjacent, the run changes, or the piece is full
    out: list[tuple[int, int, list, int]] = []
    first = 0
    for i, (b, e, r) in enumerate(zip(B.tolist(), E.tolist(), run.tolist())):
        if i > first and (b != int(E[i - 1]) or r != int(run[first]) or e - int(B[first]) > size):
            out.append(_piece_of(B, E, idx, at, sums, first, i, isz, nbytes))
            first = i
    out.append(_piece_of(B, E, idx, at, sums, first, len(B), isz, nbytes))
    return out


def _piece_of(B, E, idx, at, sums, i: int, j: int, isz: int, nbytes: int) -> tuple[int, int, list, int]:
    b, e, a = int(B[i]), int(E[j - 1]), int(at[i])
    if a < 0:  # through a buffer: whole elements (copy_window places elements)
        b, e = b - b % isz, min(nbytes, -(-e // isz) * isz)
    return b, e, [] if sums is None else [sums[k] for k in idx[i:j].tolist()], a
