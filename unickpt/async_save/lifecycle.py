"""The life of a rank's writer process, on the trainer's side: started as a fresh
interpreter (:class:`WriterProcess`), joined to the writers' group of its trainer's group
(:meth:`WriterLifecycle._start_writer`, :meth:`WriterLifecycle._await_ready`), stopped
(:meth:`WriterLifecycle._stop_writer`). What the process runs is :mod:`.writer`."""

from __future__ import annotations

import json
import multiprocessing.connection as mpc
import os
import subprocess
import sys
import threading
import time
import uuid

from .._metrics import log
from .._writer_main import BOOT
from ..errors import AsyncSaveError
from ..transport import Comm, resolve_timeout
from . import rendezvous, writer
from .protocol import READY_BYTES, ExitWriter, ProtocolError, Ready, SaveFailed, encode, receive

__all__ = ["WriterProcess", "WriterLifecycle", "READY_SLICE", "WRITER_BOOT_S"]

READY_SLICE = 0.1  # seconds start() waits for its own writer between two all-gathers of every rank's state
WRITER_BOOT_S = 60.0  # start() allows a writer this long to start its interpreter, beyond timeout_s for its group

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


class WriterProcess:
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
    def start(cls, target, args: tuple, pass_fds: tuple[int, ...] = ()) -> tuple["WriterProcess", mpc.Connection]:
        module, name = getattr(target, "__module__", None), getattr(target, "__qualname__", "")
        if not module or module == "__main__" or "<" in name:
            raise AsyncSaveError(f"the writer's entry point must be importable by name, not {module}.{name}")
        if not sys.executable:
            raise AsyncSaveError("cannot start the writer process: sys.executable is not set")
        writer.writer_nice()  # UNICKPT_WRITER_NICE checked here: the writer lowers its priority by it
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


class WriterLifecycle:
    """This rank's writer process for one process group, as its trainer holds it: the
    process and its pipe (``_proc``, ``_conn``), why its last start failed
    (``_start_error``) and, on the group's rank 0, the store its writers' group met on
    (``_rendezvous``). :class:`~unickpt.async_save.client.Checkpointer` is one, with the
    staging and the saves."""

    def __init__(self, group=None, timeout_s: float | None = None) -> None:
        self.group = group
        self.timeout_s = resolve_timeout(timeout_s)  # writers' group setup; default per save
        self._proc: WriterProcess | None = None
        self._conn = None
        self._start_error: AsyncSaveError | None = None  # why the last writer start failed
        self._rendezvous = None  # rank 0: the TCP store its writers' group met on (rendezvous.serve)

    def _start_writer(self, comm: Comm) -> None:
        """Collective over the trainer's group (called from save() and start(), in the
        caller's thread). A writer that cannot be started is reported by the caller (agreed
        over the group): ``_start_error``, an AsyncSaveError that says why."""
        mine = None
        if comm.rank == 0:
            self._rendezvous = None  # the last group's (its writers are stopped)
            try:
                self._rendezvous = rendezvous.serve(self.timeout_s)
                mine = json.dumps([rendezvous.address(), self._rendezvous.port, uuid.uuid4().hex]).encode()
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
            self._proc, self._conn = WriterProcess.start(
                writer.main, (comm.rank, comm.world, addr, int(port), self.timeout_s, os.getpid(), env_node, joined_w,
                              gate),
                pass_fds=(joined_w,))
        except (OSError, ValueError, AsyncSaveError) as e:
            self._start_error = AsyncSaveError(f"the writer process could not be started: {e}")
        finally:
            os.close(joined_w)  # the writer's copy alone is left: EOF on joined_r once it has gone
        why = f"rank {comm.rank}'s writer " + (
            f"process could not be started ({self._start_error})" if self._start_error is not None else
            f"process (pid {self._proc.pid}) exited before it joined the writers' group")
        threading.Thread(target=rendezvous.watch_joining, args=(joined_r, addr, int(port), gate, why,
                                                                self.timeout_s + WRITER_BOOT_S),
                         name="unickpt-writer-start", daemon=True).start()

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
        got = receive(conn)
        msg, bad = (None, got) if isinstance(got, ProtocolError) else (got, None)
        if isinstance(msg, Ready):
            return True
        if isinstance(msg, SaveFailed):
            raise AsyncSaveError(f"the writer process could not be started: {msg.error}")
        proc.join(timeout=1.0)  # it exited (or said something else, which no writer does)
        raise AsyncSaveError(f"the writer process could not be started: it exited (exit code {proc.exitcode}) "
                             f"before joining the writers' group" if msg is None and bad is None else
                             f"the writer process could not be started: unexpected first message "
                             f"{bad if bad is not None else repr(msg.to_wire())}")

    def _stop_writer(self, graceful: bool) -> None:
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if proc is None:
            return
        if not proc.is_alive():  # it exited with nobody listening (e.g. started early): say why
            try:
                while conn.poll(0):
                    said = conn.recv_bytes()
                    if said != READY_BYTES:
                        log.warning("the asynchronous writer process (exit code %s) had reported: %s", proc.exitcode,
                                    said.decode(errors="replace")[:2000])
            except (OSError, EOFError):
                pass
        if graceful and proc.is_alive():
            try:
                conn.send_bytes(encode(ExitWriter()))
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
