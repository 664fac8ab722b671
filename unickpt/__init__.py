"""unickpt: unified, strategy-independent checkpoints for distributed training.

Public API (docs/api.md)::

    unickpt.UnifiedCheckpoint(dir, every=..., keep=..., async_save=..., quant=..., memory_dir=...)
        .resume(state) -> step or None; .step(n, state); .save(n, state); .wait_for_staging(); .close()
    unickpt.save(state_dict, path, *, step=None, group=None, options=SaveOptions(...)) -> SaveResult
    unickpt.save_async(state_dict, path, *, ...) -> AsyncSave (wait(), done(), error)
    unickpt.start_async_writer(state_dict=None, group=None) -> the asynchronous writer (and staging), now
    unickpt.load(state_dict, path, *, group=None, options=LoadOptions(...), missing="error",
                 unexpected="ignore", cast=False) -> LoadResult
    unickpt.shard(local, shape, offsets=..., sizes=..., flat=..., replica=...) -> ShardedTensor
    unickpt.partition_flat(shapes, world, rank) -> ZeRO pieces of a flat buffer
    unickpt.per_rank(value) -> a value stored once per rank (RNG states, data positions)
    unickpt.latest(root) -> newest committed checkpoint under root (or None)
    unickpt.sweep(root) -> remove temporaries of interrupted saves under root
    unickpt.retain(root, keep) -> delete all but the newest ``keep`` committed checkpoints
    unickpt.read_manifest(path) -> (checkpoint dir, Manifest)
    unickpt.load_for_inference(path, dtype=..., tp_rank=..., tp_size=..., keys=...) -> model weights
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import errors
from ._version import __version__


# The API is imported on first use (PEP 562): ``import unickpt.cli`` must not import torch
# before the CLI's ``main`` runs, so that a Ctrl-C while torch loads is handled there.
_LAZY = {
    "Layout": ".layout", "ShardedTensor": ".layout", "partition_flat": ".layout", "shard": ".layout",
    "LoadResult": ".loading", "LoadOptions": ".loading", "load": ".loading", "read_manifest": ".loading",
    "AsyncSave": ".async_save", "load_for_inference": ".inference", "SaveResult": ".saving", "SaveOptions": ".saving",
    "save": ".api", "save_async": ".api", "start_async_writer": ".api", "UnifiedCheckpoint": ".manager",
    "Compression": ".compress", "PerRank": ".state", "per_rank": ".state", "Mapping": ".mapping",
    "WeightSubscriber": ".publish",
}
if TYPE_CHECKING:
    from .api import save, save_async, start_async_writer
    from .async_save import AsyncSave
    from .compress import Compression
    from .inference import load_for_inference
    from .layout import Layout, ShardedTensor, partition_flat, shard
    from .loading import LoadOptions, LoadResult, load, read_manifest
    from .manager import UnifiedCheckpoint
    from .mapping import Mapping
    from .publish import WeightSubscriber
    from .saving import SaveOptions, SaveResult
    from .state import PerRank, per_rank


def sweep(root, *, storage_options=None, timeout_s: float | None = None) -> list[str]:
    """Remove what interrupted saves left under ``root`` (temporary directories; on object
    stores, the objects of writes whose owner is gone) and return what was removed. Safe
    while other saves run: only provably abandoned writes are touched. The root's commit
    lock is waited for at most 0.8 x ``timeout_s`` (default ``UNICKPT_TIMEOUT_S``, else
    600 s): :class:`~unickpt.errors.LockTimeoutError` beyond."""
    from .io.commit import sweep_stale
    from .io.storage import storage_for

    storage, p = storage_for(root, storage_options)
    return sweep_stale(storage, p, timeout_s=timeout_s)


def retain(root, keep: int, *, storage_options=None, timeout_s: float | None = None) -> list[str]:
    """Delete all but the newest ``keep`` committed ``step-*`` checkpoints under ``root``
    (only behind newer checkpoints whose manifests read and whose files are there: with
    ``{node}`` in ``root``, the files this node wrote or holds copies of; the newest is
    never deleted; nor is an old step whose directory holds another committed checkpoint,
    such as an export put inside it: it is kept, with a warning).
    Each is hidden atomically before its files go (object stores: its manifest, the commit
    marker, is deleted first), so a crash never leaves half of one visible. Returns the
    deleted paths. ``timeout_s`` bounds the wait for the root's commit lock, as for :func:`sweep`."""
    from .io.commit import retain as _retain
    from .io.storage import per_node, storage_for
    from .transport import node_id

    storage, p = storage_for(root, storage_options)
    return _retain(storage, p, keep, node_id() if per_node(root) else None, timeout_s=timeout_s)


def latest(root, *, storage_options=None) -> str | None:
    """Path (or URL) of the newest committed ``step-*`` checkpoint under ``root``, or None.
    Checked as ``load(root)`` checks it: a newest step whose manifest does not read, or says
    another step than its name (a copy of an older step under a newer name), raises a
    :class:`~unickpt.errors.FormatError` (or the error that reading it met) naming it and
    the older steps, never returns a step other than the one its name says."""
    from .io.catalog import newest
    from .io.storage import storage_for

    storage, p = storage_for(root, storage_options)
    return newest(storage, p)


def __dir__() -> list[str]:
    """The public names, the lazily imported ones included (``dir(unickpt)``, completion)."""
    return sorted({n for n in globals() if n.startswith("__")} | set(__all__) | {"dcp"})


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    # ``unickpt.dcp`` (torch.distributed.checkpoint reader/writer) is imported on first use:
    # importing torch.distributed.checkpoint costs time every other user would pay
    if name == "dcp":
        import importlib

        return importlib.import_module(".dcp", __name__)
    raise AttributeError(f"module 'unickpt' has no attribute {name!r}")


__all__ = [
    "Compression",
    "Mapping",
    "WeightSubscriber",
    "__version__",
    "errors",
    "save",
    "save_async",
    "start_async_writer",
    "load",
    "SaveOptions",
    "LoadOptions",
    "UnifiedCheckpoint",
    "SaveResult",
    "AsyncSave",
    "LoadResult",
    "Layout",
    "ShardedTensor",
    "shard",
    "partition_flat",
    "latest",
    "sweep",
    "retain",
    "read_manifest",
    "load_for_inference",
    "per_rank",
    "PerRank",
]
