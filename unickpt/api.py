"""``unickpt.save``: checks the options once, then saves in this process or hands the state to
the rank's asynchronous writer.

It lives here, not in :mod:`unickpt.saving`, so the dependency is one way:
``api -> async_save -> saving`` and ``api -> saving``; the save pipeline knows nothing of the
asynchronous machinery that runs it in a writer process.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Any, Mapping, Sequence

from .async_save import AsyncSave, checkpointer
from .errors import InvalidArgumentError
from .format import Hasher
from .io.catalog import check_destination
from .io.storage import compared_path, per_node
from .saving import ProgressFn, SaveOptions, SaveResult, save_entries
from .stateful import for_save
from .transport import Comm


__all__ = ["save", "save_async", "start_async_writer"]


def save(
    state_dict: Mapping[str, Any],
    path: str | os.PathLike,
    *,
    step: int | None = None,
    group: Any = None,
    options: SaveOptions | None = None,
    progress: ProgressFn | None = None,
    **deprecated: Any,
) -> SaveResult:
    """Save ``state_dict`` as the checkpoint directory ``path``; collective over ``group``.

    Every rank passes its own state dict: plain tensors (full, identical on every rank: a
    save refuses plain tensors whose values differ between ranks), :class:`~unickpt.ShardedTensor`
    pieces, or ``DTensor``; nested dicts whose top-level keys name roles (``model``,
    ``master``, ``optimizer``...); JSON values and ``bytes`` (kept from rank 0; ``bytes`` are
    stored verbatim, never unpickled); :func:`~unickpt.per_rank` values (one per rank: RNG
    states, data positions, a data loader). Top-level values may also be stateful objects
    (``nn.Module``, optimizers, LR schedulers, anything with ``state_dict()`` and
    ``load_state_dict()``): their state dicts are saved, as ``torch.distributed.checkpoint``
    does (see :mod:`unickpt.stateful`). Tensors of one role that are the same memory (tied
    weights) are stored once. A top-level ``transformers`` model also writes its
    ``config.json`` (and ``generation_config.json``).

    Args:
        path: checkpoint directory; built under a hidden temporary sibling and renamed into
            place at commit. Refuses to replace a committed checkpoint unless
            ``options.overwrite``. A path containing ``{node}`` names node-local storage: each
            node writes its files into the path with ``{node}`` replaced by its node id
            (``UNICKPT_NODE_ID``, else the host name), and every node's
            directory gets the complete manifest. A URL (``scheme://...``) is kept as given.
        step: recorded in the manifest (a ``step-N`` directory records N when it is not given;
            every reader checks the name against it).
        group: the process group (None: the default group, or this process alone).
        options: everything else (:class:`SaveOptions`: compression, overwrite, extra state,
            timeouts, storage options, file sizes...).
        progress: called as ``progress(bytes_done, bytes_total)`` for this rank's writes, with
            increasing values ending at ``(total, total)``, in this thread. A callback that
            raises is logged once and not called again; it never fails the save.

    Every option is checked before anything is written, and the check is agreed over
    ``group``: when one rank's options are bad, that rank raises its error
    (:class:`~unickpt.errors.StateDictError` for ``step``, ``extra``, ``strategy``,
    ``extra_files``; :class:`~unickpt.errors.InvalidArgumentError` for the others) and the
    others a :class:`~unickpt.errors.DistributedError` naming it.

    Returns:
        :class:`~unickpt.SaveResult` with files, bytes, seconds and per-phase timings.

    Example::

        unickpt.save({"model": model, "optim": opt, "step": 100}, "ckpt/step-00000100", step=100)
        unickpt.save(state, path, options=unickpt.SaveOptions(compression=unickpt.Compression(quant="O1")))
    """
    legacy, more = _legacy_save(deprecated, options) if deprecated else (None, {})
    if more.pop("async_save", False):
        return _save(state_dict, path, step, group, options, progress, async_save=True, legacy=legacy, **more)
    if more:
        raise TypeError(f"save() got keyword argument(s) {sorted(more)} of save_async(): use unickpt.save_async")
    return _save(state_dict, path, step, group, options, progress, async_save=False, legacy=legacy)


def save_async(
    state_dict: Mapping[str, Any],
    path: str | os.PathLike,
    *,
    step: int | None = None,
    group: Any = None,
    options: SaveOptions | None = None,
    progress: ProgressFn | None = None,
    background_staging: bool = False,
    also: Sequence[str | os.PathLike] = (),
) -> AsyncSave:
    """:func:`save`, returning as soon as this rank's state is copied into a reused
    shared-memory staging buffer; a persistent writer process per rank does the rest
    (docs/async.md). The tensors may be modified once this returns.

    Args:
        path, step, group, options: as for :func:`save`.
        progress: as for :func:`save`; the writer process reports at most about 10 times a
            second (plus the final value), and the callback runs, in order, in the thread
            that polls the handle: ``done()``, ``error``, ``wait()``, and the next save.
        background_staging: return even before the copy; call ``handle.wait_staged()``
            before modifying any tensor of the state dict.
        also: more checkpoint paths the writer processes write from the same staging memory
            after ``path`` (with ``replicas=0``), each a complete, separately committed
            checkpoint (a durable copy of a memory snapshot for the price of one staging
            copy). ``handle.results`` lists every result.

    Returns:
        :class:`~unickpt.AsyncSave`: ``wait()`` gives the result (raises if the save failed on
        any rank), ``done()``, ``staged()``, ``wait_staged()``.
    """
    return _save(state_dict, path, step, group, options, progress, async_save=True,
                 background_staging=background_staging, also=also)


def _save(state_dict, path, step, group, options, progress, *, async_save: bool, background_staging: bool = False,
          also=(), legacy: dict | None = None):
    err: BaseException | None = None
    opts = None
    same = None
    try:
        if options is not None and not isinstance(options, SaveOptions):
            raise InvalidArgumentError(f"options must be a unickpt.SaveOptions, got {type(options).__name__}")
        opts = _legacy_options(legacy) if legacy is not None else options or SaveOptions()
        if step is not None:
            if opts.step is not None and opts.step != step:
                raise InvalidArgumentError(f"step={step!r} and options.step={opts.step!r} differ: give one")
            opts = replace(opts, step=step)
        extra_files = _hf_files(state_dict, None, opts.extra_files)
        if extra_files is not opts.extra_files:
            opts = replace(opts, extra_files=extra_files)
        state_dict = for_save(state_dict)
        if isinstance(also, (str, bytes, os.PathLike)):
            raise InvalidArgumentError(f"also must be a list of paths, got one path {also!r}: pass [path]")
        also = tuple(also)
        for p in (path, *also):
            check_destination(p, opts.step)
        if opts.replicas and not per_node(path):  # (the count of nodes is checked with the plan)
            raise InvalidArgumentError(f"{os.fspath(path)}: replicas need node-local storage ({{node}} in the path)")
        if type(background_staging) is not bool:
            raise InvalidArgumentError(f"background_staging must be True or False, got {background_staging!r}")
        if also:
            from .async_save import writer_path

            where = [writer_path(p) for p in (path, *also)]
            twice = sorted({w for w in where if where.count(w) > 1})
            if twice:
                raise InvalidArgumentError(f"also= names {twice} twice (with the path itself): each copy needs a "
                                           "path of its own")
        _check_shared(path, opts.storage_options, async_save, group)
        same = _call_args(path, opts, async_save=async_save, also=[compared_path(p) for p in also])
    except Exception as e:  # agreed below: a rank alone with bad options must not strand the others
        err, same = e, None
    comm = Comm(group, timeout_s=opts.timeout_s if opts is not None else None)
    comm.agree(err, "save (checking the options)", same=same)
    if async_save:
        return checkpointer(group).save(state_dict, path, opts, background_staging=background_staging, progress=progress,
                                        also=also)
    return save_entries(comm, None, state_dict, path, opts, progress)


_SAVE_MOVED = ("extra", "overwrite", "bucket_bytes", "max_file_bytes", "direct_io", "strategy", "extra_files",
               "compression", "timeout_s", "storage_options", "replicas", "lossy_generations")


def _legacy_save(kw: dict, options: SaveOptions | None) -> tuple[dict | None, dict]:
    """The keywords of ``save`` before :class:`SaveOptions` and :func:`save_async`: still taken
    for one release, with a ``DeprecationWarning`` naming the replacement. Returns the moved
    keywords (:func:`_legacy_options` builds the options from them inside the save's agreed
    checks) and the keywords for ``save_async`` (with ``async_save``)."""
    import warnings

    known = set(_SAVE_MOVED) | {"quant", "master", "zstd", "hf_config", "async_save", "background_staging", "also"}
    unknown = sorted(set(kw) - known)
    if unknown:
        raise TypeError(f"save() got unexpected keyword argument(s) {unknown}")
    moved = {k: kw[k] for k in _SAVE_MOVED if k in kw}
    short = {k: kw[k] for k in ("quant", "master", "zstd") if k in kw}
    out: dict = {}
    legacy = None
    if moved or short or "hf_config" in kw:
        if options is not None:
            raise InvalidArgumentError(f"pass {sorted([*moved, *short])} in options=SaveOptions(...), not beside it")
        names = [*moved, *short] + (["hf_config"] if "hf_config" in kw else [])
        warnings.warn(f"save({', '.join(f'{k}=' for k in names)}...) is deprecated: pass options=unickpt.SaveOptions("
                      f"{', '.join(f'{k}=...' for k in moved)}"
                      + (f"{', ' if moved else ''}compression=unickpt.Compression({', '.join(f'{k}=...' for k in short)})"
                         if short else "")
                      + ("; hf_config: options=SaveOptions(extra_files=unickpt.hf.hf_extra_files(config))"
                         if "hf_config" in kw else "") + ")", DeprecationWarning, stacklevel=3)
        legacy = {**moved, **short, "hf_config": kw.get("hf_config")}
    if kw.get("async_save") or "background_staging" in kw or "also" in kw:
        if kw.get("async_save"):
            warnings.warn("save(async_save=True) is deprecated: call unickpt.save_async(...), which returns the "
                          "AsyncSave handle (save() returns a SaveResult)", DeprecationWarning, stacklevel=3)
            out["async_save"] = True
        for k in ("background_staging", "also"):
            if k in kw:
                out[k] = kw[k]
    return legacy, out


def _legacy_options(kw: dict) -> SaveOptions:
    kw = dict(kw)
    config = kw.pop("hf_config", None)
    if config is not None:
        from . import hf

        kw["extra_files"] = {**hf.hf_extra_files(config), **dict(kw.get("extra_files") or {})}
    return SaveOptions.of(**kw)


_PER_RANK_OPTIONS = ("timeout_s", "direct_io", "storage_options", "extra", "strategy", "extra_files")


def _call_args(path, opts: SaveOptions | None, **more: Any) -> dict[str, Any]:
    """What every rank of a save must give alike, for the options' agreement: the path (see
    :func:`~unickpt.io.storage.compared_path`), the options that shape the checkpoint or the
    ranks' shared work, and ``more``. Not compared: each rank's own ``timeout_s``,
    ``direct_io`` and ``storage_options`` (credentials may differ per rank), nor ``extra``,
    ``strategy`` and ``extra_files``, which the checkpoint takes from rank 0 (node-local:
    rank 0's files in every node's directory), as documented. Long values travel as digests."""
    out: dict[str, Any] = {"path": compared_path(path), **more}
    for k, v in (opts.to_json() if opts is not None else {}).items():
        if k in _PER_RANK_OPTIONS:
            continue
        text = json.dumps(v, sort_keys=True, default=str)
        out[k] = v if len(text) <= 200 else f"xxh3 {Hasher.of(text.encode())}"
    return out


def _hf_files(state_dict, hf_config, extra_files: Mapping[str, str] | None) -> Mapping[str, str] | None:
    """``extra_files`` plus the Hugging Face files of ``hf_config`` or of a top-level
    ``transformers`` model (files the caller gives win)."""
    import sys

    if hf_config is None and "transformers" not in sys.modules:  # no transformers model can be here
        return extra_files
    from . import hf

    src = hf_config
    if src is None and not (extra_files and "config.json" in extra_files) and isinstance(state_dict, Mapping):
        src = next((v for v in state_dict.values() if hf.is_hf_model(v)), None)
    if src is None:
        return extra_files
    return {**hf.hf_extra_files(src), **dict(extra_files or {})}


def _check_shared(path, storage_options, async_save: bool, group) -> None:
    """A store that lives in this process (``memory://``) cannot take a save written by other
    processes: the async writer's, or other ranks'."""
    from .errors import InvalidArgumentError
    from .io.storage import storage_for

    if not storage_for(path, storage_options)[0].caps.process_local:
        return
    import torch.distributed as dist

    world = dist.get_world_size(group) if group != "local" and dist.is_available() and dist.is_initialized() else 1
    if async_save or world > 1:
        raise InvalidArgumentError(
            f"{os.fspath(path)}: {os.fspath(path).split('://')[0]}:// lives in one process; "
            + ("an asynchronous save is written by another process" if async_save else
               f"{world} ranks would each write their own copy") + " (use a file system or an object store)")


def start_async_writer(state_dict: Mapping[str, Any] | None = None, *, group=None) -> None:
    """Start this rank's asynchronous writer process now; collective over ``group`` (the
    group the asynchronous saves will name: writers belong to one group).

    ``save(..., async_save=True)`` otherwise starts the writer at its first call, and that
    first save is durable only once the writer is up: a fresh interpreter that imports torch,
    seconds on a busy host, against milliseconds for every later save. With ``state_dict``
    (what the saves will pass, or anything of the same size), the staging memory for it is
    also allocated and faulted in now, which that first save would otherwise do while the
    training loop waits (seconds per GB). A torch optimizer has no state before its first
    step: pass it after that step, or its moments make the first save allocate again.

    Call it at set-up: the trainer does when it saves asynchronously or has a memory tier.
    It returns once the writers have joined their own process group (they start while the
    staging is faulted in), so a writer that cannot reach its peers fails here, not at the
    first save. Writers already started are left as they are (a writer that exited is
    restarted by the next save, which says why), and so is the staging while a save is in
    flight.

    Raises:
        AsyncSaveError: on every rank, when some rank's writer could not be started or could
            not join the writers' group (within the ``UNICKPT_TIMEOUT_S`` timeout plus a
            minute for the interpreter's start), its staging could not be allocated
            (``/dev/shm`` too small), or a peer failed. A rank whose ``state_dict`` cannot be
            read raises that error instead (the others AsyncSaveError quoting it).
    """
    checkpointer(group).start(state_dict)
