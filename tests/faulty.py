"""Fault injection for the crash/fault campaign (tests/test_campaign.py).

* :class:`FaultyStorage`: :class:`unickpt.io.local.LocalStorage` with the same methods, which
  fails the way a sick disk does, per a config dict (see :class:`Faults`). :func:`install`
  puts it behind the storage seam of this process (``storage_for`` as save, load, sweep and
  retain find it); call it inside a spawned rank process, on the rank that should fail.
* OS-level short writes (``os.pwrite``/``os.write`` writing fewer bytes than asked, or none):
  the storage's own loops must complete them or fail, never leave a short file.
* asynchronous writers: a rank whose environment holds ``UNICKPT_TEST_FAULTS`` (JSON faults)
  when its writer starts gets that writer's storage broken (after :func:`mark_fault_points`).
* :func:`writer_cannot_join`, :func:`writer_exits`: asynchronous writers (the checkpointer's
  ``unickpt.async_save.writer.main``, set on one rank) whose set-up fails as the real one
  reports it, or that exit silently before joining the writers' group.
* :func:`mark_fault_points`: fault points in this process, and in the asynchronous writer
  processes it starts: every storage behind the seam becomes a :class:`Parking`, which parks
  the process at the point ``$FAULTY_PARK`` (``NAME:SECONDS[:FILE]``) names (after-create,
  after-data, before-commit, after-commit, between-renames, retention: the storage call that
  follows each). With ``$FAULTY_MARK_DIR`` set, a point acts only once the file
  ``$FAULTY_MARK_DIR/armed`` exists, and then first creates ``$FAULTY_MARK_DIR/at-NAME-PID``,
  so a test knows every process is parked there before it kills them. The library itself has
  no fault hooks: a process the test starts (a rank, ``python -c``) calls this first.
"""

from __future__ import annotations

import os
import threading
import time

import unickpt.io.local as _local
import unickpt.io.storage as _st

__all__ = ["Faults", "FaultyStorage", "Parking", "install", "uninstall", "mark_fault_points", "writer_main",
           "writer_cannot_join", "writer_exits"]


class Faults:
    """What to break. Keys of ``config`` (all optional):

    ``write_error``: ``[errno, k]``: the k-th ``write_at`` of this process (1-based) and every
    later one raise ``OSError(errno)``; ``read_error``: errno raised by every ``readinto``;
    ``read_bytes_error``: errno raised by ``read_bytes`` (manifest, owner records...);
    ``fsync_error``: errno raised when a data file's writer is closed (its fsync), and by
    ``finish_file``; ``fsync_delay``: seconds each of those fsyncs takes; ``fsync_dir_error``:
    errno of ``fsync_dir`` on a temporary directory; ``manifest_error``: errno of writing
    ``unickpt.json``; ``rename_error``: errno of renaming a temporary into place;
    ``short_writes``: ``"half"`` (each OS write writes about half of what it is asked, page
    aligned) or ``"zero"`` (it writes nothing and returns 0); ``pwrite_error``: ``[errno, k]``:
    the k-th ``os.pwrite`` of this process and every later one fail (below the storage: in
    the O_DIRECT engine's helper threads); ``reserve_error``: errno of every fallocate(2)
    that ``create_file`` makes to reserve a data file's blocks (below the storage, as the OS
    would answer).
    """

    def __init__(self, config: dict) -> None:
        unknown = set(config) - {"write_error", "read_error", "read_bytes_error", "fsync_error", "fsync_delay",
                                 "fsync_dir_error", "manifest_error", "rename_error", "short_writes",
                                 "pwrite_error", "reserve_error"}
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}")
        self.config = dict(config)
        self.writes = 0
        self.injected: list[str] = []
        self._lock = threading.Lock()

    def get(self, key):
        return self.config.get(key)

    def fail(self, key: str, code: int, path: str, what: str) -> None:
        self.injected.append(f"{key}:{os.path.basename(path)}")
        raise OSError(code, f"{os.strerror(code)} (injected: {what})", path)

    def on_write(self, path: str) -> None:
        spec = self.get("write_error")
        if spec is None:
            return
        with self._lock:
            self.writes += 1
            n = self.writes
        if n >= spec[1]:
            self.fail("write_error", spec[0], path, f"write #{n}")


class _Writer:
    """An :class:`~unickpt.io.storage.ExtentWriter` whose writes and fsync may fail."""

    def __init__(self, inner, faults: Faults) -> None:
        self.inner, self.faults = inner, faults
        self.path, self.direct = inner.path, inner.direct

    @property
    def bytes_written(self) -> int:
        return self.inner.bytes_written

    def write_at(self, offset: int, data: memoryview, stable: bool = False) -> None:
        self.faults.on_write(self.path)
        self.inner.write_at(offset, data, stable)

    def close(self) -> list[tuple[int, bytes]]:
        delay = self.faults.get("fsync_delay")
        if delay:
            time.sleep(delay)
        frags = self.inner.close()  # data and fd handled as by a real failing fsync: fd closed
        code = self.faults.get("fsync_error")
        if code:
            self.faults.fail("fsync_error", code, self.path, "fsync")
        return frags

    def abort(self) -> None:
        self.inner.abort()


class _Reader:
    def __init__(self, inner, faults: Faults) -> None:
        self.inner, self.faults = inner, faults
        self.path, self.size = inner.path, inner.size

    @property
    def bytes_read(self) -> int:
        return self.inner.bytes_read

    def readinto(self, offset: int, out) -> None:
        code = self.faults.get("read_error")
        if code:
            self.faults.fail("read_error", code, self.path, f"read at {offset}")
        self.inner.readinto(offset, out)

    def close(self) -> None:
        self.inner.close()


def _is_tmp(path: str) -> bool:
    return ".tmp-" in os.path.basename(os.path.normpath(path))


class FaultyStorage(_local.LocalStorage):
    """LocalStorage that fails as ``faults`` says."""

    def __init__(self, faults: Faults) -> None:
        self.faults = faults

    def open_writer(self, path: str, *, direct: bool | None = None, size: int | None = None):
        return _Writer(super().open_writer(path, direct=direct, size=size), self.faults)

    def open_reader(self, path: str):
        return _Reader(super().open_reader(path), self.faults)

    def finish_file(self, path: str, fragments, size: int) -> None:
        delay = self.faults.get("fsync_delay")
        if delay:
            time.sleep(delay)
        super().finish_file(path, fragments, size)
        code = self.faults.get("fsync_error")
        if code:
            self.faults.fail("fsync_error", code, path, "fsync")

    def fsync_dir(self, path: str) -> None:
        code = self.faults.get("fsync_dir_error")
        if code and _is_tmp(path):
            self.faults.fail("fsync_dir_error", code, path, "directory fsync")
        super().fsync_dir(path)

    def write_bytes(self, path: str, data: bytes) -> None:
        code = self.faults.get("manifest_error")
        if code and os.path.basename(path) == "unickpt.json":
            self.faults.fail("manifest_error", code, path, "manifest write")
        super().write_bytes(path, data)

    def read_bytes(self, path: str, limit: int) -> bytes:
        code = self.faults.get("read_bytes_error")
        if code:
            self.faults.fail("read_bytes_error", code, path, "read")
        return super().read_bytes(path, limit)

    def rename_dir(self, src: str, dst: str) -> None:
        code = self.faults.get("rename_error")
        if code and _is_tmp(src):
            self.faults.fail("rename_error", code, src, "rename into place")
        super().rename_dir(src, dst)


# -- the seam ------------------------------------------------------------------------------

_REAL = {}
_ACTIVE: list[Faults] = []
_PARKING: list[bool] = []  # mark_fault_points was called: every storage behind the seam parks
_SEAM = ("unickpt.io.storage", "unickpt.saving.pipeline", "unickpt.loading.pipeline", "unickpt.loading.locate")


def _storage_for(path, storage_options=None):
    """``storage_for`` as save, load, sweep and retain find it in this process: the real
    one's storage, sick (:func:`install`, local storage only) and parking
    (:func:`mark_fault_points`, any storage)."""
    storage, p = _REAL["storage_for"](path, storage_options)
    if _ACTIVE and type(storage) is _local.LocalStorage:
        storage = FaultyStorage(_ACTIVE[-1])
    if _PARKING:
        storage = Parking(storage)
    return storage, p


def _seam(on: bool) -> None:
    import importlib

    mods = [importlib.import_module(m) for m in _SEAM]
    if on and "storage_for" not in _REAL:
        _REAL["storage_for"] = _st.storage_for
        for mod in mods:
            setattr(mod, "storage_for", _storage_for)
    elif not on and "storage_for" in _REAL:
        real = _REAL.pop("storage_for")
        for mod in mods:
            setattr(mod, "storage_for", real)


def _short_pwrite(real):
    def pwrite(fd, data, offset):
        spec = _ACTIVE[-1].get("pwrite_error") if _ACTIVE else None
        if spec is not None:
            f = _ACTIVE[-1]
            with f._lock:
                f.pwrites = getattr(f, "pwrites", 0) + 1
                n = f.pwrites
            if n >= spec[1]:
                f.fail("pwrite_error", spec[0], f"fd {fd}", f"pwrite #{n}")
        mode = _ACTIVE[-1].get("short_writes") if _ACTIVE else None
        n = len(memoryview(data).cast("B")) if not isinstance(data, (bytes, bytearray)) else len(data)
        if mode == "zero" and n:
            return 0
        if mode == "half" and n > 1:
            k = (n // 2) // 4096 * 4096 if n >= 8192 else (n // 2 if not _is_direct(fd) else n)
            if k < n:
                _ACTIVE[-1].injected.append("short pwrite")
            return real(fd, memoryview(data).cast("B")[:k], offset)
        return real(fd, data, offset)

    return pwrite


def _short_write(real):
    def write(fd, data):
        mode = _ACTIVE[-1].get("short_writes") if _ACTIVE else None
        n = len(data)
        if mode == "zero" and n:
            return 0
        if mode == "half" and n > 1 and not _is_direct(fd):
            _ACTIVE[-1].injected.append("short write")
            return real(fd, memoryview(data).cast("B")[: n // 2])
        return real(fd, data)

    return write


def _is_direct(fd: int) -> bool:
    import fcntl

    try:
        return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0))
    except OSError:
        return False


def install(config: dict) -> Faults:
    """Put a :class:`FaultyStorage` with ``config`` behind the storage seam of this process."""
    uninstall()
    faults = Faults(config)
    _seam(True)
    if config.get("short_writes") or config.get("pwrite_error"):
        _REAL["pwrite"], _REAL["write"] = os.pwrite, os.write
        os.pwrite, os.write = _short_pwrite(os.pwrite), _short_write(os.write)
    if config.get("reserve_error"):
        _REAL["fallocate"] = _local._LIBC_FNS.get("fallocate", _MISSING)
        _local._LIBC_FNS["fallocate"] = _failing_fallocate(faults, config["reserve_error"])
    _ACTIVE.append(faults)
    return faults


_MISSING = object()


def _failing_fallocate(faults: Faults, code: int):
    """In place of the C library's fallocate (``storage._libc``): fails with errno ``code``."""
    import ctypes

    def fallocate(fd, mode, offset, size):
        faults.injected.append(f"reserve_error:fd {fd}")
        ctypes.set_errno(code)
        return -1

    return fallocate


def uninstall() -> None:
    """The faults of :func:`install` gone (parking, if :func:`mark_fault_points` set it, stays)."""
    if not _PARKING:
        _seam(False)
    if "pwrite" in _REAL:
        os.pwrite, os.write = _REAL.pop("pwrite"), _REAL.pop("write")
    if "fallocate" in _REAL:
        real = _REAL.pop("fallocate")
        if real is _MISSING:
            _local._LIBC_FNS.pop("fallocate", None)
        else:
            _local._LIBC_FNS["fallocate"] = real
    _ACTIVE.clear()


# -- fault points: a process parked at a named moment, for the test to kill or time it -----

PARK = "FAULTY_PARK"
"""``NAME:SECONDS`` parks at point NAME for SECONDS; ``NAME:SECONDS:FILE`` until FILE exists
(at most SECONDS), so a test orders two processes without betting on their speed. Read at
each storage call, so a process may set it between two saves (asynchronous writers: in the
rank's environment before they start)."""

MARKS = "FAULTY_MARK_DIR"
"""Where set, the points act only once ``$FAULTY_MARK_DIR/armed`` exists, and first create
``$FAULTY_MARK_DIR/at-NAME-PID``."""


class Parking:
    """One storage from the seam (``storage_for`` is called once per save, load, sweep or
    retention) that parks the process at the point :data:`PARK` names, each at most once,
    just before (or, ``after-commit``, just after) the storage call that follows it:

    * ``after-create``: the save's first ``open_writer`` (its files are created, no data written);
    * ``after-data``: the storage's ``close()``, which every rank calls once its writers are
      done (a rank other than the directory's makes no other call after its data), or else
      the first write of a non-data file (index, extra files, manifest) or the commit;
    * ``before-commit``: the commit: its ``lock()`` of the parent (before the manifest goes
      into the temporary, which is then renamed into place), on object stores ``put_marker``;
    * ``after-commit``: once the temporary was renamed (or exchanged) into place, on object
      stores once the manifest marker is put;
    * ``between-renames``: an overwrite without an atomic exchange, after the old checkpoint
      was moved aside (renamed to ``.old-``), before the temporary is renamed into place;
    * ``retention``: before an old checkpoint is retired (its rename to a hidden ``.del-``,
      on object stores the removal of its manifest).
    """

    def __init__(self, inner) -> None:
        self.inner = inner
        self.wrote = False  # a data file was opened for writing: this is a save, past its creates
        self.aside = False  # the commit moved the old checkpoint aside
        self.parked: set[str] = set()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def park(self, name: str) -> None:
        spec = os.environ.get(PARK, "")
        if name in self.parked or not spec.startswith(name + ":"):
            return
        marks = os.environ.get(MARKS)
        if marks:
            if not os.path.exists(os.path.join(marks, "armed")):
                return
            open(os.path.join(marks, f"at-{name}-{os.getpid()}"), "w").close()
        self.parked.add(name)
        secs, _, until = spec.split(":", 1)[1].partition(":")
        deadline = time.monotonic() + float(secs)
        if not until:
            time.sleep(float(secs))
            return
        while not os.path.exists(until) and time.monotonic() < deadline:
            time.sleep(0.02)

    def open_writer(self, path: str, **kw):
        if not self.wrote:
            self.park("after-create")
            self.wrote = True
        return self.inner.open_writer(path, **kw)

    def close(self) -> None:
        if self.wrote:
            self.park("after-data")
        self.inner.close()

    def write_bytes(self, path: str, data: bytes) -> None:
        if self.wrote:
            self.park("after-data")
        self.inner.write_bytes(path, data)

    def lock(self, path: str, timeout_s: float | None = None):
        if self.wrote:
            self.park("after-data")
            self.park("before-commit")
        return self.inner.lock(path, timeout_s)

    def put_marker(self, path: str, data: bytes, **kw) -> None:
        if self.wrote:
            self.park("after-data")
            self.park("before-commit")
        self.inner.put_marker(path, data, **kw)
        self.park("after-commit")

    def rename_dir(self, src: str, dst: str) -> None:
        if ".del-" in self.inner.basename(dst):
            self.park("retention")
        if self.aside:
            self.park("between-renames")
        self.inner.rename_dir(src, dst)
        if ".old-" in self.inner.basename(dst):
            self.aside = True
        if _is_tmp(src):
            self.park("after-commit")

    def exchange_dirs(self, a: str, b: str) -> bool:
        done = self.inner.exchange_dirs(a, b)
        if done and _is_tmp(a):
            self.park("after-commit")
        return done

    def remove_file(self, path: str) -> None:
        if not self.inner.caps.atomic_rename and self.inner.basename(path) == "unickpt.json":
            self.park("retention")
        self.inner.remove_file(path)


def mark_fault_points(writers: bool = True) -> None:
    """The fault points (:class:`Parking`) behind the storage seam of this process, and, with
    ``writers``, of the asynchronous writer processes it starts (:func:`writer_main`)."""
    if not _PARKING:
        _PARKING.append(True)
    _seam(True)
    if writers:
        from unickpt.async_save import writer

        if writer.main is not writer_main:
            _REAL.setdefault("writer_main", writer.main)
            writer.main = writer_main  # what Checkpointer spawns (started by name)


def writer_main(*args) -> None:
    """The asynchronous writer process, with the fault points."""
    from unickpt.async_save import writer

    mark_fault_points(writers=False)
    cfg = os.environ.get("UNICKPT_TEST_FAULTS")
    if cfg:  # faults for this writer (set in its rank's environment before it was started)
        import json

        install(json.loads(cfg))
    (_REAL.get("writer_main") or writer.main)(*args)


def writer_cannot_join(conn, *args) -> None:
    """An asynchronous writer whose group set-up fails (its peers cannot be reached): it
    replies as the real one does, then exits."""
    conn.send_bytes(b'{"ok": false, "error": "writer group setup failed: injected"}')


def writer_starts_slowly(conn, *args) -> None:
    """An asynchronous writer still starting (an interpreter importing for minutes): it never
    reaches the writers' group. A test kills it."""
    import time

    time.sleep(600)


def writer_exits(conn, *args) -> None:
    """An asynchronous writer that dies before joining its group, without a word."""
    os._exit(3)
