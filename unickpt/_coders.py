"""The threads a process codes on: lossless frames (:mod:`unickpt.container`) and quantized
chunks (:mod:`unickpt.saving.writer`) are coded several at once while the writing thread
writes the finished ones in order. zstd, numpy and torch release the GIL for the work.

One pool per process (a child forked after its parent coded makes its own: an executor
inherited through fork has no threads, and submitting to it would wait forever).
"""

from __future__ import annotations

import os
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, TypeVar

__all__ = ["CODERS", "coders", "in_order"]

_T = TypeVar("_T")

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


def in_order(jobs: Iterable[Callable[[], _T]], window: int | None = None) -> Iterator[_T]:
    """The results of ``jobs`` in their order, the jobs run on the coder threads at most
    ``window`` at once (default: twice the threads; memory stays bounded), or on the caller's
    thread where there is one core. Closing the iterator early (an error in the caller)
    cancels the jobs not started and waits for the running ones, so none still reads the
    caller's buffers once it goes on."""
    pool = coders()
    if pool is None:
        for job in jobs:
            yield job()
        return
    window = window or 2 * pool._max_workers
    running: deque = deque()
    try:
        for job in jobs:
            running.append(pool.submit(job))
            if len(running) >= window:
                yield running.popleft().result()
        while running:
            yield running.popleft().result()
    finally:
        for fut in running:
            if not fut.cancel():
                fut.exception()
