"""One rank's reads of one load (:class:`ReadSession`): each target classified once (coded,
direct, span, node-shared) and its bytes read, verified and placed."""

from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .._copy import Windows, as_bytes, copy_window
from ..io.files import Files
from ..io.storage import RandomReader
from ..layout import Runs
from ..manifest import Manifest, TensorEntry
from ..noderead import SharedJob, bounds, eligible, read_shared, touched
from ..state import Entry
from ..transport import Comm
from .coded import read_coded
from .verify import WINDOW, StreamCheck, verify_direct


READ_THREADS = 4  # concurrent preads per rank


READ_CHUNK = 16 << 20


READ_AHEAD = 512 << 20  # bytes of reads in flight before earlier targets are finished


DIRECT_RUN = 1 << 20  # runs at least this long are read straight into the target


SPAN_GAP = 1 << 20  # short runs this close are read in one span (the gap read and dropped)


SPAN_PIECE = 8 << 20  # bytes of one span read (column blocks, small pieces)


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

    @property
    def nbytes(self) -> int:
        return self.runs.numel * self.isz


class ReadSession:
    """Reads the targets of one load (or of one share of a DCP load) from one checkpoint.

    Each target is classified once (:meth:`_issue`): **coded** (decoded window by window,
    :func:`~unickpt.loading.coded.read_coded`), **direct** (long runs: READ_CHUNK preads
    straight into the target by READ_THREADS threads, several in flight as a sequential
    stream with read-ahead would keep the disk busy), **span** (short runs: the whole
    checksummed ranges they touch, streamed through a few buffers, :class:`SpanStream`), or
    **shared** (with ``comm``: ranks of a node whose needs overlap or interleave read them
    once through the node, :mod:`unickpt.noderead`; long runs wait for that decision, one
    small all-gather). A target is finished (copied back if needed, verified) once its reads
    are done; :meth:`run` returns ``(bytes read, checksums verified, [(file, tensor)] that
    failed)``. With ``comm`` the call is collective: every rank of it runs one session."""

    def __init__(self, man: Manifest, storage, ckpt: str, verify: str, progress=None, rank: int = 0, world: int = 1,
                 comm: Comm | None = None) -> None:
        self.man, self.verify, self.progress, self.comm = man, verify, progress, comm
        self.rank, self.world = rank, world
        self.files = Files(storage, ckpt, man)
        self.bad: list[tuple[str, str]] = []
        self.verified = 0
        self.done = 0  # bytes of targets finished (progress)
        self.total = 0
        self.pending: deque = deque()  # (job, futures, checked) of direct reads, finished in order
        self.in_flight = 0  # bytes of direct reads not finished yet
        self.verifying: list = []  # (stored tensor, future) verified on the verifier thread
        self.shared: list[SharedJob] = []  # targets read node-shared, if the node shares (with comm)
        self._scratch: torch.Tensor | None = None  # this thread's; the verifier has its own
        self._vscratch: torch.Tensor | None = None

    def run(self, entries: list[Entry]) -> tuple[int, int, list[tuple[str, str]]]:
        todo = self._order(entries)
        self.total = sum(e.layout.numel * e.local.element_size() for e in todo)
        self.pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="unickpt-read")
        # targets read straight into their memory are verified on this thread while later reads
        # proceed (xxhash releases the GIL)
        self.verifier = ThreadPoolExecutor(1, thread_name_prefix="unickpt-verify")
        self.spans = SpanStream(self.pool, READ_THREADS)
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
            self.spans.run()
            for st, fut in self.verifying:
                self._tally(st, fut.result())
        finally:
            self.pool.shutdown(wait=True)
            self.verifier.shutdown(wait=True)
            self.files.close()
        return self.files.bytes_read, self.verified, self.bad

    def _order(self, entries: list[Entry]) -> list[Entry]:
        """Ranks start on different files, so concurrent readers stream different files."""
        names = sorted(self.man.files)
        first = {n: (i - self.rank * len(names) // max(self.world, 1)) % max(len(names), 1) for i, n in enumerate(names)}
        return sorted(entries, key=lambda e: (first[self.man.tensors[e.key].file], self.man.tensors[e.key].begin))

    def _issue(self, e: Entry) -> None:
        """Classify target ``e`` and issue its reads (or queue them: spans, node-shared)."""
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
        if not len(runs) or not runs.numel:  # nothing to read: finished (verified) as it is
            return self._read_direct(job)
        long = len(runs) == 1 or runs.numel * isz / len(runs) >= DIRECT_RUN
        # node-shared when it can be (read_shared decides whether the node shares): short runs,
        # and long runs read straight into the target's own memory
        be = bounds(st) if self.comm is not None and (not long or direct) else None
        if be is not None and eligible(st, isz, long, be):
            mask = touched(be, runs.starts * isz, (runs.starts + runs.lengths) * isz)
            self.shared.append(SharedJob(st, job.reader, job.base, runs, isz, dest, mask, self._done_of(job), long,
                                         local, direct))
        elif long:
            self._read_direct(job)
        else:  # read in one stream with every other short-run target, after the targets are issued
            self.spans.add(job.reader, job.base, st, runs, isz, dest, self.verify != "none", self._done_of(job))

    def _share(self, early: BaseException | None) -> bool:
        """Node-shared reads (collective); the targets the node does not share are read
        alone. False when the node's reads were aborted (another rank failed)."""
        n, alone, aborted = read_shared(self.comm, self.shared, self.man, self.files, self.pool, self.verify != "none",
                                        early is not None)
        if early is not None:
            raise early
        if aborted:
            return False
        self.verified += n
        for j in alone:
            job = _Job(j.st, j.reader, j.base, j.runs, j.isz, j.dest, j.local, j.direct)
            if j.long:
                self._read_direct(job)
            else:
                self.spans.add(j.reader, j.base, j.st, j.runs, j.isz, j.dest, self.verify != "none", j.done)
        return True

    def _read_direct(self, job: _Job) -> None:
        """Long runs: READ_CHUNK preads straight into ``dest`` on the pool, the target
        finished (verified around them) once they are done."""
        futs = []
        isz, dest = job.isz, job.dest
        for g, ln, lo in zip(job.runs.starts.tolist(), job.runs.lengths.tolist(), job.runs.local.tolist()):
            for a in range(0, ln * isz, READ_CHUNK):
                k = min(READ_CHUNK, ln * isz - a)
                mv = memoryview(dest[lo * isz + a : lo * isz + a + k].numpy())
                futs.append(self.pool.submit(job.reader.readinto, job.base + g * isz + a, mv))
        self.in_flight += job.nbytes
        self.pending.append((job, futs, None if self.verify != "none" else (True, 0)))
        while self.pending and (self.in_flight > READ_AHEAD or not self.pending[0][1] or len(self.pending) > 256):
            self._finish(*self.pending.popleft())

    def _done_of(self, job: _Job) -> Callable[[tuple[bool, int]], None]:
        return lambda checked: self._finish(job, [], checked)

    def _finish(self, job: _Job, futs: list, checked: tuple[bool, int] | None) -> None:
        """A target whose reads are done: verified (here, or on the verifier thread when read
        straight into its memory), copied into the target when read into a temporary."""
        for f in futs:
            f.result()
        self.in_flight -= job.nbytes if futs else 0
        if checked is None and self.verify != "none":  # read straight into dest: verify around it
            args = (self.files.get(job.st.file), self.man.files[job.st.file].data_start + job.st.begin, job.st,
                    job.runs, job.isz, job.dest)
            if job.direct:
                self.verifying.append((job.st, self.verifier.submit(self._verify_on_thread, *args)))
            else:  # dest is a temporary: verify before it is copied and dropped
                if self._scratch is None:
                    self._scratch = torch.empty(WINDOW, dtype=torch.uint8)
                checked = verify_direct(*args, self._scratch)
        if checked is not None:
            self._tally(job.st, checked)
        if not job.direct:
            job.local.copy_(job.dest.view(job.local.dtype).reshape(job.local.shape))
        self._progress(job.nbytes)

    def _verify_on_thread(self, *args) -> tuple[bool, int]:
        if self._vscratch is None:
            self._vscratch = torch.empty(WINDOW, dtype=torch.uint8)
        return verify_direct(*args, self._vscratch)

    def _tally(self, st: TensorEntry, checked: tuple[bool, int]) -> None:
        self.verified += checked[1]
        if not checked[0]:
            self.bad.append((st.file, st.name))

    def _progress(self, n: int) -> None:
        self.done += n
        if self.progress is not None:
            self.progress(self.done, self.total)


def read_all(entries, man: Manifest, storage, ckpt, verify, progress=None, rank=0, world=1, comm: Comm | None = None):
    """:meth:`ReadSession.run` of a new session (see there)."""
    return ReadSession(man, storage, ckpt, verify, progress, rank, world, comm).run(entries)


def span_pieces(st: TensorEntry, runs: Runs, isz: int, verify: bool) -> tuple["StreamCheck", list[tuple[int, int]]]:
    """Short runs (column blocks, small pieces): the byte pieces to read, the whole
    checksummed ranges the runs touch (merged when they overlap or lie within SPAN_GAP: one
    read, not many), cut at SPAN_PIECE; and the check that verifies them as they stream."""
    check = StreamCheck(st.checksums if verify else ())
    s_el, l_el = runs.starts, runs.lengths
    e_el = s_el + l_el
    bs, es = check.touch_runs(s_el * isz, e_el * isz)  # widened to whole checksummed ranges
    cut = np.flatnonzero(bs[1:] > np.maximum.accumulate(es)[:-1] + SPAN_GAP) + 1
    firsts, lasts = np.concatenate(([0], cut)), np.concatenate((cut, [len(bs)])) - 1
    span_b, span_e = bs[firsts], np.maximum.accumulate(es)[lasts]
    cap = (SPAN_PIECE // isz) * isz
    pieces = []
    for b, e in zip(span_b.tolist(), span_e.tolist()):
        pos, e = (b // isz) * isz, -(-e // isz) * isz
        while pos < e:
            pieces.append((pos, min(cap, e - pos)))
            pos += pieces[-1][1]
    return check, pieces


class SpanStream:
    """The span reads of every short-run target, as one stream: up to ``depth`` pieces are
    read by the pool ahead of the one being verified and scattered (in order, on the calling
    thread), across target boundaries, so the disk never waits for the hashing, the
    scattering or the start of the next tensor. Memory: ``depth + 1`` buffers of
    SPAN_PIECE bytes, reused."""

    def __init__(self, pool, depth: int) -> None:
        self.pool, self.depth = pool, max(1, depth)
        self.bufs: list[torch.Tensor] = []  # allocated by the first run that reads
        self.jobs: list = []  # (reader, base, Windows of the runs, isz, dest, check, pieces, done)

    def add(self, reader, base: int, st: TensorEntry, runs: Runs, isz: int, dest: torch.Tensor, verify: bool,
            done: Callable[[tuple[bool, int]], None]) -> None:
        check, pieces = span_pieces(st, runs, isz, verify)
        self.jobs.append((reader, base, Windows(runs.starts, runs.lengths, runs.local), isz, dest, check, pieces, done))

    def run(self) -> None:
        order = [(j, n) for j, job in enumerate(self.jobs) for n in range(len(job[6]))]
        if order and not self.bufs:
            self.bufs = [torch.empty(SPAN_PIECE, dtype=torch.uint8) for _ in range(self.depth + 1)]
        flight: deque = deque()

        def submit(k: int) -> None:
            j, n = order[k]
            reader, base, pieces = self.jobs[j][0], self.jobs[j][1], self.jobs[j][6]
            pos, size = pieces[n]
            buf = self.bufs[k % len(self.bufs)][:size]
            flight.append(self.pool.submit(reader.readinto, base + pos, memoryview(buf.numpy())))

        for k in range(min(self.depth, len(order))):
            submit(k)
        for k, (j, n) in enumerate(order):
            flight.popleft().result()
            if k + self.depth < len(order):
                submit(k + self.depth)
            _, _, windows, isz, dest, check, pieces, done = self.jobs[j]
            pos, size = pieces[n]
            buf = self.bufs[k % len(self.bufs)][:size]
            check.feed(pos, buf)
            copy_window(buf, pos // isz, (pos + size) // isz, windows, dest, isz)
            if n == len(pieces) - 1:
                done((check.ok, check.checked))
        for job in self.jobs:  # targets without any piece (nothing to read)
            if not job[6]:
                job[7]((job[5].ok, job[5].checked))
        self.jobs.clear()

