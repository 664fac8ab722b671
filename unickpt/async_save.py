"""Asynchronous save: the caller only copies its state into shared memory.

Per rank, one :class:`Checkpointer` owns

* a **staging buffer**: a shared-memory segment (``/dev/shm/unickpt-stage-<pid>-<token>``, :mod:`unickpt.shm`) allocated
  once and reused, grown when the state grows; registered as pinned memory with CUDA
  (``cudaHostRegister``) when CUDA is available, so device-to-host copies run at full speed;
* a **persistent writer process** (started on first use as a fresh interpreter running
  :mod:`unickpt._writer_main`: the trainer's ``__main__`` is never imported in it, so
  scripts need no ``if __name__ == "__main__":`` guard) that maps the segment and runs the
  ordinary synchronous save from it, on **its own gloo process group** with the other ranks'
  writers (the trainer's group is never used from the background). It blocks on its pipe
  while idle and dies with its parent (a watchdog thread notices the parent's death).

A save is committed by the writers' group exactly as a synchronous save is: visible only
once every rank's data is durable. If a writer fails or is killed, every other writer's
collective fails (gloo sees the closed connection; ``timeout_s`` bounds the rest: a hung
writer fails the others within it, see :mod:`unickpt.transport`), nothing is
committed, and every rank raises :class:`~unickpt.errors.AsyncSaveError` at its next
``save()`` or ``wait()``; the writers are then restarted on the next save.

With ``background_staging`` the staging streams: the trainer sends the save's command first,
then copies its state into the segment in segment order and tells the writer how far it has
got every ~32 MiB (``{"op": "staged"}`` messages, the last with ``done``; ``{"op": "abort"}``
if the copy fails). The writer plans, creates its files and writes what has arrived while the
rest is copied: every read of an entry's bytes waits for them (:class:`_StagingGate`, bounded
by the save's timeout), and the save commits only after the whole copy has arrived on every
rank. Staging in the call copies first and then sends the command (followed by ``done``):
there the caller waits for the copy, and a writer working beside it slows the copy about as
much as it shortens the durable time (docs/async.md).

Back-pressure: a save first waits for the previous one (one staging buffer: extra host
memory = the local state's size + the writer's bounded buckets).

Commands travel as JSON over a pipe (the options as :meth:`SaveOptions.to_json`); tensors
only through the shared segment. Nothing is pickled. With a ``progress`` callback the writer
also sends ``{"op": "progress"}`` reports over the pipe (at most ~10 a second, then the final
one, from a thread of its own, so a trainer that does not read them never stalls the save);
the callback runs, for each report in order, in the trainer's thread that polls the handle.

This module uses the save pipeline (:mod:`unickpt.saver`); the pipeline never imports it.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import json
import mmap
import multiprocessing.connection as mpc
import multiprocessing.util as mp_util
import select
import signal
import os
import stat
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from . import shm
from ._metrics import log
from ._writer_main import BOOT
from .errors import AsyncSaveError, DistributedError, InvalidArgumentError, UnickptError, async_error
from .format import dtype_name, torch_dtype
from .layout import Layout
from .manifest import MANIFEST_NAME
from .saving import ProgressFn, SaveOptions, SaveResult, save_entries
from .state import Entry, flatten
from .stateful import for_save
from .storage import FROM_MEMORY_MIN
from .transport import Comm, resolve_timeout

__all__ = ["AsyncSave", "Checkpointer", "checkpointer", "shutdown"]

SHM_DIR = shm.SHM_DIR
ALIGN = 4096
PROGRESS_INTERVAL = 0.1  # seconds between a writer's progress reports (plus the final one)
STAGE_CHUNK = 32 << 20  # the trainer tells its writer how far the copy has got every ~this many bytes
READY_SLICE = 0.1  # seconds start() waits for its own writer between two all-gathers of every rank's state
WRITER_BOOT_S = 60.0  # start() allows a writer this long to start its interpreter, beyond timeout_s for its group
_READY = {"op": "ready"}  # a writer's first message once it has joined the writers' group
_READY_RAW = json.dumps(_READY).encode()  # the same, as _reply sends it


def sweep_segments() -> list[str]:
    """Unlink staging segments (and node-read buffers) of this user that no live process
    holds (:func:`unickpt.shm.sweep`: by the kernel's lock, not by pid)."""
    return shm.sweep(SHM_DIR)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _new_segment(size: int) -> "_Segment":
    """A staging segment under a new name (:func:`unickpt.shm.new_name`; a name taken by
    anyone, a dead process of the same pid or another user, is never reused)."""
    for _ in range(7):
        try:
            return _Segment(shm.new_name("stage"), size, create=True)
        except FileExistsError:
            continue
    return _Segment(shm.new_name("stage"), size, create=True)


class _Segment:
    """A named shared-memory segment (:mod:`unickpt.shm`), mapped in this process. The
    creator keeps the descriptor that holds the segment's lock until :meth:`close`."""

    def __init__(self, name: str, size: int, create: bool) -> None:
        self.name, self.size = name, size
        path = os.path.join(SHM_DIR, name)
        self._fd = -1
        fd = shm.create(path) if create else shm.open_existing(path, size)
        try:
            if create:
                try:  # reserve the pages now: a full tmpfs would otherwise SIGBUS the copy
                    os.posix_fallocate(fd, 0, size)
                except OSError as e:
                    os.close(fd)
                    fd = -1
                    os.unlink(path)
                    raise AsyncSaveError(
                        f"cannot reserve {size} bytes of shared memory in {SHM_DIR} for the staging buffer "
                        f"({e.strerror}); enlarge {SHM_DIR} or save synchronously"
                    ) from e
            self.mm = mmap.mmap(fd, size)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        if create:
            self._fd = fd  # holds the lock: the segment is alive while this process is
        else:
            os.close(fd)
        self.tensor = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.pinned = False

    def pin(self) -> None:
        if torch.cuda.is_available() and not self.pinned:
            rc = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.size, 0)
            self.pinned = int(rc) == 0 if not isinstance(rc, tuple) else int(rc[0]) == 0

    def close(self, unlink: bool) -> None:
        if self.pinned:
            try:
                torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            except Exception:
                pass
        self.tensor = None  # type: ignore[assignment]
        try:
            self.mm.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with it
            pass
        if unlink:
            try:
                os.unlink(os.path.join(SHM_DIR, self.name))
            except FileNotFoundError:
                pass
        if self._fd >= 0:
            os.close(self._fd)  # (releases the lock)
            self._fd = -1


@dataclass
class _Staged:
    entries: list[list]
    size: int
    signature: str  # what the entries are, without where they sit (see Checkpointer._layout)
    # per CUDA device of the state: an event on the caller's current stream at the save (see _ready)
    ready: dict = dataclasses.field(default_factory=dict)


def _ready(entries: list[Entry]) -> dict:
    """An event recorded, in the caller's thread, on the current stream of each device that
    holds a staged tensor: the copies wait for the work queued before the save (the step
    that produced the state) and for nothing the caller queues after it."""
    out: dict = {}
    for e in entries:
        dev = e.local.device
        if dev.type == "cuda" and dev not in out:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(dev))
            out[dev] = ev
    return out


class AsyncSave:
    """Handle of one asynchronous save."""

    def __init__(self, owner: "Checkpointer", path: str, step: int | None, progress: ProgressFn | None = None) -> None:
        self._owner = owner
        self.path, self.step = path, step
        self._progress = progress
        self._progress_pending: collections.deque[tuple[int, int]] = collections.deque()  # read, not yet told
        self._progress_busy = False  # a thread is in the callback (a poll from inside it adds nothing)
        self._progress_lock = threading.Lock()
        self.t0 = time.perf_counter()
        self.call_seconds = 0.0  # inside save(): back-pressure wait (+ the copy unless in background)
        self.staging_wait_seconds = 0.0  # inside wait_staged()/wait() waiting for a background copy
        self.staging_seconds = 0.0  # duration of the copy itself
        self._staged = threading.Event()
        self._stage_error: BaseException | None = None
        self._result = None
        self.results: list = []  # one SaveResult per path written (the path, then ``also``)
        self._error: BaseException | None = None
        self._finished = False
        self._surfaced = False  # the error was raised to the caller once
        self.total_seconds: float | None = None
        self._signature = ""  # of the staged entries (Checkpointer._layout)
        self._n_entries = 0
        self._before = _manifest_stat(path)  # what stood at the path (an overwrite): told from this save's

    # -- staging -------------------------------------------------------------------------

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until the state has been copied into staging (the tensors may change after);
        at most ``timeout`` seconds (``None``: no limit), then :class:`AsyncSaveError`."""
        if not self._staged.is_set():
            t = time.perf_counter()
            copied = self._staged.wait(timeout)
            self.staging_wait_seconds += time.perf_counter() - t
            if not copied:
                raise AsyncSaveError(f"staging for {self.path} still running after {timeout} s")
        if self._stage_error is not None:
            self._surfaced = True  # the caller learns here that this save failed (the next save need not say it again)
            raise AsyncSaveError(f"staging for {self.path} failed: {self._stage_error}") from self._stage_error

    def staged(self) -> bool:
        return self._staged.is_set()

    @property
    def blocking_seconds(self) -> float:
        """Time the caller was held: the call itself plus any wait for a background copy."""
        return self.call_seconds + self.staging_wait_seconds

    # -- progress (called by the polling thread, never under the checkpointer's lock) ------------

    def _report_progress(self) -> None:
        """Give the callback the reports read so far, in order (the writer sends at most
        ~10 a second). A callback that raises is logged and not called again (as in a
        synchronous save); one that polls this handle itself only queues reports (this loop
        then gives them), so it cannot recurse or deadlock."""
        fn = self._progress
        if fn is None:
            return
        with self._progress_lock:
            if self._progress_busy:
                return
            self._progress_busy = True
        try:
            while True:
                with self._progress_lock:
                    if self._progress is None or not self._progress_pending:
                        self._progress_pending.clear()
                        self._progress_busy = False
                        return
                    v = self._progress_pending.popleft()
                try:
                    fn(*v)
                except Exception as e:  # a callback must not take the save down
                    log.warning("progress callback failed (not called again): %s", e)
                    self._progress = None
        except BaseException:
            with self._progress_lock:
                self._progress_busy = False
            raise

    # -- completion ------------------------------------------------------------------------

    def done(self) -> bool:
        """True once the writer has finished (successfully or not); never blocks."""
        if not self._finished:
            self._owner._poll(self, timeout=0)
        return self._finished

    @property
    def error(self) -> BaseException | None:
        self.done()
        return self._error

    def wait(self, timeout: float | None = None):
        """Block until the checkpoint is durable and committed; return its SaveResult.

        Raises :class:`AsyncSaveError` if it failed on any rank or a writer died, or if it is
        not over after ``timeout`` seconds (a background copy included).
        """
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout >= 0):
            raise InvalidArgumentError(f"timeout must be a number of seconds >= 0 or None, got {timeout!r}")
        deadline = None if timeout is None else time.monotonic() + timeout
        self.wait_staged(timeout)
        if not self._finished:
            self._owner._poll(self, timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
        if not self._finished:
            raise AsyncSaveError(f"save of {self.path} still running after {timeout} s")
        if self._error is not None:
            self._surfaced = True
            raise self._error
        return self._result


def segment_bytes(size: int) -> int:
    """Bytes of the staging segment made for a layout of ``size`` bytes (10% headroom, whole pages)."""
    return max(ALIGN, -(-int(size * 1.1) // ALIGN) * ALIGN)


def staging_bytes(entries: list[Entry]) -> int:
    """The most shared memory a rank's staging takes for ``entries`` (a memory budget's share):
    the segment for their bytes with every entry's alignment at its widest (a page phase)."""
    size = sum(e.local.numel() * e.local.element_size() for e in entries) + len(entries) * (ALIGN - 1)
    return segment_bytes(-(-size // 64) * 64)


def _serve_rendezvous(timeout_s: float):
    """The writers' rendezvous, served by the trainer of the group's rank 0: a TCP store that
    listens on every interface, on a port the kernel picks at bind time and this process
    holds from then on (no port is picked, released and bound again later by another
    process, which a third could take in between). One per group of writers: a new group
    (a restart) gets a new store, and the old one's keys (~170 bytes + 8 per rank, per
    rank) go with it. Its own client connects over the loopback, which always answers."""
    import datetime

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def _rendezvous_addr() -> str:
    """Where the other ranks' writers reach this host (the trainer of the group's rank 0):
    ``UNICKPT_WRITER_ADDR`` when set (for hosts the others reach at an address of their
    own, e.g. behind a NAT); else ``MASTER_ADDR`` (default 127.0.0.1) when this is the
    job's rank 0, whose host that is; otherwise (the rank 0 of a subgroup) this host's own
    address on its route to ``MASTER_ADDR`` (a UDP socket's local address once connected:
    nothing is sent)."""
    import socket

    import torch.distributed as dist

    if os.environ.get("UNICKPT_WRITER_ADDR"):
        return os.environ["UNICKPT_WRITER_ADDR"]
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if not dist.is_initialized() or dist.get_rank() == 0:
        return master
    try:
        for family, kind, proto, _, sockaddr in socket.getaddrinfo(master, 9, type=socket.SOCK_DGRAM):
            with socket.socket(family, kind, proto) as s:
                s.connect(sockaddr)
                return s.getsockname()[0]
    except OSError as e:
        log.warning("cannot find this host's address towards MASTER_ADDR %s (%s): the writers will look for "
                    "their rendezvous there", master, e)
    return master


#: variables a launcher (torchrun, torch.distributed.launch) sets for a trainer: a writer
#: gets none of them (it joins only its own writers' group, from explicit arguments)
_LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_LAUNCHER_ENV_PREFIXES = ("TORCHELASTIC_",)


def _writer_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV and not k.startswith(_LAUNCHER_ENV_PREFIXES)}
    # torch's C++ log lines carry a stack trace each (an unreachable rendezvous printed ~30
    # lines per retry and writer); the writer's errors reach the trainer typed, with their
    # message. A TORCH_CPP_LOG_LEVEL of the caller's own is kept.
    env.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    return env


class _WriterProcess:
    """A writer process started as a fresh interpreter (:mod:`unickpt._writer_main`), with
    the part of :class:`multiprocessing.Process`'s interface the checkpointer uses.

    Not ``multiprocessing``'s spawn: that re-imports the trainer's main module in the child,
    which re-runs a script without an ``if __name__ == "__main__":`` guard (the usual
    torchrun script) and makes the writer join the training job. Here the child imports only
    the writer's own modules (through the trainer's ``sys.path``) and gets no launcher
    variables. The command channel is ``multiprocessing``'s own duplex pipe (a socket pair
    wrapped in ``Connection``; one end inherited by the child); :attr:`sentinel` is the read
    end of a pipe whose only write end the child holds: readable once the child has exited,
    however it ended (``Process.sentinel``'s mechanism)."""

    def __init__(self, popen: subprocess.Popen, sentinel: int) -> None:
        self._popen, self.sentinel, self.pid = popen, sentinel, popen.pid

    @classmethod
    def start(cls, target, args: tuple, pass_fds: tuple[int, ...] = ()) -> tuple["_WriterProcess", mpc.Connection]:
        module, name = getattr(target, "__module__", None), getattr(target, "__qualname__", "")
        if not module or module == "__main__" or "<" in name:
            raise AsyncSaveError(f"the writer's entry point must be importable by name, not {module}.{name}")
        if not sys.executable:
            raise AsyncSaveError("cannot start the writer process: sys.executable is not set")
        parent, child = mpc.Pipe(duplex=True)
        sentinel_r, sentinel_w = os.pipe()
        cfg = {
            "sys_path": [p for p in sys.path if isinstance(p, str)],
            "target": f"{module}:{name}",
            "conn_fd": child.fileno(),
            "sentinel_fd": sentinel_w,
            "args": list(args),
        }
        try:
            popen = subprocess.Popen(
                [sys.executable, "-c", BOOT, json.dumps(cfg)],
                stdin=subprocess.DEVNULL,  # stdout/stderr: the trainer's (its launcher's logs)
                pass_fds=(child.fileno(), sentinel_w, *pass_fds),
                env=_writer_env(),
            )
        except BaseException:
            parent.close()
            os.close(sentinel_r)
            raise
        finally:
            child.close()  # the child has its copies (or there is no child)
            os.close(sentinel_w)
        return cls(popen, sentinel_r), parent

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    @property
    def exitcode(self) -> int | None:
        """The exit status once reaped (``-N``: killed by signal N), else ``None``."""
        return self._popen.poll()

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        if self._popen.poll() is None:
            try:
                self._popen.kill()
            except ProcessLookupError:
                pass

    def close(self) -> None:
        """Release the sentinel (the process is reaped by :meth:`join` or later by
        :mod:`subprocess`)."""
        if self.sentinel >= 0:
            try:
                os.close(self.sentinel)
            except OSError:
                pass
            self.sentinel = -1


class Checkpointer:
    """Staging buffer + persistent writer process of this rank, for one process group."""

    def __init__(self, group=None, timeout_s: float | None = None) -> None:
        self.group = group
        self.timeout_s = resolve_timeout(timeout_s)  # writers' group setup; default per save
        self._seg: _Segment | None = None
        self._proc: _WriterProcess | None = None
        self._conn = None
        self._start_error: AsyncSaveError | None = None  # why the last writer start failed
        self._last: AsyncSave | None = None
        self._streams: dict = {}  # CUDA device -> the stream that stages its tensors (see _copy)
        self._lock = threading.Lock()
        # (signature of the staged entries, page phase of each or None): from the writer's
        # plan of the last save of the same entries (see _layout)
        self._phases: tuple[str, list[int | None]] | None = None
        self._rendezvous = None  # rank 0: the TCP store its writers' group met on (_serve_rendezvous)

    # -- lifecycle ---------------------------------------------------------------------------

    def _start_writer(self, comm: Comm) -> None:
        """Collective over the trainer's group (called from save() and start(), in the
        caller's thread). A writer that cannot be started is reported by the caller (agreed
        over the group): ``_start_error``, an AsyncSaveError that says why."""
        mine = None
        if comm.rank == 0:
            self._rendezvous = None  # the last group's (its writers are stopped)
            try:
                self._rendezvous = _serve_rendezvous(self.timeout_s)
                mine = json.dumps([_rendezvous_addr(), self._rendezvous.port, uuid.uuid4().hex]).encode()
            except (OSError, RuntimeError) as e:  # told to every rank (no port) rather than raised here alone
                log.warning("cannot serve the writers' rendezvous: %s", e)
                mine = b""
        said = comm.broadcast_bytes(mine, what="asynchronous save (the writers' rendezvous)")
        env_node = os.environ.get("UNICKPT_NODE_ID")
        self._start_error = None
        if not said:
            self._start_error = AsyncSaveError("the writer process could not be started: rank 0 could not serve "
                                               "the writers' rendezvous")
            return
        addr, port, gate = json.loads(said)  # gate: this group's name for its gate's keys
        joined_r, joined_w = os.pipe()
        try:
            self._proc, self._conn = _WriterProcess.start(
                _writer_main, (comm.rank, comm.world, addr, int(port), self.timeout_s, os.getpid(), env_node, joined_w,
                               gate),
                pass_fds=(joined_w,))
        except (OSError, ValueError, AsyncSaveError) as e:
            self._start_error = AsyncSaveError(f"the writer process could not be started: {e}")
        finally:
            os.close(joined_w)  # the writer's copy alone is left: EOF on joined_r once it has gone
        why = f"rank {comm.rank}'s writer " + (
            f"process could not be started ({self._start_error})" if self._start_error is not None else
            f"process (pid {self._proc.pid}) exited before it joined the writers' group")
        threading.Thread(target=_watch_joining, args=(joined_r, addr, int(port), gate, why,
                                                      self.timeout_s + WRITER_BOOT_S),
                         name="unickpt-writer-start", daemon=True).start()

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
                size = self._layout(entries).size
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

    def _await_ready(self, comm: Comm, err: BaseException | None) -> BaseException | None:
        """Collective, after :meth:`start` started a writer on every rank: wait until every
        writer has joined the writers' group (its ``ready`` message), at most ``timeout_s``
        (which bounds the group's set-up) + :data:`WRITER_BOOT_S` (the interpreter's start).
        Each rank waits :data:`READY_SLICE` at a time for its own writer, then every rank says
        where it stands (an all-gather), so a rank whose writer failed, or which failed
        otherwise (``err``), ends the wait everywhere at once rather than after the others'
        timeout (start() then stops the writers on every rank; the next save starts new
        ones). Returns this rank's error, if any."""
        limit = self.timeout_s + WRITER_BOOT_S
        deadline = time.monotonic() + limit
        ready = False
        while True:
            if err is None and not ready:
                try:
                    ready = self._poll_ready(max(0.0, min(READY_SLICE, deadline - time.monotonic())))
                except AsyncSaveError as e:
                    err = e
                if err is None and not ready and time.monotonic() >= deadline:
                    err = AsyncSaveError(f"the writer process could not be started: it did not join the writers' "
                                         f"group within {limit:g} s")
            mine = b"" if err is None and not ready else b"1" if err is None else b"0"
            states = comm.all_gather_bytes(mine, "asynchronous save (waiting for the writers)")
            if b"0" in states:
                return err
            if all(s == b"1" for s in states):
                return None

    def _poll_ready(self, timeout: float) -> bool:
        """Whether this rank's writer has said it is ready, waiting at most ``timeout``
        seconds; AsyncSaveError if it reported a failure or exited first."""
        conn, proc = self._conn, self._proc
        if conn is None or proc is None:
            raise AsyncSaveError("the writer process could not be started: no writer process")
        if not mpc.wait([conn, proc.sentinel], timeout):
            return False
        msg = None
        try:
            if conn.poll():
                msg = json.loads(conn.recv_bytes())
        except (EOFError, OSError, ValueError):
            msg = None
        if msg == _READY:
            return True
        if isinstance(msg, dict) and msg.get("ok") is False:
            raise AsyncSaveError(f"the writer process could not be started: {msg.get('error')}")
        proc.join(timeout=1.0)  # it exited (or said something else, which no writer does)
        raise AsyncSaveError(f"the writer process could not be started: it exited (exit code {proc.exitcode}) "
                             f"before joining the writers' group" if msg is None else
                             f"the writer process could not be started: unexpected first message {msg!r}")

    def _stop_writer(self, graceful: bool) -> None:
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if proc is None:
            return
        if not proc.is_alive():  # it exited with nobody listening (e.g. started early): say why
            try:
                while conn.poll(0):
                    said = conn.recv_bytes()
                    if said != _READY_RAW:
                        log.warning("the asynchronous writer process (exit code %s) had reported: %s", proc.exitcode,
                                    said.decode(errors="replace")[:2000])
            except (OSError, EOFError):
                pass
        if graceful and proc.is_alive():
            try:
                conn.send_bytes(b'{"op": "exit"}')
                proc.join(timeout=5)
            except (OSError, EOFError, BrokenPipeError):
                pass
        if proc.is_alive():
            proc.kill()
        proc.join(timeout=10)
        proc.close()
        try:
            conn.close()
        except OSError:
            pass

    def close(self, timeout: float = 120.0) -> None:
        """Finish the pending save (errors are logged; at most ``timeout`` seconds), stop the
        writer, free the segment."""
        if self._last is not None and not self._last._finished:
            try:
                self._last.wait(timeout=timeout)
            except UnickptError as e:
                log.warning("pending asynchronous save did not complete at shutdown: %s", e)
        self._stop_writer(graceful=True)
        self._rendezvous = None  # (its writers are gone)
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
        prev_err: BaseException | None = None
        surfaced = False
        if self._last is not None:  # back-pressure: one save in flight
            surfaced = self._last._surfaced
            try:
                self._last.wait()
            except UnickptError as e:
                prev_err = e
        alive = self._proc is not None and self._proc.is_alive()
        # every rank learns whether any rank's previous save failed, and all take one branch
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

        err: BaseException | None = None
        try:
            if self._start_error is not None:
                raise self._start_error
            entries, json_state = flatten(state_dict, comm.rank, comm.world)
            staged = self._layout(entries)
            staged.ready = _ready(entries)
            self._ensure_segment(staged.size)
        except Exception as e:
            err = e
        comm.agree(err, "asynchronous save (preparing the staging buffer)")  # no writer is left waiting
        handle = AsyncSave(self, os.fspath(path), opts.step, progress)
        handle._signature, handle._n_entries = staged.signature, len(staged.entries)
        self._last = handle
        cmd = {
            "op": "save",
            "shm": self._seg.name,
            "shm_size": self._seg.size,
            "entries": staged.entries,
            "state": json_state,
            "path": writer_path(path),
            "also": [writer_path(p) for p in also],
            "timeout_s": comm.timeout_s,  # the writers wait for each other at most this long
            "opts": opts.to_json(),
            "progress": progress is not None,
        }

        proc, conn = self._proc, self._conn

        def stage() -> None:
            t = time.perf_counter()
            try:
                if background_staging:  # the writer starts (plan, files, first writes) during the copy
                    self._conn.send_bytes(json.dumps(cmd).encode())
                    self._copy(entries, staged, self._tell_staged)
                else:  # the caller waits for the copy: the writer would only slow it down
                    self._copy(entries, staged)
                    self._conn.send_bytes(json.dumps(cmd).encode())
                self._tell_staged(staged.size, done=True)
            except BaseException as e:  # surfaced by wait_staged()/wait()
                cause: BaseException = e
                if isinstance(e, (OSError, EOFError)) and proc is not None:  # the pipe broke: the writer ended
                    proc.join(timeout=1.0)
                    if proc.exitcode is not None:  # its answer (if it sent one) or its death is the cause
                        with self._lock:
                            if not handle._finished:
                                self._read(handle, conn, proc, exited=True)
                        if handle._error is not None:
                            cause = handle._error
                            cause.__cause__ = cause.__cause__ or e
                handle._stage_error = cause
                try:  # the writers still meet: ours fails the save on every rank
                    self._conn.send_bytes(json.dumps({"op": "abort", "error": f"{type(e).__name__}: {e}"}).encode())
                except Exception:
                    if not handle._finished:
                        handle._error = AsyncSaveError(f"staging for {path} failed: {cause}")
                        handle._finished = True
            finally:
                handle.staging_seconds = time.perf_counter() - t
                handle._staged.set()

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

    def _layout(self, entries: list[Entry]) -> _Staged:
        """Where each entry goes in the segment. Entries are 64-byte aligned, except those the
        writer's plan of the previous save of the same entries gave a page phase: they sit at
        that offset within a page, the one their bytes have in their file, so the writer's
        O_DIRECT writes take them straight from the segment (the plan is the same as long as
        the entries are: the writers' plan cache). A phase that no longer fits costs only
        the copy it would have saved: the writer checks every write's alignment itself."""
        rows = []
        for e in entries:
            n = e.local.numel() * e.local.element_size()
            lay = e.layout
            rows.append([e.role, e.name, dtype_name(e.local.dtype), list(lay.shape), lay.to_json(), 0, n,
                         list(e.aliases), e.per_rank])
        signature = json.dumps(rows)
        phases = self._phases[1] if self._phases is not None and self._phases[0] == signature else None
        pos = 0
        for i, row in enumerate(rows):
            phase = phases[i] if phases is not None else None
            if not (type(phase) is int and 0 <= phase < ALIGN and phase % entries[i].local.element_size() == 0):
                phase = None
            pos += (phase - pos) % ALIGN if phase is not None else -pos % 64
            row[5] = pos
            pos += row[6]
        return _Staged(rows, -(-pos // 64) * 64, signature)

    def _ensure_segment(self, size: int, fault_in: bool = False) -> None:
        """A segment of at least ``size`` bytes (10% headroom when a new one is made:
        :func:`segment_bytes`). ``fault_in``: also map every page of a new one into this
        process now (one write per page), which the first copy into it would otherwise do
        (at set-up, not in a save)."""
        if self._seg is not None and self._seg.size >= size:
            return
        new = segment_bytes(size)
        seg = _new_segment(new)
        if fault_in:
            seg.tensor[::mmap.PAGESIZE].zero_()
        seg.pin()
        if self._seg is not None:
            # the writer may still map the old one until its next command: unlink now (the
            # mapping stays valid), close our side
            self._seg.close(unlink=True)
        self._seg = seg

    def _copy(self, entries: list[Entry], staged: _Staged, tell=None) -> None:
        """Copy the entries into the segment in segment order; every ~:data:`STAGE_CHUNK`
        bytes (large tensors in blocks of elements, or of rows when not contiguous),
        ``tell(end)``: the segment is filled up to byte ``end`` (device copies synchronized
        first).

        Device tensors are copied on a high-priority stream held by this checkpointer per
        device, after the event of :func:`_ready`: a background copy overlaps the caller's
        next kernels (on the legacy default stream it would queue behind them and delay
        them). Waiting for the copy waits on an event recorded after its copies, not on the
        whole stream (PyTorch hands out pool streams in turn, so other code may queue on
        the same one). ``entries`` holds every source until the copies are complete, so
        nothing the caller frees meanwhile is reused early; a copy that fails part way is
        still waited for before the error leaves (the segment may be unmapped next)."""
        buf = self._seg.tensor
        streams: dict = {}
        told = 0

        def stream(dev):
            s = streams.get(dev)
            if s is None:
                s = self._streams.get(dev)
                if s is None:  # high priority: the pool NCCL and most user code draw from is the other one
                    s = self._streams[dev] = torch.cuda.Stream(dev, priority=-1)
                s.wait_event(staged.ready[dev])  # _ready saw every entry's device
                streams[dev] = s
            return s

        def sync() -> None:
            for s in streams.values():
                ev = torch.cuda.Event()
                ev.record(s)
                ev.synchronize()

        try:
            for e, row in zip(entries, staged.entries):
                off, n = row[5], row[6]
                if n == 0:
                    continue
                dst = buf[off : off + n].view(e.local.dtype).view(e.local.shape)
                src = e.local.detach()
                if src.is_contiguous():  # blocks of elements: a tensor of few long rows (1 x N) streams too
                    dst, src = dst.view(-1), src.view(-1)
                s = stream(src.device) if src.device.type == "cuda" else None
                rows = src.shape[0] if src.dim() else 1
                step = rows if tell is None or src.dim() == 0 else max(1, STAGE_CHUNK * rows // n)
                with torch.cuda.stream(s) if s is not None else contextlib.nullcontext():
                    for a in range(0, rows, step):
                        d, x = (dst, src) if step >= rows else (dst[a : a + step], src[a : a + step])
                        d.copy_(x, non_blocking=s is not None and self._seg.pinned)
                        end = off + (n if step >= rows else min(rows, a + step) * (n // rows))
                        if tell is not None and end - told >= STAGE_CHUNK:
                            sync()
                            tell(end)
                            told = end
            sync()
        except BaseException:
            try:  # no copy may still land in the segment once the error has left
                sync()
            except Exception as err:  # the first error is the one raised
                log.warning("waiting for the device copies of a failed staging: %s", err)
            raise

    def _tell_staged(self, end: int, done: bool = False) -> None:
        """Tell the writer that the segment holds the state up to byte ``end`` (a message
        on the pipe: the write is ordered after the copy, the writer's read before its use)."""
        self._conn.send_bytes(json.dumps({"op": "staged", "end": int(end), "done": done}).encode())

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
            msg = None
            try:
                if not conn.poll():
                    if not exited:
                        return
                else:
                    msg = json.loads(conn.recv_bytes())
            except (EOFError, OSError):
                msg = None
            if msg is not None and msg.get("op") == "progress":
                if handle._progress is not None:
                    handle._progress_pending.append((int(msg["done"]), int(msg["total"])))
                continue
            if msg == _READY:  # a writer started by this save is up
                continue
            handle.total_seconds = time.perf_counter() - handle.t0
            handle._finished = True
            if msg is None:
                proc.join(timeout=1.0)  # its pipe closed as it exited: let it be reaped for the code
                code = proc.exitcode
                handle._error = AsyncSaveError(
                    f"save of {handle.path}: the writer process of this rank died (exit code {code}) before it "
                    f"reported the outcome; {_committed_now(handle.path, handle._before)}")
            elif msg.get("ok"):
                handle._result = SaveResult(**msg["result"])
                handle.results = [SaveResult(**r) for r in msg.get("results") or [msg["result"]]]
                phases = msg.get("phases")
                if isinstance(phases, list) and len(phases) == handle._n_entries:
                    self._phases = (handle._signature, phases)
            else:
                done = msg.get("results")
                if isinstance(done, list) and done:  # committed before an also= copy failed
                    handle.results = [SaveResult(**r) for r in done]
                    handle._error = async_error(msg.get("type"), f"save of {handle.path}: {msg.get('error')}")
                else:
                    handle._error = async_error(msg.get("type"), f"save of {handle.path} failed: {msg.get('error')}")
            return


def _local(path) -> str | None:
    """``path`` made absolute, if it is one local directory (not a URL, not node-local)."""
    p = writer_path(path)
    return None if "://" in p or "{node}" in p else p


def _manifest_stat(path) -> tuple | None:
    """Identity of the committed manifest (a regular file) at local ``path``, or None."""
    p = _local(path)
    try:
        st = os.lstat(os.path.join(p, MANIFEST_NAME)) if p is not None else None
    except (OSError, ValueError):
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size) if st is not None and stat.S_ISREG(st.st_mode) else None


def _committed_now(path: str, before: tuple | None = None) -> str:
    """What a rank whose writer died can say of the save: the other ranks' writers fail at
    their next collective, unless they had passed the commit's last agreement, so a
    committed checkpoint there may be this save's (``before``: the manifest that stood there
    when the save began, which an overwrite leaves in place until its commit)."""
    p = _local(path)
    if p is None:
        return "the outcome is unknown here (check unickpt.latest() before relying on it)"
    now = _manifest_stat(p)
    if now is None:
        return (f"{p} is not committed now; unless the other ranks' writers had passed the commit, they fail "
                "too and it stays so (check unickpt.latest() before relying on it)")
    if now == before:
        return (f"{p} still holds the checkpoint that was there before this save; unless the other ranks' "
                "writers had passed the commit, they fail too and it stays so (check unickpt.read_manifest "
                "before relying on it)")
    return (f"{p} is committed (the other ranks' writers had passed the commit); check it with "
            "unickpt.read_manifest before relying on it")


def writer_path(path) -> str:
    """``path`` as the writer process gets it: a URL (``scheme://...``) as given, a local
    path made absolute (the writer shares our working directory, but a path that means the
    same whatever the directory is safer)."""
    p = os.fspath(path)
    return p if "://" in p else os.path.abspath(p)


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


# -- the writer process ------------------------------------------------------------------------


def _parent_gone(parent_pid: int) -> bool:
    return os.getppid() != parent_pid or not _alive(parent_pid)


def _free_parent_segments(parent_pid: int, segments: dict) -> None:
    """The parent is gone: unlink its staging segments (those this writer maps, and any
    other it created, which no process holds now: :func:`sweep_segments`), so no shared
    memory outlives the job."""
    for name in {seg.name for seg in list(segments.values()) if getattr(seg, "name", None)}:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except OSError:
            pass
    sweep_segments()


def _watch_parent(parent_pid: int, segments: dict) -> None:
    while True:
        time.sleep(0.2)
        if _parent_gone(parent_pid):
            _free_parent_segments(parent_pid, segments)
            os._exit(3)


def _orphaned(parent_pid: int, segments: dict, wait: float = 2.0) -> None:
    """Our pipe closed without an exit command: the parent died (its files close before its
    children are re-parented, so give that a moment); free its staging memory."""
    deadline = time.monotonic() + wait
    while not _parent_gone(parent_pid):
        if time.monotonic() > deadline:
            return  # still there (it closed the pipe itself): its segments are its own business
        time.sleep(0.02)
    _free_parent_segments(parent_pid, segments)


_GATE_OPEN = b"open"


def _gate_keys(gate: str) -> tuple[str, str]:
    """Keys of a writers' group's gate on its rendezvous store (:func:`_pass_gate`), apart
    from the group's own; ``gate`` is the group's random name, so a late word meant for an
    earlier group (whose store's port a new store may have taken) reaches no key here."""
    return f"unickpt/writers/{gate}/arrived", f"unickpt/writers/{gate}/gate"


def _pass_gate(store, world: int, gate: str, timeout) -> None:
    """Wait until every writer of the group has reached its rendezvous store, or one of them
    is known never to: the last to arrive opens the gate (``open``); the trainer of a writer
    that exits (or cannot start) before arriving closes it with the reason
    (:func:`_watch_joining`). ``compare_set`` on a missing key sets it, so the first word
    stands. Without it, the other writers would wait for the missing one in
    ``init_process_group`` until ``timeout``. Raises AsyncSaveError with the reason."""
    arrived, key = _gate_keys(gate)
    if store.add(arrived, 1) >= world:
        store.compare_set(key, "", _GATE_OPEN.decode())
    store.wait([key], timeout)
    said = store.get(key)
    if said != _GATE_OPEN:
        raise AsyncSaveError(said.decode(errors="replace"))


def _watch_joining(joined_r: int, addr: str, port: int, gate: str, why: str, limit: float) -> None:
    """The trainer's side of :func:`_pass_gate`, in a thread while its writer starts: the
    writer writes a byte to ``joined_r``'s pipe once it has joined its group; the pipe's end
    without that byte means it exited (or was killed, or never started) before, and then the
    gate of the other writers is closed with ``why`` (a no-op once it is open), so they fail
    at once rather than after their timeout. Gives up after ``limit`` seconds (by then the
    group has formed or the writers have timed out)."""
    import datetime

    import torch.distributed as dist

    try:
        waiting = select.poll()  # (not select(): a trainer may hold more than FD_SETSIZE descriptors)
        waiting.register(joined_r, select.POLLIN | select.POLLHUP)
        if not waiting.poll(limit * 1000) or os.read(joined_r, 1):
            return  # joined (or still starting after limit: its own timeout has passed)
        store = dist.TCPStore(addr, port, None, is_master=False, timeout=datetime.timedelta(seconds=30))
        store.compare_set(_gate_keys(gate)[1], "", why)
    except Exception as e:  # the group then forms or times out on its own
        log.debug("could not tell the other writers that %s: %s", why, e)
    finally:
        os.close(joined_r)


def _result_json(r: SaveResult) -> dict:
    return {"path": r.path, "step": r.step, "files": r.files, "bytes": r.bytes, "local_bytes": r.local_bytes,
            "seconds": r.seconds, "phases": r.phases}


def _writer_main(conn, rank: int, world: int, addr: str, port: int, timeout_s: float, parent_pid: int, node,
                 joined_w: int = -1, gate: str = "") -> None:
    import datetime

    import torch.distributed as dist

    if joined_w >= 0:
        os.set_inheritable(joined_w, False)  # ours alone, as the pipe's other fds (see _writer_main.main)
    if node and "UNICKPT_NODE_ID" not in os.environ:
        os.environ["UNICKPT_NODE_ID"] = node
    torch.set_num_threads(1)
    segments: dict[str, _Segment] = {}
    threading.Thread(target=_watch_parent, args=(parent_pid, segments), daemon=True).start()

    def on_term(signum, frame):  # the parent's multiprocessing terminates us at its exit
        for seg in list(segments.values()):
            try:
                os.unlink(os.path.join(SHM_DIR, seg.name))
            except FileNotFoundError:
                pass
        os._exit(4)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the trainer, which may wait for us
    try:
        # an explicit store, served by rank 0's trainer (_serve_rendezvous): under torchrun,
        # TORCHELASTIC_USE_AGENT_STORE would otherwise make every writer a client of a store
        # that nobody serves
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(addr, port, None, is_master=False, timeout=timeout)
        _pass_gate(store, world, gate, timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    except Exception as e:
        _reply(conn, {"ok": False, "error": f"writer group setup failed: {e}"})
        return
    if joined_w >= 0:  # tell our trainer's _watch_joining
        os.write(joined_w, b"1")
        os.close(joined_w)
    _reply(conn, _READY)  # awaited by Checkpointer.start(); skipped by a save's reader
    comm = Comm(None, timeout_s=timeout_s)
    while True:
        try:
            raw = conn.recv_bytes()
        except (EOFError, OSError):
            _orphaned(parent_pid, segments)  # the watchdog may not have looked yet
            break  # parent gone
        cmd = json.loads(raw)
        if cmd.get("op") == "exit":
            break
        if cmd.get("op") == "abort":  # staging failed on our rank: fail this save on every writer
            try:
                comm.agree(AsyncSaveError(f"staging failed on rank {rank}: {cmd.get('error')}"), "save (reading the state dict)")
            except Exception as e:
                _reply(conn, {"ok": False, "error": f"{type(e).__name__}: {e}"})
            break
        results: list[SaveResult] = []  # committed by this command (also= copies after the first)
        failed_at = cmd.get("path")
        try:
            comm.timeout_s = float(cmd.get("timeout_s") or timeout_s)
            seg = segments.get(cmd["shm"])
            if seg is None:
                for old in segments.values():
                    old.close(unlink=False)
                segments.clear()
                seg = segments[cmd["shm"]] = _Segment(cmd["shm"], cmd["shm_size"], create=False)
            entries = []
            for role, name, dt, shape, lay, off, n, aliases, per_rank in cmd["entries"]:
                layout = Layout.from_json(shape, lay)
                local = seg.tensor[off : off + n].view(torch_dtype(dt)) if n else torch.empty(0, dtype=torch_dtype(dt))
                entries.append(Entry(role, name, local, layout, tuple(aliases), bool(per_rank)))
            opts = SaveOptions.from_json(cmd["opts"])
            gate = _StagingGate(conn, {e.key: row[5] for e, row in zip(entries, cmd["entries"])}, int(cmd["shm_size"]),
                                comm.timeout_s, rank)
            sender = _ProgressSender(conn) if cmd.get("progress") else None
            phases: list[int | None] = [None] * len(entries)

            def planned(plan, entries=entries, phases=phases) -> None:
                want = plan.page_phases(rank, ALIGN)
                for i, e in enumerate(entries):
                    p = want.get(e.key)
                    if p is not None and e.local.numel() * e.local.element_size() >= FROM_MEMORY_MIN \
                            and p % e.local.element_size() == 0:
                        phases[i] = p

            also = list(cmd.get("also") or ())  # e.g. the durable copy of a memory snapshot
            try:  # staging follows the page phases of the last checkpoint (the durable one, if any)
                results.append(save_entries(comm, (entries, cmd["state"]), None, cmd["path"], opts, sender,
                                            None if also else planned, gate))
                for i, other in enumerate(also):
                    failed_at = other
                    results.append(save_entries(comm, (entries, cmd["state"]), None, other,
                                                dataclasses.replace(opts, replicas=0), None,
                                                planned if i == len(also) - 1 else None))
            finally:
                if sender is not None:
                    sender.close()  # its last report goes before our answer
                copied = gate.close()  # the pipe carries the trainer's next command only after its copy's end
                if gate.pipe_closed:  # the trainer died mid-copy: the gate read the pipe's end, not our loop
                    _orphaned(parent_pid, segments)
            if not copied:
                raise AsyncSaveError(f"rank {rank}: the trainer did not finish staging within {comm.timeout_s} s")
            _reply(conn, {"ok": True, "result": _result_json(results[0]), "results": [_result_json(r) for r in results],
                          "phases": phases})
        except Exception as e:
            said = {"ok": False, "error": f"{type(e).__name__}: {e}", "type": type(e).__name__}
            if results:  # committed before an also= copy failed: said, and their results kept
                said["error"] = (f"{', '.join(r.path for r in results)} committed; the copy at {failed_at} failed: "
                                 f"{said['error']}")
                said["results"] = [_result_json(r) for r in results]
            _reply(conn, said)
            break  # the writers' group may be broken: the parent restarts us
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    for seg in segments.values():
        seg.close(unlink=False)


class _StagingGate:
    """How far the trainer's copy into the segment has got, for the save it started before
    copying (:meth:`Checkpointer.save`): a thread reads the trainer's ``{"op": "staged",
    "end": byte, "done": bool}`` messages (or ``{"op": "abort"}``) until the copy's end, and
    :meth:`wait` holds a read of an entry's bytes until they are in place (the
    :class:`~unickpt.saver.StagedBytes` of the save). Bounded: a copy that stops arriving
    fails the read after ``timeout_s``."""

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
                msg = json.loads(self._conn.recv_bytes())
            except (EOFError, OSError, ValueError) as e:
                error = f"the trainer's pipe closed during staging ({type(e).__name__})"
                self.pipe_closed = not isinstance(e, ValueError)
                break
            op = msg.get("op") if isinstance(msg, dict) else None
            if op == "staged":
                with self._cv:
                    self._end = max(self._end, int(msg.get("end", 0)))
                    self._done = bool(msg.get("done"))
                    self._cv.notify_all()
                if self._done:
                    return
            elif op == "abort":
                error = str(msg.get("error"))
            else:
                error = f"unexpected message {op!r} during staging"
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


def _reply(conn, obj: dict) -> None:
    try:
        conn.send_bytes(json.dumps(obj).encode())
    except (OSError, BrokenPipeError):
        pass


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
            _reply(self._conn, {"op": "progress", "done": v[0], "total": v[1]})
            last = time.monotonic()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join()
