"""Whether the process that owns something outside this process (a temporary directory, a
memory-tier directory, a staging segment) still runs: commit's owner records (:func:`me`,
:func:`record_alive`), the memory tier's (:func:`group_record`, :func:`group_alive`), an
asynchronous writer's watch on the trainer that started it, and node-shared reads' watch on
the node's other ranks (:func:`start_ticks`).

A process is named by ``(host, pid, start time)``, never by its pid alone: pids repeat (a
container restarted in a fresh PID namespace gets the same small pids again), so a record
whose pid runs now but started at another time names a process that is gone.
"""

from __future__ import annotations

import os
import socket
import time

__all__ = ["start_time", "start_ticks", "me", "act_for", "runs", "record_alive", "group_record", "group_alive"]

SAME_START_S = 1.0
"""Start times that differ by less than this name the same process (clock granularity)."""


def start_time(pid: int) -> float | None:
    """When process ``pid`` of this host started (seconds since the epoch), or None when no
    such process runs here (or it is a zombie: it has exited)."""
    import psutil

    if type(pid) is not int or pid <= 0:  # (a record naming no process: psutil raises ValueError)
        return None
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc.create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.Error:  # (access denied: it runs, its start time unknown)
        return float("nan")


def start_ticks(pid: int) -> int | None:
    """When process ``pid`` started as the kernel counts it (clock ticks after boot, from
    ``/proc/PID/stat``), or None when no such process runs here (or it is a zombie: it has
    exited). Exact: two processes of one host that read it for the same process read the
    same number, so it can be compared for equality (shared-memory status words), where
    :func:`start_time` (seconds since the epoch: the boot time, read anew each time, may
    move by a second) needs :data:`SAME_START_S`. Linux only (None elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return None if fields[0] in (b"Z", b"X", b"x") else int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


_PRINCIPAL: dict | None = None
"""The process this one works for (:func:`act_for`), named in its owner records."""


def act_for(pid: int, started: float | None) -> None:
    """This process works for process ``pid`` of this host (started at ``started``): an
    asynchronous writer for its trainer. Owner records this process makes from now on name
    both, and count as gone once either is: a writer outlives its trainer only until its
    watchdog notices, and a sweep must not wait on that."""
    global _PRINCIPAL
    _PRINCIPAL = {"pid": int(pid), "started": started}


def me() -> dict:
    """This process's owner record: host, pid, start time, when the record was made and,
    where set, the process it works for (``"for"``, :func:`act_for`)."""
    pid = os.getpid()
    rec = {"host": socket.gethostname(), "pid": pid, "started": start_time(pid), "time": time.time()}
    if _PRINCIPAL is not None:
        rec["for"] = dict(_PRINCIPAL)
    return rec


def runs(pid: int, started: float | None) -> bool:
    """Process ``pid`` of this host runs and, where ``started`` is known, is the one that
    started then (not a later process given the same pid)."""
    now = start_time(pid)
    if now is None:
        return False
    if started is None or started != started or now != now:  # a start time not known then or now: the pid decides
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
    return runs(pid, started) and _principal_runs(rec.get("for"))


def _principal_runs(rec) -> bool:
    """The process an owner works for (``"for"`` of :func:`me`) still runs; True when the
    record names none (or one that does not parse: the owner's own liveness decides)."""
    if not isinstance(rec, dict):
        return True
    try:
        pid, started = int(rec["pid"]), rec.get("started")
        started = None if started is None else float(started)
    except Exception:
        return True
    return runs(pid, started)


def group_record(pids: list[int]) -> dict:
    """The record of several processes of this host (a job's ranks on one node):
    ``{"host", "pids": sorted, "started": {"PID": start time}}``, the start times that are
    known (pids repeat across PID namespaces)."""
    started = {str(p): start_time(p) for p in sorted(pids)}
    return {"host": socket.gethostname(), "pids": sorted(pids),
            "started": {p: t for p, t in started.items() if t is not None and t == t}}


def group_alive(rec) -> list[int]:
    """The pids of a :func:`group_record` (or a dict with its keys) that still run on this
    host, this process left out: the same processes (pid and start time; a pid without a
    start time is judged by pid). None, another host's record, or fields that do not parse:
    no live pid."""
    if not isinstance(rec, dict) or rec.get("host") != socket.gethostname():
        return []
    started = rec.get("started")
    started = started if isinstance(started, dict) else {}
    live = []
    for pid in rec.get("pids", []) if isinstance(rec.get("pids"), list) else []:
        if type(pid) is int and 0 < pid != os.getpid():
            t = started.get(str(pid))
            if runs(pid, float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else None):
                live.append(pid)
    return live
