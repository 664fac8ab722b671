"""Reader leases on committed ``step-*`` checkpoints: files under ``ROOT/.leases/`` named
``step-N.TOKEN``, each holding its reader's owner record (:func:`unickpt.liveness.me`). A
checkpoint a live lease names is not retired (:func:`unickpt.io.commit.retain` checks under
the root's commit lock, where readers take theirs: a lease is either seen there or finds its
checkpoint gone). Live: its process runs (this host), or it was written less than
:data:`LEASE_STALE_S` ago (another host). Written by :class:`unickpt.WeightSubscriber`."""

from __future__ import annotations

import json
import time

from .catalog import step_of_name

__all__ = ["LEASES", "LEASE_STALE_S", "leased_steps"]

LEASES = ".leases"
LEASE_STALE_S = 600.0
"""Seconds another host's lease counts as live after it was written (a load longer than this
from another host may have its checkpoint retired under it: the load then fails, typed)."""


def _leases(storage, root: str) -> list[tuple[str, int, object, float]]:
    """``(lease path, step, owner record or None, mtime)`` of every regular lease file."""
    d = storage.join(root, LEASES)
    if not storage.isdir(d):
        return []
    out = []
    for name in storage.listdir(d):
        path = storage.join(d, name)
        step = step_of_name(name.split(".", 1)[0])
        if step is None or not storage.isfile(path):
            continue
        try:
            rec = json.loads(storage.read_bytes(path, 4096))
            mtime = storage.mtime(path)
        except Exception:  # (a file that vanished, or no owner record: not a lease anyone holds)
            rec, mtime = None, 0.0
        out.append((path, step, rec, mtime))
    return out


def _alive(rec, mtime: float, now: float) -> bool:
    from ..liveness import record_alive

    return isinstance(rec, dict) and record_alive(rec, mtime, now, grace=60.0, stale=LEASE_STALE_S)


def leased_steps(storage, root: str, clear: bool = False) -> set[int]:
    """The steps under ``root`` a live lease names; ``clear``: remove the leases of readers
    that are gone (call under the root's commit lock)."""
    now = time.time()
    live = set()
    for path, step, rec, mtime in _leases(storage, root):
        if _alive(rec, mtime, now):
            live.add(step)
        elif clear:
            try:
                storage.remove_file(path)
            except OSError:
                pass
    return live
