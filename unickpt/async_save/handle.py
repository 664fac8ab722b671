"""The handle of one asynchronous save (:class:`AsyncSave`): when its state is staged, when
it is committed, its result or its error, its progress reports; and what a rank whose
writer died can say of the save's outcome (:func:`committed_now`).

A handle reads nothing itself: it asks the checkpointer that made it (:mod:`.client`) to
read its writer's messages, and the progress callback runs in the thread that polls it."""

from __future__ import annotations

import collections
import os
import stat
import threading
import time
from typing import TYPE_CHECKING

from .._metrics import log
from ..errors import AsyncSaveError, InvalidArgumentError
from ..manifest import MANIFEST_NAME
from ..saving import ProgressFn
from .protocol import writer_path

if TYPE_CHECKING:
    from .client import Checkpointer

__all__ = ["AsyncSave", "committed_now", "manifest_stat"]


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
        self._signature = ""  # of the staged entries (staging.place)
        self._n_entries = 0
        self._before = manifest_stat(path)  # what stood at the path (an overwrite): told from this save's

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


# -- what a dead writer's save left ---------------------------------------------------------------


def _local(path) -> str | None:
    """``path`` made absolute, if it is one local directory (not a URL, not node-local)."""
    p = writer_path(path)
    return None if "://" in p or "{node}" in p else p


def manifest_stat(path) -> tuple | None:
    """Identity of the committed manifest (a regular file) at local ``path``, or None."""
    p = _local(path)
    try:
        st = os.lstat(os.path.join(p, MANIFEST_NAME)) if p is not None else None
    except (OSError, ValueError):
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size) if st is not None and stat.S_ISREG(st.st_mode) else None


def committed_now(path: str, before: tuple | None = None) -> str:
    """What a rank whose writer died can say of the save: the other ranks' writers fail at
    their next collective, unless they had passed the commit's last agreement, so a
    committed checkpoint there may be this save's (``before``: the manifest that stood there
    when the save began, which an overwrite leaves in place until its commit)."""
    p = _local(path)
    if p is None:
        return "the outcome is unknown here (check unickpt.latest() before relying on it)"
    now = manifest_stat(p)
    if now is None:
        return (f"{p} is not committed now; unless the other ranks' writers had passed the commit, they fail "
                "too and it stays so (check unickpt.latest() before relying on it)")
    if now == before:
        return (f"{p} still holds the checkpoint that was there before this save; unless the other ranks' "
                "writers had passed the commit, they fail too and it stays so (check unickpt.read_manifest "
                "before relying on it)")
    return (f"{p} is committed (the other ranks' writers had passed the commit); check it with "
            "unickpt.read_manifest before relying on it")
