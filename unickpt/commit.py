"""Atomic commit: a checkpoint is either complete and valid, or invisible.

A save writes into a hidden sibling ``.NAME.tmp-TOKEN``; every data file is fsynced by its
writer; the coordinator then writes the index and, last, the manifest, fsyncs the
directory, renames it to ``NAME`` and fsyncs the parent. A directory is a *committed*
checkpoint iff its name is final and it holds ``unickpt.json``. "Latest" is found by
scanning ``step-*`` directories, never through a pointer file that could run ahead of
durable data.
"""

from __future__ import annotations

import re
import uuid

from .errors import CheckpointExistsError, CheckpointNotFoundError
from .manifest import MANIFEST_NAME
from .storage import Storage

__all__ = ["step_dirname", "tmp_name", "is_committed", "committed_steps", "resolve", "sweep_stale", "publish"]

_STEP = re.compile(r"^step-(\d+)$")
_TMP = re.compile(r"^\.(.+)\.(tmp|old)-[0-9a-f]{8,32}$")


def step_dirname(step: int) -> str:
    return f"step-{step:08d}"


def new_token() -> str:
    return uuid.uuid4().hex[:16]


def tmp_name(final_name: str, token: str) -> str:
    return f".{final_name}.tmp-{token}"


def is_committed(storage: Storage, path: str) -> bool:
    return storage.isdir(path) and storage.exists(storage.join(path, MANIFEST_NAME))


def committed_steps(storage: Storage, root: str) -> list[tuple[int, str]]:
    """``(step, path)`` of committed ``step-*`` checkpoints under ``root``, oldest first."""
    out = []
    for name in storage.listdir(root):
        m = _STEP.match(name)
        if m:
            p = storage.join(root, name)
            if is_committed(storage, p):
                out.append((int(m.group(1)), p))
    return sorted(out)


def resolve(storage: Storage, path: str) -> str:
    """A committed checkpoint directory: ``path`` itself, or the newest committed
    ``step-*`` checkpoint under it."""
    if is_committed(storage, path):
        return path
    steps = committed_steps(storage, path)
    if steps:
        return steps[-1][1]
    if storage.isdir(path):
        raise CheckpointNotFoundError(
            f"{path}: no committed checkpoint here ({MANIFEST_NAME} missing) and no committed step-* checkpoint below"
        )
    raise CheckpointNotFoundError(f"{path}: no such checkpoint directory")


def sweep_stale(storage: Storage, root: str, final_name: str | None = None) -> list[str]:
    """Remove temporary directories left by interrupted saves (all, or those of one name).

    Only call this when no save into ``root`` is in flight.
    """
    removed = []
    for name in storage.listdir(root):
        m = _TMP.match(name)
        if m and (final_name is None or m.group(1) == final_name):
            p = storage.join(root, name)
            storage.remove_tree(p)
            removed.append(p)
    return removed


def check_destination(storage: Storage, final: str, overwrite: bool, any_dir: bool = False) -> None:
    """Refuse to replace what is at ``final`` unless asked; ``any_dir``: the destination is
    not a checkpoint (an export folder), so any directory may be replaced with ``overwrite``."""
    if storage.exists(final):
        if not storage.isdir(final):
            raise CheckpointExistsError(f"{final}: exists and is not a directory")
        if any_dir:
            if not overwrite:
                raise CheckpointExistsError(f"{final}: already exists (use --overwrite / overwrite=True to replace it)")
            return
        if is_committed(storage, final) and not overwrite:
            raise CheckpointExistsError(f"{final}: a committed checkpoint is already there (pass overwrite=True to replace it)")
        if not is_committed(storage, final) and storage.listdir(final):
            raise CheckpointExistsError(
                f"{final}: exists, is not a checkpoint and is not empty; refusing to replace it"
            )


def publish(storage: Storage, tmp: str, final: str) -> None:
    """Make ``tmp`` (complete, fsynced) visible as ``final`` atomically.

    An existing checkpoint at ``final`` stays intact until the new one is in place: the two
    are swapped atomically where the OS can (renameat2), else the old one is moved aside
    first and removed only after the new one is visible.
    """
    parent = storage.parent(final)
    storage.fsync_dir(tmp)
    if storage.exists(final):
        if storage.exchange_dirs(tmp, final):
            _fsync_quietly(storage, parent)
            storage.remove_tree(tmp)  # now holds the old checkpoint
            return
        aside = storage.join(parent, f".{storage.basename(final)}.old-{new_token()}")
        storage.rename_dir(final, aside)
        try:
            storage.rename_dir(tmp, final)
        except BaseException:
            storage.rename_dir(aside, final)  # put the old checkpoint back
            raise
        _fsync_quietly(storage, parent)
        storage.remove_tree(aside)
        return
    storage.rename_dir(tmp, final)
    _fsync_quietly(storage, parent)


def _fsync_quietly(storage: Storage, parent: str) -> None:
    """After the rename the checkpoint is committed: a failing directory fsync is logged, not raised."""
    try:
        storage.fsync_dir(parent)
    except OSError as e:
        from ._metrics import log

        log.warning("fsync of %s failed after commit: %s", parent, e)


def require_parent(storage: Storage, final: str) -> None:
    parent = storage.parent(final)
    if not storage.isdir(parent):
        storage.makedirs(parent)
