"""The threads a process codes on: lossless frames (:mod:`unickpt.container`) and quantized
chunks (:mod:`unickpt.saving.writer`) are coded several at once while the writing thread
writes the finished ones in order. zstd, numpy and torch release the GIL for the work.

One pool per process (a child forked after its parent coded makes its own: an executor
inherited through fork has no threads, and submitting to it would wait forever).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["CODERS", "coders"]

CODERS = 4
"""Most coder threads (``0``/``1``: the writing thread codes alone)."""

_POOL: dict[int, ThreadPoolExecutor | None] = {}  # pid -> this process's coders
_LOCK = threading.Lock()


def coders() -> ThreadPoolExecutor | None:
    """This process's coder threads: as many as it may use cores, at most :data:`CODERS`;
    None for one (the caller codes)."""
    pid = os.getpid()
    with _LOCK:
        if pid not in _POOL:
            _POOL.clear()
            try:
                cores = len(os.sched_getaffinity(0))
            except AttributeError:
                cores = os.cpu_count() or 1
            n = min(CODERS, cores)
            _POOL[pid] = ThreadPoolExecutor(n, thread_name_prefix="unickpt-coder") if n > 1 else None
        return _POOL[pid]
