"""Whether the process that owns something outside this process (a temporary directory, a
memory-tier directory, a staging segment) still runs: commit's owner records, the memory
tier's, and an asynchronous writer's watch on the trainer that started it.

A process is named by ``(host, pid, start time)``, never by its pid alone: pids repeat (a
container restarted in a fresh PID namespace gets the same small pids again), so a record
whose pid runs now but started at another time names a process that is gone.
"""

from __future__ import annotations

import os
import socket
import time

__all__ = ["start_time", "me", "runs", "record_alive"]

SAME_START_S = 1.0
"""Start times that differ by less than this name the same process (clock granularity)."""


def start_time(pid: int) -> float | None:
    """When process ``pid`` of this host started (seconds since the epoch), or None when no
    such process runs here (or it is a zombie: it has exited)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc.create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.Error:  # (access denied: it runs, its start time unknown)
        return float("nan")


def me() -> dict:
    """This process's owner record: host, pid, start time and when the record was made."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "started": start_time(pid), "time": time.time()}


def runs(pid: int, started: float | None) -> bool:
    """Process ``pid`` of this host runs and, where ``started`` is known, is the one that
    started then (not a later process given the same pid)."""
    now = start_time(pid)
    if now is None:
        return False
    if started is None or now != now:  # no start time recorded, or it cannot be read: the pid decides
        return True
    return abs(now - started) < SAME_START_S


def record_alive(rec, mtime: float, now: float, *, grace: float, stale: float) -> bool:
    """An owner record (:func:`me`) names a live process: this host's process still runs (same
    start time), or another host's record changed less than ``stale`` seconds ago. A record
    that does not parse counts as alive for ``grace`` seconds after ``mtime``."""
    try:
        host, pid = rec["host"], int(rec["pid"])
        started = rec.get("started")
        started = None if started is None else float(started)
    except Exception:
        return now - mtime < grace
    if host != socket.gethostname():
        return now - mtime < stale
    return runs(pid, started)
