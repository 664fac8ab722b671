"""The writer process: what runs in it, from :func:`main` (started by the trainer through
:mod:`unickpt._writer_main`, see :mod:`.lifecycle`) to its exit.

It joins its own gloo group with the other ranks' writers (met on the rendezvous its
trainers serve, :mod:`.rendezvous`), then serves its trainer's commands (:mod:`.protocol`)
one at a time: each save maps the staging segment by name (:mod:`.segment`) and runs the
ordinary synchronous save from it. While a save's copy still streams in, every read of an
entry's bytes waits for them (:class:`_StagingGate`); progress goes back from a thread of
its own (:class:`_ProgressSender`). It blocks on its pipe while idle and dies with its
trainer: a watchdog thread notices the trainer's death (:class:`_Parent`) and frees the
trainer's staging memory."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

import torch

from .. import liveness
from ..errors import AsyncSaveError, InvalidArgumentError
from ..format import torch_dtype
from ..io.local import FROM_MEMORY_MIN
from ..saving import SaveResult, save_entries
from ..state import Entry
from ..transport import Comm
from . import rendezvous
from .protocol import (AbortSave, ExitWriter, ProgressReport, Ready, SaveCommand, SaveFailed, SaveSucceeded,


                       StagedEntry, StagedUpTo, decode_command, encode)
from .segment import ALIGN, SHM_DIR, StagingSegment, sweep_segments

__all__ = ["main", "PROGRESS_INTERVAL"]

PROGRESS_INTERVAL = 0.1  # seconds between a writer's progress reports (plus the final one)

NICE = 10
"""How much lower the writer's CPU priority is than its trainer's (``UNICKPT_WRITER_NICE``; 0
keeps the trainer's). Where the cores are busy, training gets them first and the writer about a
tenth of a core's share (Linux weights 1024 against 110): a save takes longer, training barely
slows; where they are idle (a GPU job's host), the writer runs at full speed."""


def writer_nice() -> int:
    """``UNICKPT_WRITER_NICE`` (default :data:`NICE`), checked: the trainer calls it before
    starting a writer, so a bad value is its error, not a writer that never starts."""
    raw = os.environ.get("UNICKPT_WRITER_NICE", str(NICE))
    try:
        k = int(raw)
    except ValueError:
        k = -1
    if not 0 <= k <= 19:
        raise InvalidArgumentError(f"UNICKPT_WRITER_NICE must be an integer 0..19, got {raw!r}")
    return k


def yield_to_training() -> int:
    """Lower this process's priority by :func:`writer_nice`; returns the increment applied (0
    when the variable says so, or the system refuses)."""
    k = writer_nice()
    if k:
        try:
            os.nice(k)
        except OSError:
            return 0
    return k


def main(conn, rank: int, world: int, addr: str, port: int, timeout_s: float, parent_pid: int, node,
         joined_w: int = -1, gate: str = "") -> None:
    """The writer process of rank ``rank`` of ``world``: join the writers' group (at
    ``addr:port``, through gate ``gate``; a byte on ``joined_w`` tells the trainer it has),
    say :class:`~.protocol.Ready`, serve the trainer's commands until it says exit, fails a
    save, or dies."""
    if joined_w >= 0:
        os.set_inheritable(joined_w, False)  # ours alone, as the pipe's other fds (see _writer_main.main)
    if node and "UNICKPT_NODE_ID" not in os.environ:
        os.environ["UNICKPT_NODE_ID"] = node
    torch.set_num_threads(1)
    yield_to_training()  # before any thread starts: they inherit it
    parent = _Parent(parent_pid)
    liveness.act_for(parent.pid, parent.started)  # our transactions' owner records name the trainer too
    segments: dict[str, StagingSegment] = {}
    threading.Thread(target=_watch_parent, args=(parent, segments), daemon=True).start()
    _handle_signals(segments)
    if not _join_group(conn, rank, world, addr, port, timeout_s, gate):
        return
    if joined_w >= 0:  # tell our trainer's rendezvous.watch_joining
        os.write(joined_w, b"1")
        os.close(joined_w)
    _reply(conn, Ready())  # awaited by Checkpointer.start(); skipped by a save's reader
    _serve(conn, Comm(None, timeout_s=timeout_s), rank, timeout_s, parent, segments)
    _leave(segments)


def _handle_signals(segments: dict) -> None:
    def on_term(signum, frame):  # the parent's multiprocessing terminates us at its exit
        for seg in list(segments.values()):
            try:
                os.unlink(os.path.join(SHM_DIR, seg.name))
            except FileNotFoundError:
                pass
        os._exit(4)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the trainer, which may wait for us


def _join_group(conn, rank: int, world: int, addr: str, port: int, timeout_s: float, gate: str) -> bool:
    """Join the writers' gloo group; on failure, say why to the trainer and return False."""
    import datetime

    import torch.distributed as dist

    try:
        # an explicit store, served by rank 0's trainer (rendezvous.serve): under torchrun,
        # TORCHELASTIC_USE_AGENT_STORE would otherwise make every writer a client of a store
        # that nobody serves
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(addr, port, None, is_master=False, timeout=timeout)
        rendezvous.pass_gate(store, world, gate, timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    except Exception as e:
        _reply(conn, SaveFailed(f"writer group setup failed: {e}"))
        return False
    return True


def _leave(segments: dict) -> None:
    import torch.distributed as dist

    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    for seg in segments.values():
        seg.close(unlink=False)


def _serve(conn, comm: Comm, rank: int, timeout_s: float, parent: "_Parent", segments: dict) -> None:
    """The trainer's commands, one at a time, until exit, a failed save (the writers' group
    may be broken: the trainer restarts us) or the pipe's end (the trainer died)."""
    while True:
        try:
            raw = conn.recv_bytes()
        except (EOFError, OSError):
            _orphaned(parent, segments)  # the watchdog may not have looked yet
            return  # parent gone
        try:
            cmd = decode_command(raw)
        except Exception as e:  # not a command (ProtocolError), or options that do not check out
            _reply(conn, SaveFailed(f"{type(e).__name__}: {e}", type(e).__name__))
            return
        if isinstance(cmd, ExitWriter):
            return
        if isinstance(cmd, AbortSave):  # staging failed on our rank: fail this save on every writer
            try:
                comm.agree(AsyncSaveError(f"staging failed on rank {rank}: {cmd.error}"),
                           "save (reading the state dict)")
            except Exception as e:
                _reply(conn, SaveFailed(f"{type(e).__name__}: {e}"))
            return
        if not isinstance(cmd, SaveCommand):  # (a copy's word with no save to go with it)
            _reply(conn, SaveFailed(f"ProtocolError: {cmd.OP!r} outside a save", "ProtocolError"))
            return
        if not _save(conn, cmd, comm, rank, timeout_s, parent, segments):
            return


def _save(conn, cmd: SaveCommand, comm: Comm, rank: int, timeout_s: float, parent: "_Parent",
          segments: dict) -> bool:
    """Run one save command and answer it; False if it failed (the loop then ends)."""
    results: list[SaveResult] = []  # committed by this command (also= copies after the first)
    failed_at = cmd.path
    try:
        comm.timeout_s = float(cmd.timeout_s or timeout_s)
        entries = _entries(_map_segment(segments, cmd), cmd.entries)
        gate = _StagingGate(conn, {s.key: s.offset for s in cmd.entries}, cmd.segment_size, comm.timeout_s, rank)
        sender = _ProgressSender(conn) if cmd.progress else None
        phases: list[int | None] = [None] * len(entries)
        planned = _phase_recorder(entries, phases, rank)
        try:  # staging follows the page phases of the last checkpoint (the durable one, if any)
            results.append(save_entries(comm, (entries, cmd.state), None, cmd.path, cmd.opts, sender,
                                        None if cmd.also else planned, gate))
            for i, other in enumerate(cmd.also):  # e.g. the durable copy of a memory snapshot
                failed_at = other
                results.append(save_entries(comm, (entries, cmd.state), None, other,
                                            dataclasses.replace(cmd.opts, replicas=0), None,
                                            planned if i == len(cmd.also) - 1 else None))
        finally:
            if sender is not None:
                sender.close()  # its last report goes before our answer
            copied = gate.close()  # the pipe carries the trainer's next command only after its copy's end
            if gate.pipe_closed:  # the trainer died mid-copy: the gate read the pipe's end, not our loop
                _orphaned(parent, segments)
        if not copied:
            raise AsyncSaveError(f"rank {rank}: the trainer did not finish staging within {comm.timeout_s} s")
        _reply(conn, SaveSucceeded(results[0], results, phases))
        return True
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
        if results:  # committed before an also= copy failed: said, and their results kept
            error = f"{', '.join(r.path for r in results)} committed; the copy at {failed_at} failed: {error}"
        _reply(conn, SaveFailed(error, type(e).__name__, tuple(results)))
        return False


def _map_segment(segments: dict, cmd: SaveCommand) -> StagingSegment:
    """The command's segment, mapped (once: the trainer reuses it until it grows; the old
    one is unmapped then)."""
    seg = segments.get(cmd.segment)
    if seg is None:
        for old in segments.values():
            old.close(unlink=False)
        segments.clear()
        seg = segments[cmd.segment] = StagingSegment(cmd.segment, cmd.segment_size, create=False)
    return seg


def _entries(seg: StagingSegment, staged: list[StagedEntry]) -> list[Entry]:
    """The state's entries, their tensors views of the segment."""
    out = []
    for s in staged:
        dt = torch_dtype(s.dtype)
        local = seg.tensor[s.offset : s.offset + s.nbytes].view(dt) if s.nbytes else torch.empty(0, dtype=dt)
        out.append(Entry(s.role, s.name, local, s.layout, s.aliases, s.per_rank))
    return out


def _phase_recorder(entries: list[Entry], phases: list, rank: int):
    """The save's ``planned`` hook: notes in ``phases`` the page phase the plan gives each
    large entry in its file, which the trainer's next staging of the same entries follows."""

    def planned(plan) -> None:
        want = plan.page_phases(rank, ALIGN)
        for i, e in enumerate(entries):
            p = want.get(e.key)
            if p is not None and e.local.numel() * e.local.element_size() >= FROM_MEMORY_MIN \
                    and p % e.local.element_size() == 0:
                phases[i] = p

    return planned


def _reply(conn, msg) -> None:
    try:
        conn.send_bytes(encode(msg))
    except (OSError, BrokenPipeError):
        pass


# -- the trainer's death ------------------------------------------------------------------------------


class _Parent:
    """The trainer that started this writer, named as :mod:`unickpt.liveness` names a process
    (its pid and start time): gone once this writer has been re-parented or it no longer runs."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.started = liveness.start_time(pid)

    def gone(self) -> bool:
        return os.getppid() != self.pid or not liveness.runs(self.pid, self.started)


def _free_parent_segments(segments: dict) -> None:
    """The parent is gone: unlink its staging segments (those this writer maps, and any
    other it created, which no process holds now: :func:`~.segment.sweep_segments`), so no
    shared memory outlives the job."""
    for name in {seg.name for seg in list(segments.values()) if getattr(seg, "name", None)}:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except OSError:
            pass
    sweep_segments()


def _watch_parent(parent: _Parent, segments: dict) -> None:
    while True:
        time.sleep(0.2)
        try:
            gone = parent.gone()
        except Exception:  # (/proc unreadable for a moment: look again, never stop watching)
            continue
        if gone:
            _free_parent_segments(segments)
            os._exit(3)


def _orphaned(parent: _Parent, segments: dict, wait: float = 2.0) -> None:
    """Our pipe closed without an exit command: the parent died (its files close before its
    children are re-parented, so give that a moment); free its staging memory."""
    deadline = time.monotonic() + wait
    while not parent.gone():
        if time.monotonic() > deadline:
            return  # still there (it closed the pipe itself): its segments are its own business
        time.sleep(0.02)
    _free_parent_segments(segments)


# -- the helpers' threads -----------------------------------------------------------------------------


class _StagingGate:
    """How far the trainer's copy into the segment has got, for the save it started before
    copying (:meth:`~.client.Checkpointer.save`): a thread reads the trainer's
    :class:`~.protocol.StagedUpTo` messages (or :class:`~.protocol.AbortSave`) until the
    copy's end, and :meth:`wait` holds a read of an entry's bytes until they are in place
    (the :class:`~unickpt.saving.StagedBytes` of the save). Bounded: a copy that stops
    arriving fails the read after ``timeout_s``."""

    def __init__(self, conn, offsets: dict, size: int, timeout_s: float, rank: int) -> None:
        self._conn, self._offsets, self._size = conn, offsets, size
        self._timeout, self._rank = timeout_s, rank
        self._cv = threading.Condition()
        self._end = 0
        self._done = False
        self._error: str | None = None
        self.pipe_closed = False  # the trainer's end closed (it died): the writer frees its segments
        self._thread = threading.Thread(target=self._run, name="unickpt-staging-gate", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        error = None
        while error is None:
            try:
                raw = self._conn.recv_bytes()
            except (EOFError, OSError) as e:
                error = f"the trainer's pipe closed during staging ({type(e).__name__})"
                self.pipe_closed = True
                break
            try:
                msg = decode_command(raw)
            except Exception as e:  # (ProtocolError, or a save command whose options do not check out)
                error = f"malformed message during staging: {e}"
                break
            if isinstance(msg, StagedUpTo):
                with self._cv:
                    self._end = max(self._end, msg.end)
                    self._done = msg.done
                    self._cv.notify_all()
                if self._done:
                    return
            elif isinstance(msg, AbortSave):
                error = msg.error
            else:
                error = f"unexpected message {msg.OP!r} during staging"
        with self._cv:
            self._error = error
            self._cv.notify_all()

    def _wait_for(self, ready) -> None:
        deadline = time.monotonic() + self._timeout
        with self._cv:
            while not ready():
                if self._error is not None:
                    raise AsyncSaveError(f"staging failed on rank {self._rank}: {self._error}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AsyncSaveError(f"rank {self._rank}: the trainer's copy into staging reached byte "
                                         f"{self._end} of {self._size} and no further within {self._timeout} s")
                self._cv.wait(left)

    def wait(self, key, nbytes: int) -> None:
        off = self._offsets.get(key)
        end = self._size if off is None else off + int(nbytes)
        self._wait_for(lambda: self._done or self._end >= end)

    def wait_all(self) -> None:
        self._wait_for(lambda: self._done)

    def close(self) -> bool:
        """Wait (bounded) for the copy's end; False if the trainer never finished it."""
        self._thread.join(self._timeout)
        return not self._thread.is_alive()


class _ProgressSender:
    """The progress callback of a writer's save: the save's thread only records the latest
    ``(done, total)``; this thread sends it to the trainer at most every
    :data:`PROGRESS_INTERVAL` seconds and sends the last one at :meth:`close`. A trainer
    that does not read its pipe can block this thread, never the save (and its peers)."""

    def __init__(self, conn, interval: float = PROGRESS_INTERVAL) -> None:
        self._conn, self._interval = conn, interval
        self._cv = threading.Condition()
        self._latest: tuple[int, int] | None = None
        self._sent: tuple[int, int] | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="unickpt-progress", daemon=True)
        self._thread.start()

    def __call__(self, done: int, total: int) -> None:
        with self._cv:
            self._latest = (int(done), int(total))
            self._cv.notify()

    def _run(self) -> None:
        last = -float("inf")
        while True:
            with self._cv:
                while True:
                    if self._latest != self._sent:
                        delay = 0.0 if self._closed else last + self._interval - time.monotonic()
                        if delay <= 0:
                            break
                        self._cv.wait(delay)  # close() wakes us to send the last value now
                    elif self._closed:
                        return
                    else:
                        self._cv.wait()
                v = self._sent = self._latest
            _reply(self._conn, ProgressReport(v[0], v[1]))
            last = time.monotonic()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join()
