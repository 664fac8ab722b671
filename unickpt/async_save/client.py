"""The trainer's side of asynchronous saves: per rank and process group, one
:class:`Checkpointer` owns the staging segment and the writer process
(:class:`~.lifecycle.WriterLifecycle`), stages each save's state, hands the save to the
writer and reads its answer for the save's :class:`~.handle.AsyncSave`.

:func:`checkpointer` finds a group's checkpointer (by identity: ``_CHECKPOINTERS``);
:func:`shutdown` closes them all (at exit too)."""

from __future__ import annotations

import atexit
import json
import mmap
import multiprocessing.connection as mpc
import multiprocessing.util as mp_util
import os
import threading
import time
from typing import Any, Mapping

from .._metrics import log
from ..errors import AsyncSaveError, DistributedError, UnickptError, async_error
from ..saving import ProgressFn, SaveOptions
from ..state import Entry, flatten
from ..stateful import for_save
from ..transport import Comm
from .handle import AsyncSave, committed_now
from .lifecycle import WriterLifecycle
from .protocol import (AbortSave, ProgressReport, ProtocolError, Ready, SaveCommand, SaveSucceeded, StagedUpTo,
                       encode, receive, writer_path)
from .segment import StagingSegment, new_segment, segment_bytes, sweep_segments
from .staging import Staged, copy_into, place, ready_events

__all__ = ["Checkpointer", "checkpointer", "shutdown"]

ANSWER_WAIT_S = 10.0
"""Longest wait, after the pipe to the writer broke, for its answer or its exit (the cause
the failure reports)."""


class Checkpointer(WriterLifecycle):
    """Staging buffer + persistent writer process of this rank, for one process group."""

    def __init__(self, group=None, timeout_s: float | None = None) -> None:
        super().__init__(group, timeout_s)
        self._seg: StagingSegment | None = None
        self._last: AsyncSave | None = None
        self._streams: dict = {}  # CUDA device -> the stream that stages its tensors (see staging.copy_into)
        self._lock = threading.Lock()
        # (signature of the staged entries, page phase of each or None): from the writer's
        # plan of the last save of the same entries (see staging.place)
        self._phases: tuple[str, list[int | None]] | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, state_dict: Mapping[str, Any] | None = None) -> None:
        """Collective over the group: start the writer processes now, when no rank has one,
        so that the first asynchronous save does not wait for its writer to start (a fresh
        interpreter that imports torch: seconds, against milliseconds for later saves).
        ``state_dict`` (as ``unickpt.save`` takes it): also allocate and fault in the staging
        for a state of its size now, which the first save would otherwise do in the call
        (seconds per GB); not while a save is in flight (its writer and copy use the staging:
        the next save grows it if it must). The writers it starts have joined their group when
        it returns (the staging is faulted in meanwhile), so a writer that cannot (an address
        or port the nodes cannot reach, a broken interpreter) fails this call, not the first
        save. Writers started earlier, running or not, are left to the next save: it
        restarts a writer that is gone, and a pending save still reports its own failure.
        Raises :class:`~unickpt.errors.AsyncSaveError` on every rank when a writer cannot be
        started or join its group within ``timeout_s`` + a minute (the writers it started are then
        stopped on every rank; the next save starts new ones), the staging cannot be
        allocated or a peer fails; a rank whose ``state_dict`` cannot be read raises that
        error (the others AsyncSaveError quoting it)."""
        comm = Comm(self.group, timeout_s=self.timeout_s)
        started = comm.all_gather_bytes(b"0" if self._proc is None else b"1", "asynchronous save (starting the writers)")
        err: BaseException | None = None
        starting = all(f == b"0" for f in started)  # every rank takes this branch, or none
        if starting:
            self._start_writer(comm)
            err = self._start_error
        if state_dict is not None and err is None:  # while the writer starts
            try:
                entries, _ = flatten(for_save(state_dict), comm.rank, comm.world)
                size = self._place(entries).size
                if self._last is not None and not self._last.done():
                    log.info("start_async_writer: a save is in flight, so its staging is left as it is")
                else:
                    self._ensure_segment(size, fault_in=True)
            except Exception as e:
                err = e
        try:
            if starting:
                err = self._await_ready(comm, err)
            comm.agree(err, "asynchronous save (starting the writers)")
        except BaseException as e:
            if starting:  # a failure anywhere: no group of writers can be trusted to have formed
                self._stop_writer(graceful=False)
            if err is None and isinstance(e, DistributedError):  # a peer's: one error type on every rank
                raise AsyncSaveError(str(e)) from e
            raise

    def close(self, timeout: float = 120.0) -> None:
        """Finish the pending save (errors are logged; at most ``timeout`` seconds), stop the
        writer, free the segment."""
        try:
            if self._last is not None and not self._last._finished:
                try:
                    self._last.wait(timeout=timeout)
                except UnickptError as e:
                    log.warning("pending asynchronous save did not complete at shutdown: %s", e)
            self._stop_writer(graceful=True)
            self._rendezvous = None  # (its writers are gone)
        finally:  # (whatever stopping met, at interpreter exit too: the segment is not left in /dev/shm)
            if self._seg is not None:
                self._seg.close(unlink=True)
            self._seg = None

    # -- save ----------------------------------------------------------------------------------

    def save(self, state_dict: Mapping[str, Any], path, opts: SaveOptions, *, background_staging: bool = False,
             progress: ProgressFn | None = None, also: tuple = ()) -> AsyncSave:
        """Stage ``state_dict`` and hand it to this rank's writer with ``opts`` (checked
        already: see ``unickpt.save``, the entry point); collective over the group. The
        writer then writes each path of ``also`` from the same staging memory (with
        ``replicas=0``), each its own committed checkpoint."""
        if not isinstance(opts, SaveOptions):
            raise TypeError(f"opts must be a SaveOptions, got {type(opts).__name__}")
        comm = Comm(self.group, timeout_s=opts.timeout_s)
        t0 = time.perf_counter()
        self._settle_previous(comm)
        entries, json_state, staged = self._prepare(comm, state_dict)
        handle = AsyncSave(self, os.fspath(path), opts.step, progress)
        handle._signature, handle._n_entries = staged.signature, len(staged.entries)
        self._last = handle
        cmd = SaveCommand(self._seg.name, self._seg.size, staged.entries, json_state, writer_path(path),
                          [writer_path(p) for p in also],
                          comm.timeout_s,  # the writers wait for each other at most this long
                          opts, progress is not None)
        proc, conn = self._proc, self._conn

        def stage() -> None:
            self._stage(handle, cmd, entries, staged, background_staging, (proc, conn), path)

        if background_staging:
            threading.Thread(target=stage, name="unickpt-staging", daemon=True).start()
            handle.call_seconds = time.perf_counter() - t0
        else:
            stage()
            handle.call_seconds = time.perf_counter() - t0
            if handle._stage_error is not None:
                handle._surfaced = True  # the caller learns here that this save failed
                handle.wait_staged()  # raises the staging error
        return handle

    def _settle_previous(self, comm: Comm) -> None:
        """Back-pressure (one save in flight): wait for the previous save; then every rank
        learns whether any rank's previous save failed or writer is gone, and all take one
        branch: the writers are restarted, and a failure not yet raised anywhere is raised
        everywhere."""
        prev_err: BaseException | None = None
        surfaced = False
        if self._last is not None:
            surfaced = self._last._surfaced
            try:
                self._last.wait()
            except UnickptError as e:
                prev_err = e
        alive = self._proc is not None and self._proc.is_alive()
        flags = comm.all_gather_bytes(json.dumps([prev_err is not None, alive, surfaced]).encode(),
                                      "asynchronous save (the previous save and the writers)")
        states = [json.loads(f) for f in flags]
        failed = [r for r, s in enumerate(states) if s[0]]
        if failed or not all(s[1] for s in states):
            self._stop_writer(graceful=not failed and alive)
            self._last = None
            self._start_writer(comm)
            if any(not states[r][2] for r in failed):  # not yet raised somewhere: raise everywhere
                raise prev_err or AsyncSaveError(f"the previous asynchronous save failed on rank(s) {failed}")

    def _prepare(self, comm: Comm, state_dict: Mapping[str, Any]) -> tuple[list[Entry], Any, Staged]:
        """The state's entries, its JSON part and their places in a staging segment large
        enough, agreed over the group (so no writer is left waiting for a rank that failed)."""
        def prepare() -> tuple[list[Entry], Any, Staged]:
            if self._start_error is not None:
                raise self._start_error
            entries, json_state = flatten(state_dict, comm.rank, comm.world)
            staged = self._place(entries)
            staged.ready = ready_events(entries)
            self._ensure_segment(staged.size)
            return entries, json_state, staged

        return comm.step("asynchronous save (preparing the staging buffer)", prepare)  # no writer is left waiting

    def _stage(self, handle: AsyncSave, cmd: SaveCommand, entries: list[Entry], staged: Staged, background: bool,
               writer: tuple, path) -> None:
        """Copy the state into the segment and send the command: first the command when in the
        background (the writer starts on the plan, its files and what has arrived while the
        rest is copied), else after the copy (the caller waits for it: a writer working
        beside it would only slow it down). A failure is the handle's staging error."""
        t = time.perf_counter()
        try:
            if background:
                self._conn.send_bytes(encode(cmd))
                self._copy(entries, staged, self._tell_staged)
            else:
                self._copy(entries, staged)
                self._conn.send_bytes(encode(cmd))
            self._tell_staged(staged.size, done=True)
        except BaseException as e:  # surfaced by wait_staged()/wait()
            self._staging_failed(handle, e, *writer, path)
        finally:
            handle.staging_seconds = time.perf_counter() - t
            handle._staged.set()

    def _staging_failed(self, handle: AsyncSave, e: BaseException, proc, conn, path) -> None:
        """The copy or a send failed with ``e``: its cause (the writer's own answer or death,
        when the pipe broke because it ended) becomes the handle's staging error, and the
        writer is told to fail the save on every rank (or, when it cannot be told, the
        handle fails here)."""
        cause: BaseException = e
        if isinstance(e, (OSError, EOFError)) and proc is not None:  # the pipe broke: the writer ended
            # its answer (if it sent one) or its death is the cause: wait for either, bounded
            # (a writer at lower priority on a busy machine may take seconds to exit)
            deadline = time.monotonic() + ANSWER_WAIT_S
            while True:
                proc.join(timeout=0.05)
                with self._lock:
                    if not handle._finished:
                        self._read(handle, conn, proc, exited=proc.exitcode is not None)
                if handle._finished or proc.exitcode is not None or time.monotonic() > deadline:
                    break
            if handle._error is not None:
                cause = handle._error
                cause.__cause__ = cause.__cause__ or e
        handle._stage_error = cause
        try:  # the writers still meet: ours fails the save on every rank
            self._conn.send_bytes(encode(AbortSave(f"{type(e).__name__}: {e}")))
        except Exception:
            if not handle._finished:
                handle._error = AsyncSaveError(f"staging for {path} failed: {cause}")
                handle._finished = True

    def _place(self, entries: list[Entry]) -> Staged:
        """Where each entry goes in the segment (:func:`~.staging.place`, following the
        page phases of the writer's plan of the last save of the same entries)."""
        return place(entries, self._phases)

    def _ensure_segment(self, size: int, fault_in: bool = False) -> None:
        """A segment of at least ``size`` bytes (10% headroom when a new one is made:
        :func:`~.segment.segment_bytes`). ``fault_in``: also map every page of a new one into
        this process now (one write per page), which the first copy into it would otherwise
        do (at set-up, not in a save)."""
        if self._seg is not None and self._seg.size >= size:
            return
        new = segment_bytes(size)
        seg = new_segment(new)
        if fault_in:
            seg.tensor[::mmap.PAGESIZE].zero_()
        seg.pin()
        if self._seg is not None:
            # the writer may still map the old one until its next command: unlink now (the
            # mapping stays valid), close our side
            self._seg.close(unlink=True)
        self._seg = seg

    def _copy(self, entries: list[Entry], staged: Staged, tell=None) -> None:
        """Copy the entries into the segment (:func:`~.staging.copy_into`, on this
        checkpointer's device streams); ``tell(end)`` every ~``STAGE_CHUNK`` bytes copied."""
        copy_into(self._seg, entries, staged, self._streams, tell)

    def _tell_staged(self, end: int, done: bool = False) -> None:
        """Tell the writer that the segment holds the state up to byte ``end`` (a message
        on the pipe: the write is ordered after the copy, the writer's read before its use)."""
        self._conn.send_bytes(encode(StagedUpTo(int(end), done)))

    # -- results ----------------------------------------------------------------------------------

    def _poll(self, handle: AsyncSave, timeout: float | None) -> None:
        """Read the writer's messages for ``handle`` until its answer (or the writer's death),
        for at most ``timeout`` seconds (``None``: no limit; 0: only what has arrived).
        Progress reports go to the handle's callback between reads, outside the lock."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if handle._finished:
                    break
                conn, proc = self._conn, self._proc
                if conn is None or proc is None:
                    handle._error = AsyncSaveError(f"save of {handle.path}: no writer process")
                    handle._finished = True
                    break
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                ready = mpc.wait([conn, proc.sentinel], left)
                if not ready:
                    break
                self._read(handle, conn, proc, proc.sentinel in ready)
            handle._report_progress()
        handle._report_progress()

    def _read(self, handle: AsyncSave, conn, proc, exited: bool) -> None:
        """Read every message that has arrived (under the lock): progress reports are noted
        on the handle; the answer, or the pipe's end, finishes it."""
        while True:
            try:
                waiting = conn.poll()
            except OSError:  # a broken pipe is its end
                waiting, exited = False, True
            if not waiting and not exited:
                return
            msg = receive(conn) if waiting else None
            if isinstance(msg, ProgressReport):
                if handle._progress is not None:
                    handle._progress_pending.append((msg.done, msg.total))
                continue
            if isinstance(msg, Ready):  # a writer started by this save is up
                continue
            handle.total_seconds = time.perf_counter() - handle.t0
            handle._finished = True
            self._conclude(handle, msg, proc)
            return

    def _conclude(self, handle: AsyncSave, msg, proc) -> None:
        """The save's outcome from the writer's answer ``msg``: None when the pipe ended
        without one (the writer died), a ProtocolError when the answer was malformed."""
        if msg is None:
            proc.join(timeout=1.0)  # its pipe closed as it exited: let it be reaped for the code
            code = proc.exitcode
            handle._error = AsyncSaveError(
                f"save of {handle.path}: the writer process of this rank died (exit code {code}) before it "
                f"reported the outcome; {committed_now(handle.path, handle._before)}")
        elif isinstance(msg, ProtocolError):
            handle._error = AsyncSaveError(f"save of {handle.path}: the writer process sent a malformed answer "
                                           f"({msg}); the outcome is unknown here")
        elif isinstance(msg, SaveSucceeded):
            handle._result = msg.result
            handle.results = list(msg.results)
            if isinstance(msg.phases, list) and len(msg.phases) == handle._n_entries:
                self._phases = (handle._signature, msg.phases)
        elif msg.results:  # committed before an also= copy failed
            handle.results = list(msg.results)
            handle._error = async_error(msg.type, f"save of {handle.path}: {msg.error}")
        else:
            handle._error = async_error(msg.type, f"save of {handle.path} failed: {msg.error}")


_CHECKPOINTERS: list[tuple[Any, Checkpointer]] = []
"""``(group, checkpointer)``, found by identity (``is``): an ``id()`` is reused once a group
is gone, and would hand a new group the checkpointer of a destroyed one."""


def checkpointer(group=None) -> Checkpointer:
    """The process-wide checkpointer of ``group`` (created on first use). ``None`` and the
    default group are one group: one staging buffer and one set of writers for both."""
    import torch.distributed as dist

    if group is not None and dist.is_available() and dist.is_initialized() and group is dist.group.WORLD:
        group = None
    c = next((c for g, c in _CHECKPOINTERS if g is group), None)
    if c is None:
        if not _CHECKPOINTERS:
            atexit.register(shutdown)
            # a trainer that is itself a multiprocessing child skips atexit: run at its exit too
            mp_util.Finalize(None, shutdown, exitpriority=100)
            sweep_segments()
        c = Checkpointer(group)
        _CHECKPOINTERS.append((group, c))
    return c


def shutdown() -> None:
    """Wait for pending saves, stop writer processes and free staging memory."""
    while _CHECKPOINTERS:
        _, c = _CHECKPOINTERS.pop()
        try:
            c.close()
        except Exception as e:  # at exit: report, do not raise
            log.warning("closing an asynchronous checkpointer failed: %s", e)
