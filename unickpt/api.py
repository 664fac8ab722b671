"""``unickpt.save``: checks the options once, then saves in this process or hands the state to
the rank's asynchronous writer.

It lives here, not in :mod:`unickpt.saver`, so the dependency is one way:
``api -> async_save -> saver`` and ``api -> saver``; the save pipeline knows nothing of the
asynchronous machinery that runs it in a writer process.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Sequence

from .async_save import checkpointer
from .catalog import check_destination
from .compress import Compression
from .errors import InvalidArgumentError
from .format import Hasher
from .saver import DEFAULT_BUCKET, ProgressFn, SaveOptions, save_entries
from .stateful import for_save
from .storage import compared_path, per_node
from .transport import Comm

__all__ = ["save", "start_async_writer"]


def save(
    state_dict: Mapping[str, Any],
    path: str | os.PathLike,
    *,
    group=None,
    step: int | None = None,
    extra: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    bucket_bytes: int = DEFAULT_BUCKET,
    max_file_bytes: int | None = None,
    direct_io: bool | None = None,
    strategy: Mapping[str, Any] | None = None,
    progress: ProgressFn | None = None,
    async_save: bool = False,
    background_staging: bool = False,
    extra_files: Mapping[str, str] | None = None,
    quant: str | None = None,
    master: str | None = None,
    zstd: int | None = None,
    compression: Compression | None = None,
    timeout_s: float | None = None,
    storage_options: Mapping[str, Any] | None = None,
    hf_config: Any = None,
    replicas: int = 0,
    also: Sequence[str | os.PathLike] = (),
    lossy_generations: int = 0,
):
    """Save ``state_dict`` as the checkpoint directory ``path``; collective over ``group``.

    Every rank passes its own state dict: plain tensors (full, identical on every rank: a
    save refuses plain tensors whose values differ between ranks), :class:`~unickpt.ShardedTensor`
    pieces, or ``DTensor``; nested dicts whose top-level keys name roles (``model``,
    ``master``, ``optimizer``...); JSON values (kept from rank 0); :func:`~unickpt.per_rank`
    values (one per rank: RNG states, data positions). Top-level values may also be stateful
    objects (``nn.Module``, optimizers, LR schedulers, anything with ``state_dict()`` and
    ``load_state_dict()``): their state dicts are saved, as ``torch.distributed.checkpoint``
    does (see :mod:`unickpt.stateful`). Tensors of one role that are the same memory (tied
    weights) are stored once.

    Args:
        path: checkpoint directory; built under a hidden temporary sibling and renamed into
            place at commit. Refuses to replace a committed checkpoint unless ``overwrite``.
            A path containing ``{node}`` names node-local storage: each node writes its files
            into the path with ``{node}`` replaced by its node id (``UNICKPT_NODE_ID``, the
            launcher's node rank, or the host name), and every node's directory gets the
            complete manifest. A URL (``scheme://...``) is kept as given (not made absolute).
        step: recorded in the manifest (``unickpt inspect`` shows it).
        extra: JSON-serialisable state stored in the manifest (scheduler, data position...).
        bucket_bytes: bound on the bytes a writer assembles at once (default 256 MiB).
        max_file_bytes: split a writer's files of one role beyond this size.
        direct_io: write with O_DIRECT (``None``: where the file system supports it).
        strategy: free-form description of the saving layout, stored for information.
        progress: called as ``progress(bytes_done, bytes_total)`` for this rank's writes, with
            increasing values ending at ``(total, total)``. Synchronous: called in this
            thread as the save goes. With ``async_save``: the writer process reports at most
            about 10 times a second (plus the final value), and the callback runs, once per
            report and in order, in the thread that polls the handle: ``done()``, ``error``,
            ``wait()``, and the next ``save()`` (which first waits for this one). A callback
            that raises is logged once and not called again; it never fails or stalls the
            save.
        async_save: return as soon as this rank's state is copied into a reused
            shared-memory staging buffer; a persistent writer process per rank does the rest
            (see :class:`~unickpt.AsyncSave`). The tensors may be modified once this returns.
        background_staging: with ``async_save``, return even before the copy; call
            ``handle.wait_staged()`` before modifying any tensor of the state dict.
        extra_files: small text files (e.g. ``{"config.json": ...}``) written into the
            checkpoint before the commit: rank 0's (on node-local storage, rank 0's into every
            node's directory; other ranks' are not used).
        quant: ``"O1"`` (8-bit) or ``"O2"`` (4-bit) Adam moments (``exp_avg``,
            ``exp_avg_sq``), see docs/compression.md; ``None``/``"O0"`` stores them as they are.
        master: ``"full"`` (default), ``"residual"`` (bit-exact fp32 masters from the bf16
            model weights + 2 bytes/param) or ``"drop"`` (rebuilt from the model weights).
        zstd: zstd level for optimizer and master files.
        compression: a :class:`~unickpt.Compression` instead of quant/master/zstd (also sets
            the optimizer's ``eps`` and the O2 block size).
        timeout_s: seconds a rank waits for the other ranks in any one exchange before the
            save fails with :class:`~unickpt.errors.DistributedError` ("rank(s) did not answer
            within N s") and nothing is committed (default: ``UNICKPT_TIMEOUT_S``, else 600).
            Raise it for very large shares on slow storage: ranks wait for the slowest writer.
        storage_options: options of the fsspec file system of a URL ``path`` (endpoint,
            credentials...), ignored for local paths. A dict of JSON values (they travel to
            the asynchronous writer process as JSON); never shown in reprs or logs.
        hf_config: a ``transformers`` config or model: its ``config.json`` (and
            ``generation_config.json``) are written into the checkpoint, so the folder loads
            with ``from_pretrained``. Automatic when a top-level value is a ``transformers``
            model (unless ``extra_files`` has a ``config.json``).
        replicas: node-local paths (``{node}``): each node's files are also written into
            the directories of this many other nodes before the commit, and the manifest
            lists who holds which copy, so losing any ``replicas`` nodes loses no file (the
            memory tier: docs/memory_tier.md).
        also: with ``async_save``: more checkpoint paths the writer processes write from
            the same staging memory after ``path`` (with ``replicas=0``), each a complete,
            separately committed checkpoint (a durable copy of a memory snapshot for the
            price of one staging copy). ``handle.results`` lists every result.
        lossy_generations: lossy save/resume cycles this state has been through
            (``LoadResult.lossy_generations`` of the load that restored it): recorded, plus
            one, with each quantized tensor, and checked against
            ``Compression.max_generations`` (the error budget, docs/compression.md).

    Every option is checked before anything is staged or written, and bad input raises the
    same typed error with or without ``async_save``: :class:`~unickpt.errors.StateDictError`
    (``step``, ``extra``, ``strategy``, ``extra_files``) or
    :class:`~unickpt.errors.InvalidArgumentError` (the others). The check is agreed over
    ``group``: when one rank's options are bad, that rank raises its error and the others a
    :class:`~unickpt.errors.DistributedError` naming it.

    Returns:
        :class:`~unickpt.SaveResult` with files, bytes, seconds and per-phase timings; with
        ``async_save``, an :class:`~unickpt.AsyncSave` handle (``wait()`` gives the result).

    Example::

        unickpt.save({"model": model.state_dict(), "step": 100}, "ckpt/step-00000100", step=100)
    """
    err: BaseException | None = None
    opts = None
    try:
        extra_files = _hf_files(state_dict, hf_config, extra_files)
        state_dict = for_save(state_dict)
        opts = SaveOptions.of(
            step=step, extra=extra, overwrite=overwrite, bucket_bytes=bucket_bytes, max_file_bytes=max_file_bytes,
            direct_io=direct_io, strategy=strategy, extra_files=extra_files, quant=quant, master=master, zstd=zstd,
            compression=compression, timeout_s=timeout_s, storage_options=storage_options, replicas=replicas,
            lossy_generations=lossy_generations,
        )
        also = tuple(also)
        for p in (path, *also):
            check_destination(p, opts.step)
        if replicas and not per_node(path):  # (the count of nodes is checked with the plan)
            raise InvalidArgumentError(f"{os.fspath(path)}: replicas need node-local storage ({{node}} in the path)")
        if also and not async_save:
            raise InvalidArgumentError("also= needs async_save=True (the writer processes write every path)")
        if also:
            from .async_save import writer_path

            where = [writer_path(p) for p in (path, *also)]
            twice = sorted({w for w in where if where.count(w) > 1})
            if twice:
                raise InvalidArgumentError(f"also= names {twice} twice (with the path itself): each copy needs a "
                                           "path of its own")
        _check_shared(path, storage_options, async_save, group)
        same = _call_args(path, opts, async_save=bool(async_save), also=[compared_path(p) for p in also])
    except Exception as e:  # agreed below: a rank alone with bad options must not strand the others
        err, same = e, None
    comm = Comm(group, timeout_s=opts.timeout_s if opts is not None else None)
    comm.agree(err, "save (checking the options)", same=same)
    if async_save:
        return checkpointer(group).save(state_dict, path, opts, background_staging=background_staging, progress=progress,
                                        also=also)
    return save_entries(comm, None, state_dict, path, opts, progress)


_PER_RANK_OPTIONS = ("timeout_s", "direct_io", "storage_options", "extra", "strategy", "extra_files")


def _call_args(path, opts: SaveOptions | None, **more: Any) -> dict[str, Any]:
    """What every rank of a save must give alike, for the options' agreement: the path (see
    :func:`~unickpt.storage.compared_path`), the options that shape the checkpoint or the
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
    from .storage import storage_for

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
