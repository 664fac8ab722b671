"""Run the ``unickpt`` command line from a test.

:func:`cli` runs :func:`unickpt.cli.main` in the test's process, close to what a fresh
interpreter shows: stdout and stderr captured, Python's default warning filters with each
warning printed on stderr (after the command's own output), the library's log records at
WARNING and above on stderr (Python's last-resort handler, since the CLI configures no
logging), the environment restored after, and a hang failing the test after ``timeout``
seconds. No interpreter start: ~2 s of ``import torch`` saved per call.

What it cannot show, so a test that needs it uses :func:`cli_process` (``python -m
unickpt.cli`` in a new process): warnings already shown once in this process
(``TORCH_WARN_ONCE``, warn-once loggers, import-time warnings), other libraries' loggers
and handlers bound to an earlier stderr (transformers'), bytes written straight to fd 2,
and the process itself (the entry point, signals, a closed pipe, kill -9).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import subprocess
import sys
import warnings

__all__ = ["cli", "cli_process", "CliHung"]


class CliHung(BaseException):
    """A command did not return in time. Not an ``Exception`` (``TimeoutError`` is an
    ``OSError``, which the CLI reports as a user error with exit 2): nothing in the CLI or the
    library catches it, so the test fails."""


def cli(*args, timeout: int = 60) -> subprocess.CompletedProcess:
    """``unickpt ARGS`` in this process; an exception that leaves ``main`` propagates (a bug:
    the CLI must turn every error into an exit code), as does :class:`CliHung`."""
    from unickpt.cli import main

    argv = [str(a) for a in args]

    def hung(signum, frame):
        raise CliHung(f"unickpt {' '.join(argv[:1])} did not return within {timeout} s")

    out, err = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(err)
    handler.setLevel(logging.WARNING)
    logger = logging.getLogger("unickpt")
    saved_env = dict(os.environ)
    saved_propagate = logger.propagate
    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(timeout)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.resetwarnings()  # the filters of `python -m unickpt.cli`, not pytest's
            warnings.simplefilter("default")
            for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                warnings.filterwarnings("ignore", category=category)
            logger.addHandler(handler)
            logger.propagate = False
            try:
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                    rc = main(argv)
            except BaseException as e:  # a bug or a hang: the test shows what the command printed
                e.add_note(f"unickpt {' '.join(argv)}\n--- stdout ---\n{out.getvalue()}--- stderr ---\n{err.getvalue()}")
                raise
        for w in caught:
            err.write(warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        logger.removeHandler(handler)
        logger.propagate = saved_propagate
        os.environ.clear()
        os.environ.update(saved_env)
    return subprocess.CompletedProcess(["unickpt", *argv], rc, out.getvalue(), err.getvalue())


def cli_process(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m unickpt.cli ARGS`` in a new process."""
    return subprocess.run([sys.executable, "-m", "unickpt.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)
