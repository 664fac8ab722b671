"""Load: manifest -> validate targets -> read exactly the needed byte ranges -> verify.

Every rank reads only the runs of each stored tensor that its target layout covers, with
positional reads straight into the target's memory (or through a bounded window when runs
are small, e.g. column blocks). Targets are validated against the manifest before a single
tensor byte is read, so a mismatch never half-fills a state dict.
"""

from __future__ import annotations

import json
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Literal, Mapping

import numpy as np
import torch

from . import catalog as _catalog
from . import codecs
from ._copy import Windows, as_bytes, copy_runs, copy_window
from ._metrics import Phases, gbps, human_bytes, log
from .errors import (
    CheckpointChangedError,
    CheckpointNotFoundError,
    ChecksumError,
    DtypeMismatchError,
    FormatError,
    InvalidArgumentError,
    ShapeMismatchError,
    StateDictError,
    TensorMissingError,
    UnexpectedTensorError,
    UnickptError,
)
from .format import Hasher, dtype_name, parse_header, read_header, torch_dtype
from .layout import Layout, Runs
from .manifest import MANIFEST_NAME, Manifest, TensorEntry
from .noderead import SharedJob, bounds, eligible, read_shared, touched
from .state import Entry, apply_json_state, flatten, from_json, json_missing
from .stateful import for_load, is_stateful
from .storage import RandomReader, Storage, compared_path, join_path, per_node, storage_for
from .transport import Comm, resolve_timeout

__all__ = ["load", "LoadResult", "read_manifest", "Verify"]

Verify = Literal["auto", "full", "none"]
WINDOW = 16 << 20  # scratch for small runs
READ_THREADS = 4  # concurrent preads per rank
READ_CHUNK = 16 << 20
READ_AHEAD = 512 << 20  # bytes of reads in flight before earlier targets are finished
DIRECT_RUN = 1 << 20  # runs at least this long are read straight into the target
SPAN_GAP = 1 << 20  # short runs this close are read in one span (the gap read and dropped)


@dataclass(frozen=True)
class LoadResult:
    path: str
    step: int | None
    extra: dict[str, Any]
    tensors: int
    bytes_read: int
    seconds: float
    verified: int
    missing: list[str] = field(default_factory=list)
    """Target values the checkpoint does not hold, left untouched (``missing="warn"``; the
    default raises instead): tensors as ``role/name``, JSON values as their dotted path."""
    phases: dict[str, float] = field(default_factory=dict)
    received: int = 0
    """Bytes other ranks read for this one and sent (node-local checkpoints)."""
    unexpected: list[str] = field(default_factory=list)
    """``role/name`` of checkpoint tensors under roles the target names that the target does
    not ask for (not loaded; ``unexpected="error"`` raises instead)."""
    skipped: list[str] = field(default_factory=list)
    """Values in both the target and the checkpoint that were not restored, with the reason
    (per-rank values saved on another world size)."""
    cast: list[str] = field(default_factory=list)
    """``role/name: STORED -> TARGET`` of each tensor converted on load (``cast=True``)."""
    lossy_generations: int = 0
    """Lossy save/resume cycles the restored values have been through (0: exact). Pass it to
    the next save of this state (``lossy_generations=``): the error budget
    (``Compression.max_generations``) counts them; docs/compression.md."""

    @property
    def gbps(self) -> float:
        return gbps(self.bytes_read, self.seconds)


def read_manifest(path: str | os.PathLike, *, group=None,
                  storage_options: Mapping[str, Any] | None = None) -> tuple[str, Manifest]:
    """Resolve ``path`` to a committed checkpoint and parse its manifest.

    Single process by default. With ``group`` (``"world"`` for the default group), collective:
    one rank reads and shares the manifest (node-local paths: the lowest rank whose node
    holds it), and the returned path keeps ``{node}`` so it can be passed to :func:`load`.
    ``storage_options``: options of the fsspec file system of a URL (docs/storage.md)."""
    if group is not None:
        comm = Comm(None if group == "world" else group)
        storage, p = storage_for(path, storage_options)
        _, rel, man = _find(comm, storage, p, per_node(path))
        return (join_path(path, rel) if rel else os.fspath(path)), man
    storage, p = storage_for(path, storage_options)
    ckpt, _, man = _catalog.open_checkpoint(storage, p)
    return ckpt, man


read_manifest_bytes = _catalog.read_manifest_bytes


def open_files(storage: Storage, ckpt: str, man: Manifest, names, readers: dict) -> None:
    """Open (and check: regular file, recorded size, intact header) each of ``names`` into
    ``readers`` before anything is allocated or created from the manifest's claims."""
    try:
        for f in sorted(names):
            if f not in readers:
                readers[f] = open_file(storage, ckpt, man, f)
    except BaseException:
        for r in readers.values():
            r.close()
        readers.clear()
        raise


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """The rarely used knobs of :func:`load` (one object, checked when built)."""

    verify: Verify = "auto"
    """``"auto"`` checks every checksummed range a rank reads entirely (every tensor it reads
    whole; in same-layout loads, every byte it reads); ``"full"`` also has the ranks share out
    and check every stored byte; ``"none"`` skips checks (an explicit opt-out)."""
    bucket_bytes: int = 256 << 20
    """Node-local checkpoints (``{node}`` in the path): pieces a rank's node does not hold are
    read by ranks that hold them and sent, at most this many bytes per reader and step."""
    timeout_s: float | None = None
    """Seconds a rank waits for the others in any one exchange before the load fails with
    :class:`~unickpt.errors.DistributedError` (None: ``UNICKPT_TIMEOUT_S``, else 600)."""
    storage_options: Mapping[str, Any] | None = field(default=None, repr=False)
    """For a URL path (``s3://``, ``memory://``, any fsspec URL): options of its file system
    (credentials, endpoint...; docs/storage.md). Never shown in reprs or logs."""
    avoid_local: tuple[str, ...] = ()
    """Node-local checkpoints: data files this rank's node must not read from its own
    directory (a copy found damaged): they are read by ranks of nodes that hold another copy
    and sent."""

    def __post_init__(self) -> None:
        if self.verify not in ("auto", "full", "none"):
            raise InvalidArgumentError(f"verify must be 'auto', 'full' or 'none', got {self.verify!r}")
        if type(self.bucket_bytes) is not int or self.bucket_bytes < 1:
            raise InvalidArgumentError(f"bucket_bytes must be a positive integer, got {self.bucket_bytes!r}")
        if self.timeout_s is not None:
            resolve_timeout(self.timeout_s)
        if self.storage_options is not None and not isinstance(self.storage_options, Mapping):
            raise InvalidArgumentError(f"storage_options must be a dict or None, got {self.storage_options!r}")
        if isinstance(self.avoid_local, str) or not all(isinstance(f, str) for f in self.avoid_local):
            raise InvalidArgumentError(f"avoid_local must be file names, got {self.avoid_local!r}")
        object.__setattr__(self, "avoid_local", tuple(self.avoid_local))


_LOAD_LEGACY = {f.name for f in fields(LoadOptions)}


def load(
    state_dict: Mapping[str, Any],
    path: str | os.PathLike,
    *,
    group: Any = None,
    options: LoadOptions | None = None,
    missing: Literal["error", "warn"] = "error",
    unexpected: Literal["ignore", "warn", "error"] = "ignore",
    cast: bool = False,
    progress: Callable[[int, int], None] | None = None,
    **deprecated: Any,
) -> LoadResult:
    """Fill ``state_dict`` in place from the checkpoint at ``path``; collective over ``group``.

    ``path`` is a checkpoint directory, or a root holding ``step-*`` checkpoints (the newest
    committed one is used; a damaged one fails the load, with a note on the error naming the
    older committed ones: the load never falls back by itself). With ``{node}`` in the path (node-local storage), each rank reads
    what its node's directory holds and receives the rest from ranks that hold it. Each target value may be a plain tensor (filled whole), a
    :class:`~unickpt.ShardedTensor` or a ``DTensor``; the layout may differ in every way from
    the one that saved (world size, ZeRO ranges, TP blocks, placements). JSON leaves of the
    target are replaced by the saved values. Top-level values may be stateful objects
    (``nn.Module``, optimizers, LR schedulers, anything with ``state_dict()`` and
    ``load_state_dict()``): their targets come from their ``state_dict()`` (an optimizer's
    state is created first when it has none) and they receive what was loaded through
    ``load_state_dict()`` (:mod:`unickpt.stateful`). :func:`~unickpt.per_rank` targets get
    their own rank's value when the world size is the saving one (else they are listed in
    ``LoadResult.skipped``); tied weights are filled from the one stored copy.

    Args:
        group: the process group (None: the default group, or this process alone;
            ``"local"``: this process alone under torch.distributed).
        options: rarely used knobs (:class:`LoadOptions`: verification, timeouts, storage
            options...).
        missing: targets the checkpoint does not hold: ``"error"`` (default, as
            ``torch.distributed.checkpoint``: :class:`~unickpt.errors.TensorMissingError`
            naming them, before any target is written) or ``"warn"`` (left untouched, logged,
            listed in ``LoadResult.missing``).
        unexpected: checkpoint tensors, under a role the target names, that the target does
            not ask for (loading part of a model): ``"ignore"`` (default, as DCP: listed in
            ``LoadResult.unexpected``), ``"warn"`` (also logged) or ``"error"``
            (:class:`~unickpt.errors.UnexpectedTensorError`).
        cast: convert floating dtypes on load (an fp32 checkpoint into a bf16 model), as the
            DCP reader does; each cast tensor is listed in ``LoadResult.cast``. Without it a
            dtype that differs is a :class:`~unickpt.errors.DtypeMismatchError`.
        progress: called as ``progress(bytes_done, bytes_total)``.

    Raises:
        CheckpointNotFoundError, TensorMissingError, UnexpectedTensorError, ShapeMismatchError,
        DtypeMismatchError (before any target is written), ChecksumError, FormatError.
    """
    options, missing, unexpected = _legacy_load(options, missing, unexpected, deprecated)
    if missing not in ("error", "warn"):
        raise InvalidArgumentError(f"missing must be 'error' or 'warn', got {missing!r}")
    if unexpected not in ("ignore", "warn", "error"):
        raise InvalidArgumentError(f"unexpected must be 'ignore', 'warn' or 'error', got {unexpected!r}")
    if type(cast) is not bool:
        raise InvalidArgumentError(f"cast must be True or False, got {cast!r}")
    if options is not None and not isinstance(options, LoadOptions):
        raise InvalidArgumentError(f"options must be a unickpt.LoadOptions or None, got {type(options).__name__}")
    if progress is not None and not callable(progress):
        raise InvalidArgumentError(f"progress must be a callable (bytes_done, bytes_total) or None, got {progress!r}")
    o = options or LoadOptions()
    try:
        return _load(state_dict, path, group=group, verify=o.verify, missing=missing, unexpected=unexpected, cast=cast,
                     progress=progress, bucket_bytes=o.bucket_bytes, timeout_s=o.timeout_s,
                     storage_options=o.storage_options, avoid_local=o.avoid_local)
    except (ChecksumError, FormatError, CheckpointNotFoundError) as e:  # (not found: a file the manifest lists)
        _note_older_steps(e, path, o.storage_options)
        raise


def _legacy_load(options: LoadOptions | None, missing: str, unexpected: str,
                 kw: dict) -> tuple[LoadOptions | None, str, str]:
    """The keywords of ``load`` before its options object: still taken, with a
    ``DeprecationWarning`` naming the replacement (removed in the next release)."""
    if not kw:
        return options, missing, unexpected
    import warnings

    unknown = sorted(set(kw) - _LOAD_LEGACY - {"strict"})
    if unknown:
        raise TypeError(f"load() got unexpected keyword argument(s) {unknown}")
    moved = {k: v for k, v in kw.items() if k in _LOAD_LEGACY}
    if moved:
        if options is not None:
            raise InvalidArgumentError(f"pass {sorted(moved)} in options=LoadOptions(...), not beside it")
        warnings.warn(f"load({', '.join(f'{k}=' for k in moved)}...) is deprecated: pass "
                      f"options=unickpt.LoadOptions({', '.join(f'{k}=...' for k in moved)})", DeprecationWarning,
                      stacklevel=3)
        options = LoadOptions(**moved)
    if "strict" in kw:
        strict = kw["strict"]
        if type(strict) is not bool:
            raise InvalidArgumentError(f"strict must be True or False, got {strict!r}")
        warnings.warn(f"load(strict={strict}) is deprecated: pass missing={'error' if strict else 'warn'!r}, "
                      f"unexpected={'error' if strict else 'ignore'!r}", DeprecationWarning, stacklevel=3)
        missing, unexpected = ("error", "error") if strict else ("warn", "ignore")
    return options, missing, unexpected


def _note_older_steps(e: BaseException, path, storage_options) -> None:
    """A damaged checkpoint that ``path`` resolved to as the newest under a root: a note
    naming the older committed ones (:func:`unickpt.catalog.note_older`)."""
    try:
        storage, p = storage_for(path, storage_options)
        ckpt = _catalog.resolve(storage, p)
    except Exception:  # (a note only: the load's own error is what matters)
        return
    if ckpt != p:
        _catalog.note_older(e, storage, os.fspath(path), ckpt)


@dataclass
class _Target:
    """The target of a load matched to its checkpoint (the validate stage's outcome)."""

    state_dict: Any  # stateful objects replaced by their state dicts
    saved_state: Any  # the manifest's JSON state (NaN and infinities as floats)
    finish: Callable[[], None]  # hands the loaded state to the stateful objects
    entries: list[Entry]  # tensors to read
    missing: list[str]
    skipped: list[str]
    covered: set[tuple[str, str]]  # (role, name) the targets ask for
    casts: list[tuple[torch.Tensor, torch.Tensor, str]]
    roles: set[str]
    objects: set[str]  # top-level keys holding stateful objects


def _match_target(state_dict, man: Manifest, ckpt: str, comm: Comm, cast: bool) -> _Target:
    objects = {k for k, v in state_dict.items() if is_stateful(v)} if isinstance(state_dict, Mapping) else set()
    saved_state = from_json(man.state)
    state_dict, finish = for_load(state_dict, {r for r, _ in man.tensors}, saved_state)
    entries, _ = flatten(state_dict, comm.rank, comm.world)
    entries, missing, skipped, covered, casts = _validate(entries, man, ckpt, comm.world, cast)
    missing += json_missing(state_dict, saved_state)  # JSON values the checkpoint does not hold
    return _Target(state_dict, saved_state, finish, entries, missing, skipped, covered, casts, _roles(state_dict), objects)


def _load(state_dict, path, *, group, verify, missing, unexpected, cast, progress, bucket_bytes, timeout_s,
          storage_options, avoid_local) -> LoadResult:
    on_missing, on_unexpected = missing, unexpected
    comm = Comm(group, timeout_s=timeout_s)
    ph = Phases()
    storage, p = storage_for(path, storage_options)
    if storage.caps.process_local and comm.world > 1:  # (every rank takes this branch)
        raise InvalidArgumentError(f"{os.fspath(path)}: memory:// lives in one process; {comm.world} ranks cannot "
                                   "share it (use a file system or an object store)")
    err: BaseException | None = None

    node_local = per_node(path)
    with ph.phase("manifest"):
        same = {"path": compared_path(path), "bucket_bytes": bucket_bytes}  # (verify and strict are per rank)
        ckpt, _, man = _find(comm, storage, p, node_local, same=same)

    with ph.phase("validate"):
        t = comm.step("load (checking the target state dict)", lambda: _match_target(state_dict, man, ckpt, comm, cast))
        state_dict, saved_state, finish, entries, missing, skipped, casts = (
            t.state_dict, t.saved_state, t.finish, t.entries, t.missing, t.skipped, t.casts)
        unexpected = _unexpected(comm, man, t.covered, t.roles)
        if (missing and on_missing == "error") or (unexpected and on_unexpected == "error"):
            err = _mismatch(ckpt, man, missing if on_missing == "error" else [],
                            unexpected if on_unexpected == "error" else [], t.objects)
        comm.agree(err, "load (matching the target to the checkpoint)")

    bytes_read = 0
    verified = 0
    received = 0
    bad: list[tuple[str, str]] = []
    sees = set(man.files)
    remote: list[Entry] = []
    if node_local:  # node-local files: this rank reads what its node holds, the rest is sent
        from .remote import files_needed

        avoid = set(avoid_local)
        sees = {f for f in man.files if f not in avoid and storage.exists(storage.join(ckpt, f))}
        local = []
        for e in entries:
            (remote if e.layout.numel and not files_needed(man, e.key) <= sees else local).append(e)
        entries = local
    with ph.phase("read"):
        try:
            bytes_read, verified, bad = _read_all(entries, man, storage, ckpt, verify, progress, comm.rank, comm.world,
                                                  comm=comm if comm.world > 1 else None)
        except Exception as e:  # agreed below: every rank raises, none waits alone
            err = _changed(storage, ckpt, man) or e
        if node_local:  # collective, also for a rank whose own reads failed
            with ph.phase("exchange"):
                from .remote import load_remote

                def read_for_peers(proxies, mode):
                    return _read_all(proxies, man, storage, ckpt, mode, None, comm.rank, comm.world)

                b2, v2, bad2, received, e2 = load_remote(comm, remote, man, sees, read_for_peers, bucket_bytes, verify)
                bytes_read, verified, bad = bytes_read + b2, verified + v2, bad + bad2
                err = err or e2
    if verify == "full":
        comm.agree(err, "load (reading)")
        with ph.phase("verify"):
            try:
                b2, v2, bad2 = _verify_share(man, storage, ckpt, comm, {e.key for e in entries if e.layout.is_full},
                                             sees if node_local else None)
                bytes_read += b2
                verified += v2
                bad += bad2
            except Exception as e:
                err = e
        comm.agree(err, "load (verifying)")
    bad = list(dict.fromkeys(bad))  # (a model weight read for itself and for its master: once)
    if bad and err is None:  # (one agreement for the reads and their checksums, unless verify="full")
        err = _changed(storage, ckpt, man) or ChecksumError(
            f"{ckpt}: checksum mismatch: " + "; ".join(f"tensor {n!r} in {f}" for f, n in bad)
            + ": the checkpoint is damaged; do not use it (an older step, or another copy)", bad)
    comm.agree(err, "load (reading)" if verify != "full" else "load (checksums)")
    for target, read, _ in casts:  # (cast=True: read in the stored dtype, converted into the target now)
        target.copy_(read)
    apply_json_state(state_dict, saved_state, comm.rank, comm.world, skipped,
                     top_level=any(not isinstance(v, Mapping) for v in state_dict.values()))
    comm.step("load (handing the loaded state to the stateful objects)", finish)  # (load_state_dict)
    if on_unexpected == "ignore" and unexpected and comm.rank == 0:
        # ignored, but never silently when a whole role of the checkpoint fed nothing (the
        # state dict of an optimizer whose state does not exist yet)
        stored: dict[str, int] = {}
        for r, _ in (*man.tensors, *man.aliases):
            stored[r] = stored.get(r, 0) + 1
        unused: dict[str, int] = {}
        for u in unexpected:
            unused[u.split("/", 1)[0]] = unused.get(u.split("/", 1)[0], 0) + 1
        for role in sorted(r for r, n in unused.items() if n == stored.get(r)):
            hint = (" (an optimizer whose state does not exist yet? pass the optimizer object itself: unickpt creates "
                    "its state)") if role not in t.objects else ""
            log.warning("load %s: none of the %d tensor(s) of role %r is in the target, nothing of it was loaded%s; "
                        "LoadResult.unexpected lists them", ckpt, stored[role], role, hint)
    for what, keys in (("not in the checkpoint", missing),
                       ("in the checkpoint but not in the target", unexpected if on_unexpected == "warn" else []),
                       ("not restored", skipped)):
        if keys and comm.rank == 0:
            log.warning("load %s: %d value(s) %s: %s%s", ckpt, len(keys), what, ", ".join(keys[:8]),
                        " ..." if len(keys) > 8 else "")
    res = LoadResult(
        path=ckpt,
        step=man.step,
        extra=dict(man.extra),
        tensors=len(entries),
        bytes_read=bytes_read,
        seconds=ph.elapsed(),
        verified=verified,
        missing=missing,
        phases=dict(ph.seconds),
        received=received,
        unexpected=unexpected,
        skipped=skipped,
        lossy_generations=man.lossy_generations,
        cast=[label for _, _, label in casts],
    )
    log.info(
        "rank %d loaded %d tensors from %s: read %s in %.2f s (%.2f GB/s), %d checksums verified%s",
        comm.rank, res.tensors, ckpt, human_bytes(bytes_read), res.seconds, res.gbps, verified,
        f", received {human_bytes(received)} from peers" if received else "",
    )
    return res


def _changed(storage: Storage, ckpt: str, man: Manifest) -> CheckpointChangedError | None:
    """After a failed read: the error to report if the checkpoint was replaced meanwhile."""
    try:
        now = Hasher.of128(storage.read_bytes(storage.join(ckpt, MANIFEST_NAME), 1 << 30))
    except CheckpointNotFoundError:  # the checkpoint went away (retention, an overwrite's swap)
        now = None
    except (UnickptError, OSError):  # unreadable now: the original error is the one to report
        return None
    if now == man.source_digest:
        return None
    return CheckpointChangedError(f"{ckpt}: the checkpoint was replaced or removed while it was being read; load it again")


def _find(comm: Comm, storage, p: str, node_local: bool, same: Mapping[str, Any] | None = None
          ) -> tuple[str, str, Manifest]:
    """Resolve the checkpoint and share its manifest: ``(checkpoint path, its name under
    p or "", manifest)``. Shared storage: rank 0 resolves. Node storage: every rank resolves
    in its node's directory; the lowest rank that found it sends the manifest, and every
    rank uses the same checkpoint name under its own root. ``same``: the load's arguments
    that every rank must give alike (compared in the first agreement)."""
    err: BaseException | None = None
    found, rel, mbytes = False, "", b""
    if comm.rank == 0 or node_local:
        try:
            ckpt = _catalog.resolve(storage, p)
            rel = "" if ckpt == p else storage.basename(ckpt)
            mbytes = read_manifest_bytes(storage, ckpt)
            found = True
        except (UnickptError, OSError) as e:
            err = e
    own = mbytes  # node-local: this node's copy, checked against the shared one below
    own_path = storage.join(ckpt, MANIFEST_NAME) if found else None
    if node_local:
        flags = [b == b"1" for b in comm.all_gather_bytes(b"1" if found else b"0", "load (finding the checkpoint on any node)")]
        src = flags.index(True) if any(flags) else 0
        comm.agree(err if comm.rank == src else None, "load (finding the checkpoint on any node)", same=same)
    else:
        src = 0
        comm.agree(err, "load (finding the checkpoint)", same=same)
    blob = comm.broadcast_bytes(rel.encode() + b"\0" + mbytes if comm.rank == src else None, src=src,
                             what="load (the manifest)")
    rel_b, _, mbytes = blob.partition(b"\0")
    rel = rel_b.decode()
    ckpt = storage.join(p, rel) if rel else p
    err = None
    man = None
    where = storage.join(ckpt, MANIFEST_NAME) + ("" if comm.rank == src else f" (the copy read by rank {src})")
    try:
        man = _catalog.parse_checked(ckpt, mbytes, where)
        if node_local and comm.rank != src:  # every node's copy of this checkpoint must be the same manifest
            try:
                here = own if found and storage.join(ckpt, MANIFEST_NAME) == own_path else read_manifest_bytes(storage, ckpt)
            except CheckpointNotFoundError:
                here = None  # this node does not hold the checkpoint: its files come from peers
            if here is not None and here != mbytes:
                raise FormatError(f"{storage.join(ckpt, MANIFEST_NAME)}: this node's manifest differs from the one "
                                  f"rank {src} read (damaged, or from another save)")
    except (UnickptError, OSError) as e:
        err = e
    comm.agree(err, "load (reading the manifest)")
    return ckpt, rel, man


def _roles(state_dict: Mapping[str, Any]) -> set[str]:
    """The roles a target state dict names: its top-level mappings, and ``other`` when it
    has top-level tensors (leaves, or in top-level lists and tuples)."""
    from .state import OTHER_ROLE, _contains_tensor

    out = {k for k, v in state_dict.items() if isinstance(v, Mapping)}
    if any(not isinstance(v, Mapping) and _contains_tensor(v) for v in state_dict.values()):
        out.add(OTHER_ROLE)
    return out


def _validate(entries: list[Entry], man: Manifest, ckpt: str, world: int = 1, cast: bool = False
              ) -> tuple[list[Entry], list[str], list[str], set[tuple[str, str]], list]:
    """Match targets to stored tensors (aliases of tied weights resolved to the stored
    name). Returns ``(entries to read, missing, skipped, keys the targets cover, casts)``;
    ``cast``: a floating target of another floating dtype is read into a buffer of the
    stored dtype, listed in ``casts`` as ``(target, buffer, label)`` (copied after the reads)."""
    keep, missing, skipped = [], [], []
    casts: list[tuple[torch.Tensor, torch.Tensor, str]] = []
    covered: set[tuple[str, str]] = set()
    for e in entries:
        _check_target(e)
        covered.update([e.key, *((e.role, a) for a in e.aliases)])
        key = e.key
        if key not in man.tensors and key in man.aliases:  # tied when saved: read the stored name
            key = (e.role, man.aliases[key])
        stored = man.tensors.get(key)
        if stored is None:
            missing.append(f"{e.role}/{e.name}")
            continue
        for a in e.aliases:  # tied in the target, stored apart: only the first name's values load
            ak = (e.role, a)
            if ak in man.tensors or man.aliases.get(ak, key[1]) != key[1]:
                skipped.append(f"{e.role}/{a}: the target ties it to {e.role}/{e.name}, the checkpoint stores it "
                               "on its own: its stored values were not loaded")
        if e.per_rank or key in man.per_rank:
            if not (e.per_rank and key in man.per_rank):
                raise ShapeMismatchError(
                    f"{ckpt}/{stored.file}: tensor {e.name!r} (role {e.role}) was saved "
                    + ("once per rank (unickpt.per_rank): wrap the target in unickpt.per_rank() as well" if key in man.per_rank
                       else "as one value for all ranks: the target wraps it in unickpt.per_rank(); unwrap it"))
            if stored.shape[0] != world and tuple(stored.shape[1:]) == tuple(e.layout.shape[1:]):
                skipped.append(f"{e.role}/{e.name}: per-rank value saved by {stored.shape[0]} ranks, not restored on {world}")
                continue
        if tuple(e.layout.shape) != stored.shape:
            raise ShapeMismatchError(
                f"{ckpt}/{stored.file}: tensor {e.name!r} (role {e.role}) is stored with shape {list(stored.shape)}, "
                f"the target has global shape {list(e.layout.shape)}"
            )
        tdt = dtype_name(e.local.dtype)
        local = e.local
        if tdt != stored.dtype:
            if not (cast and e.local.is_floating_point() and torch_dtype(stored.dtype).is_floating_point):
                raise DtypeMismatchError(
                    f"{ckpt}/{stored.file}: tensor {e.name!r} (role {e.role}) is stored as {stored.dtype}, the target is "
                    f"{tdt}" + (" (cast=True converts floating dtypes on load)" if not cast else ""))
            local = torch.empty(e.local.shape, dtype=torch_dtype(stored.dtype), device=e.local.device)
            casts.append((e.local, local, f"{e.role}/{e.name}: {stored.dtype} -> {tdt}"))
        if key != e.key:
            e = Entry(e.role, key[1], local, e.layout)
        elif local is not e.local:
            e = Entry(e.role, e.name, local, e.layout, e.aliases, e.per_rank)
        keep.append(e)
    _check_overlaps(keep)
    return keep, missing, skipped, covered, casts


def _check_target(e: Entry) -> None:
    """A target tensor must be memory a load can fill: not on the meta device (a copy into
    it does nothing), not an expanded view (one element standing for several)."""
    t = e.local
    if t.device.type == "meta":
        raise StateDictError(f"target {e.role}/{e.name} is on the meta device, which holds no values: materialize "
                             "it first (e.g. module.to_empty(device='cpu'))")
    if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
        raise StateDictError(f"target {e.role}/{e.name} is an expanded view (stride 0 in dimension "
                             f"{[i for i, (st, n) in enumerate(zip(t.stride(), t.shape)) if st == 0 and n > 1][0]}): "
                             "it cannot hold one value per element; pass a tensor of its own (.clone())")


def _check_overlaps(entries: list[Entry]) -> None:
    """Distinct targets that share memory would overwrite each other (and their checksums
    would fail on an intact checkpoint): refused. Contiguous targets are checked exactly;
    strided views of one buffer (column blocks) may interleave without sharing elements,
    so they are left out. The same view under two roles is allowed (tie() folds it within
    one role)."""
    spans: dict[tuple, list[tuple[int, int, Entry]]] = {}
    for e in entries:
        t = e.local
        if t.numel() == 0 or not t.is_contiguous():
            continue
        try:
            base = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            continue
        lo = base + t.storage_offset() * t.element_size()
        spans.setdefault((t.device, base), []).append((lo, lo + t.numel() * t.element_size(), e))
    for group in spans.values():
        group.sort(key=lambda x: x[0])
        for (a0, a1, ea), (b0, b1, eb) in zip(group, group[1:]):
            if (a0, a1) == (b0, b1) and ea.local.dtype == eb.local.dtype:
                continue  # one view under two roles (an fp32 model that is its own master): both load it
            if b0 < a1:
                raise StateDictError(f"targets {ea.role}/{ea.name} and {eb.role}/{eb.name} share memory "
                                     f"({min(a1, b1) - b0} bytes): each needs its own (tied weights are one tensor "
                                     "under two names, not overlapping views)")


def _unexpected(comm: Comm, man: Manifest, covered: set[tuple[str, str]], roles: set[str]) -> list[str]:
    """``role/name`` of stored tensors (and aliases) under a role some rank's target names
    that no rank's target covers. Ranks hold different parts of a model (ZeRO-3, pipeline
    stages): one all-reduce of a value per stored name, the same list on every rank."""
    keys = sorted((*man.tensors, *man.aliases))
    if not keys:
        return []
    val = torch.tensor([2 if k in covered else 1 if k[0] in roles else 0 for k in keys], dtype=torch.int64)
    _, top = comm.min_max(val, "load (matching the targets to the checkpoint)")
    return [f"{r}/{n}" for (r, n), v in zip(keys, top.tolist()) if v == 1]


def _mismatch(ckpt: str, man: Manifest, missing: list[str], unexpected: list[str],
              objects: set[str] = frozenset()) -> TensorMissingError:
    """The strict load's error, naming both directions of the mismatch. ``objects``: roles
    whose target was a stateful object (the hint about optimizer objects is not for them)."""
    def some(keys: list[str]) -> str:
        return ", ".join(keys[:6]) + (f" and {len(keys) - 6} more" if len(keys) > 6 else "")

    parts = []
    if len(missing) == 1 and "/" in missing[0]:
        role, name = missing[0].split("/", 1)
        parts.append(f"tensor {name!r} (role {role}) is not in the checkpoint "
                     f"({sum(1 for r, _ in man.tensors if r == role)} tensors of that role are)")
    elif missing:
        parts.append(f"{len(missing)} target value(s) are not in the checkpoint: {some(missing)}")
    if unexpected:
        hint = (" (an optimizer whose state does not exist yet? pass the optimizer object itself: unickpt creates "
                "its state)") if any(u.split("/", 1)[1].startswith("state.") and u.split("/", 1)[0] not in objects
                                     for u in unexpected) else ""
        parts.append(f"{len(unexpected)} tensor(s) of the checkpoint under the target's roles are not in the target: "
                     f"{some(unexpected)}{hint}")
    cls = TensorMissingError if missing else UnexpectedTensorError
    return cls(f"{ckpt}: " + "; ".join(parts) + " (missing='warn' / unexpected='ignore' load the rest and list them "
               "in the LoadResult)",
               missing, unexpected)


def read_side_file(storage: Storage, ckpt: str, man: Manifest, name: str, limit: int) -> bytes:
    """A side file the manifest lists (``config.json``, ``save(extra_files=...)``): a regular
    file inside the checkpoint of at most ``limit`` bytes, with the size and checksum the
    manifest records (:class:`CheckpointNotFoundError`, :class:`ChecksumError` otherwise)."""
    path = storage.join(ckpt, name)
    if not storage.exists(path):
        raise CheckpointNotFoundError(f"{path}: listed in the manifest but missing")
    data = storage.read_bytes(path, limit)
    if (len(data), Hasher.of(data)) != tuple(man.aux[name]):
        raise ChecksumError(f"{path}: does not match the size and checksum the manifest records", [(name, "")])
    return data


def open_file(storage: Storage, ckpt: str, man: Manifest, fname: str) -> RandomReader:
    """A reader of the logical (safetensors) bytes of a checkpoint file, header checked."""
    fe = man.files[fname]
    try:
        r = storage.open_reader(storage.join(ckpt, fname))
    except CheckpointNotFoundError as e:
        if len({f.node for f in man.files.values()}) < 2:
            raise
        where = ", ".join([fe.node, *fe.replicas])
        raise CheckpointNotFoundError(f"{e} (written on node {where}: if the checkpoint is node-local, that "
                                      "node's directory holds it)") from None
    try:
        if fe.container == "zstd":
            from .container import ZstdReader

            r = ZstdReader(r, [list(f) for f in fe.frames], fe.size, fe.stored_size)
        _check_file(r, man, fname)
    except BaseException:
        r.close()
        raise
    return r


class _Files:
    """Open readers, each header checked once against the manifest."""

    def __init__(self, storage: Storage, ckpt: str, man: Manifest) -> None:
        self.storage, self.ckpt, self.man = storage, ckpt, man
        self.readers: dict[str, RandomReader] = {}
        self.bytes_read = 0

    def get(self, fname: str) -> RandomReader:
        r = self.readers.get(fname)
        if r is None:
            r = self.readers[fname] = open_file(self.storage, self.ckpt, self.man, fname)
        return r

    def close(self) -> None:
        for r in self.readers.values():
            self.bytes_read += r.bytes_read
            r.close()
        self.readers.clear()


def _check_file(reader: RandomReader, man: Manifest, fname: str) -> None:
    fe = man.files[fname]
    if reader.size != fe.size:
        raise FormatError(f"{reader.path}: {reader.size} bytes on disk, the manifest records {fe.size} (truncated or replaced?)")
    hdr = None
    if fe.header_xxh3:  # format >= 2: every header byte (metadata, padding) is checksummed
        head = bytearray(min(fe.data_start, reader.size))
        reader.readinto(0, memoryview(head))
        if Hasher.of(head) != fe.header_xxh3:
            raise ChecksumError(f"{reader.path}: safetensors header does not match its checksum in the manifest",
                                [(fname, "")])
        try:  # the verified bytes hold the whole header: parse them, not a second read
            hdr = parse_header(reader.path, bytes(head), reader.size)
        except FormatError:  # longer than recorded, or unparsable: read_header below says which
            pass
    if hdr is None:
        hdr = read_header(reader)
    if hdr.data_start != fe.data_start:
        raise FormatError(f"{reader.path}: data starts at {hdr.data_start}, the manifest records {fe.data_start}")
    for (role, name), t in man.tensors.items():
        if t.file != fname:
            continue
        for _, key, dt, shape, b, e, _ in t.stored():
            h = hdr.tensors.get(key)
            if h is None or (h.begin, h.end) != (b, e) or h.dtype != dt or h.shape != shape:
                raise FormatError(f"{reader.path}: header entry {key!r} of tensor {name!r} disagrees with the manifest")


def _read_all(entries, man: Manifest, storage, ckpt, verify, progress, rank=0, world=1, comm: Comm | None = None):
    """Read every target's runs. Long runs are split into READ_CHUNK preads served by
    READ_THREADS threads (several requests in flight keep the disk busy, as a sequential
    stream with read-ahead would); short runs go through a window. Each target is finished
    (copied back if needed, verified) once its reads are done.

    With ``comm`` (collective: every rank of it calls this once), the ranks of a node whose
    needs overlap or interleave read them through the node, each rank one contiguous share
    (:mod:`unickpt.noderead`); long runs wait for that decision (one small all-gather)."""
    files = _Files(storage, ckpt, man)
    scratch: list[torch.Tensor] = []
    bad: list[tuple[str, str]] = []

    def _scratch() -> torch.Tensor:
        if not scratch:
            scratch.append(torch.empty(WINDOW, dtype=torch.uint8))
        return scratch[0]

    counts = {"verified": 0, "bytes": 0}
    # ranks start on different files, so concurrent readers stream different files
    names = sorted(man.files)
    first = {n: (i - rank * len(names) // max(world, 1)) % max(len(names), 1) for i, n in enumerate(names)}
    todo = sorted(entries, key=lambda e: (first[man.tensors[e.key].file], man.tensors[e.key].begin))
    total = sum(e.layout.numel * e.local.element_size() for e in todo)
    pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="unickpt-read")
    # targets read straight into their memory are verified on this thread while later reads
    # proceed (xxhash releases the GIL); its scratch is its own
    verifier = ThreadPoolExecutor(1, thread_name_prefix="unickpt-verify")
    vscratch: list[torch.Tensor] = []
    verifying: list = []
    pending: deque = deque()
    in_flight = [0]
    spans = _SpanStream(pool, READ_THREADS)

    def verify_direct(reader, base, st, runs, isz, dest):
        if not vscratch:
            vscratch.append(torch.empty(WINDOW, dtype=torch.uint8))
        return _verify_direct(reader, base, st, runs, isz, dest, vscratch[0])

    def tally(st, checked) -> None:
        counts["verified"] += checked[1]
        if not checked[0]:
            bad.append((st.file, st.name))

    def finish(item) -> None:
        st, runs, isz, dest, local, direct, futs, checked = item
        for f in futs:
            f.result()
        in_flight[0] -= runs.numel * isz if futs else 0
        if checked is None and verify != "none":  # read straight into dest: verify around it
            args = (files.get(st.file), man.files[st.file].data_start + st.begin, st, runs, isz, dest)
            if direct:
                verifying.append((st, verifier.submit(verify_direct, *args)))
            else:  # dest is a temporary: verify before it is copied and dropped
                checked = _verify_direct(*args, _scratch())
        if checked is not None:
            tally(st, checked)
        if not direct:
            local.copy_(dest.view(local.dtype).reshape(local.shape))
        counts["bytes"] += runs.numel * isz
        if progress is not None:
            progress(counts["bytes"], total)

    def issue_reads() -> None:
        """Issue the reads of every target: long runs now, short runs into ``spans`` (or
        ``shared``: read node-shared, when the tensor can be)."""
        for e in todo:
            st = man.tensors[e.key]
            if st.coder.coded:
                failed, n_checked = _read_coded(e, st, man, files, verify)
                counts["verified"] += n_checked
                bad.extend(failed)
                counts["bytes"] += e.layout.numel * e.local.element_size()
                if progress is not None:
                    progress(counts["bytes"], total)
                continue
            if e.layout.numel == 0:  # nothing to read (its file may not even be on this node)
                continue
            reader = files.get(st.file)
            base = man.files[st.file].data_start + st.begin
            isz = e.local.element_size()
            local = e.local.detach()
            direct = local.device.type == "cpu" and local.is_contiguous()
            dest = as_bytes(local) if direct else torch.empty(local.numel() * isz, dtype=torch.uint8)
            runs = e.layout.runs()
            if not len(runs) or not runs.numel:  # nothing to read: finished (verified) as it is
                read_direct(st, reader, base, runs, isz, dest, local, direct)
                continue
            long = len(runs) == 1 or runs.numel * isz / len(runs) >= DIRECT_RUN
            # node-shared when it can be (read_shared decides whether the node shares): short
            # runs, and long runs read straight into the target's own memory
            be = bounds(st) if comm is not None and (not long or direct) else None
            if be is not None and eligible(st, isz, long, be):
                mask = touched(be, runs.starts * isz, (runs.starts + runs.lengths) * isz)
                shared.append(SharedJob(st, reader, base, runs, isz, dest, mask,
                                        done_of(st, runs, isz, dest, local, direct), long, local, direct))
            elif long:
                read_direct(st, reader, base, runs, isz, dest, local, direct)
            else:  # read in one stream with every other short-run target, after this loop
                spans.add(reader, base, st, runs, isz, dest, verify != "none", done_of(st, runs, isz, dest, local, direct))

    def done_of(st, runs, isz, dest, local, direct):
        return lambda checked: finish((st, runs, isz, dest, local, direct, [], checked))

    def read_direct(st, reader, base, runs, isz, dest, local, direct) -> None:
        """Long runs: READ_CHUNK preads straight into ``dest`` on the pool, the target
        finished (verified around them) once they are done."""
        futs = []
        for g, ln, lo in zip(runs.starts.tolist(), runs.lengths.tolist(), runs.local.tolist()):
            for a in range(0, ln * isz, READ_CHUNK):
                k = min(READ_CHUNK, ln * isz - a)
                mv = memoryview(dest[lo * isz + a : lo * isz + a + k].numpy())
                futs.append(pool.submit(reader.readinto, base + g * isz + a, mv))
        in_flight[0] += runs.numel * isz
        pending.append((st, runs, isz, dest, local, direct, futs, None if verify != "none" else (True, 0)))
        while pending and (in_flight[0] > READ_AHEAD or not pending[0][6] or len(pending) > 256):
            finish(pending.popleft())

    shared: list[SharedJob] = []  # targets read node-shared, if the node shares (with comm)
    try:
        early: BaseException | None = None
        try:
            issue_reads()
        except Exception as e:
            if comm is None:
                raise
            early = e  # the others are told at the first exchange below, then this rank raises
        if comm is not None:
            n, alone, aborted = read_shared(comm, shared, man, files, pool, verify != "none", early is not None)
            if early is not None:
                raise early
            if aborted:
                return files.bytes_read, counts["verified"], bad
            counts["verified"] += n
            for j in alone:
                if j.long:
                    read_direct(j.st, j.reader, j.base, j.runs, j.isz, j.dest, j.local, j.direct)
                else:
                    spans.add(j.reader, j.base, j.st, j.runs, j.isz, j.dest, verify != "none", j.done)
        while pending:
            finish(pending.popleft())
        spans.run()
        for st, fut in verifying:
            tally(st, fut.result())
    finally:
        pool.shutdown(wait=True)
        verifier.shutdown(wait=True)
        files.close()
    return files.bytes_read, counts["verified"], bad


CODED_WINDOW = 1 << 22  # elements of a coded tensor decoded at once


class _StreamCheck:
    """Verifies the checksummed ranges of one stored region from reads arriving in ascending
    order (reads may overlap or leave gaps). Readers first :meth:`touch` the bytes they will
    return, which widens them to whole checksummed ranges; :attr:`ok` is true only when every
    touched range was fed whole and matched."""

    def __init__(self, checksums) -> None:
        self.ranges = list(checksums)
        self.begins = np.array([c[0] for c in self.ranges], dtype=np.int64)
        self.ends = np.array([c[1] for c in self.ranges], dtype=np.int64)
        self.touched = np.zeros(len(self.ranges), dtype=bool)
        self.done = np.zeros(len(self.ranges), dtype=bool)
        self.i = 0
        self.pos = -1  # bytes before pos have been fed to the current range
        self.h: Hasher | None = None
        self.checked = 0
        self.matched = True

    def touch(self, b: int, e: int) -> tuple[int, int]:
        """Mark the ranges that bytes ``[b, e)`` fall in; return the span they cover."""
        bs, es = self.touch_runs(np.array([b], dtype=np.int64), np.array([e], dtype=np.int64))
        return int(bs[0]), int(es[0])

    def touch_runs(self, b: np.ndarray, e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`touch` for sorted, disjoint byte runs ``[b[i], e[i])`` at once (vectorized)."""
        if not len(self.ranges) or not len(b):
            return b, e
        i0 = np.maximum(np.searchsorted(self.begins, b, side="right") - 1, 0)
        i1 = np.maximum(np.searchsorted(self.begins, np.maximum(e - 1, b), side="right") - 1, i0)
        live = e > b
        marks = np.zeros(len(self.ranges) + 1, dtype=np.int64)
        np.add.at(marks, i0[live], 1)
        np.add.at(marks, i1[live] + 1, -1)
        self.touched |= np.cumsum(marks[:-1]) > 0
        return np.where(live, np.minimum(b, self.begins[i0]), b), np.where(live, np.maximum(e, self.ends[i1]), e)

    @property
    def ok(self) -> bool:
        return self.matched and not bool((self.touched & ~self.done).any())

    def feed(self, b: int, data: torch.Tensor) -> None:
        e = b + data.numel()
        if b > self.pos:  # gap (or start): only ranges beginning at or after b can complete
            self.h = None
            self.pos = b
            self.i = max(int(np.searchsorted(self.ends, b, side="right")), 0) if len(self.ranges) else 0
        while self.i < len(self.ranges) and self.pos < e:
            rb, re_, hx = self.ranges[self.i]
            if self.pos >= re_:
                self.i += 1
                self.h = None
                continue
            if self.pos < rb:
                self.pos = min(rb, e)
                continue
            if self.pos == rb and self.h is None:
                self.h = Hasher()
            stop = min(e, re_)
            if self.h is not None:
                self.h.update(memoryview(data[self.pos - b : stop - b].numpy()))
            self.pos = stop
            if stop == re_:
                if self.h is not None:
                    self.checked += 1
                    self.done[self.i] = True
                    self.matched &= self.h.hexdigest() == hx
                self.h = None
                self.i += 1


def _feed_file(reader, base: int, b: int, e: int, check: _StreamCheck, scratch: torch.Tensor) -> None:
    """Feed bytes ``[b, e)`` of a region (at ``base`` in the file) to ``check`` through ``scratch``."""
    cap = scratch.numel()
    while b < e:
        k = min(cap, e - b)
        buf = scratch[:k]
        reader.readinto(base + b, memoryview(buf.numpy()))
        check.feed(b, buf)
        b += k


def _verify_direct(reader, base: int, st: TensorEntry, runs: Runs, isz: int, dest: torch.Tensor,
                   scratch: torch.Tensor) -> tuple[bool, int]:
    """Verify the runs read straight into ``dest``: each checksummed range a run touches is
    hashed from the run's bytes in ``dest`` plus the bytes around it (read now, at most one
    range at each end of a run)."""
    check = _StreamCheck(st.checksums)
    starts = (runs.starts * isz).tolist()
    ends = ((runs.starts + runs.lengths) * isz).tolist()
    local = (runs.local * isz).tolist()
    prev = 0
    for i, (rs, re_, lo) in enumerate(zip(starts, ends, local)):
        hb, te = check.touch(rs, re_)
        hb = max(hb, prev)
        if hb < rs:
            _feed_file(reader, base, hb, rs, check, scratch)
        check.feed(rs, dest[lo : lo + re_ - rs])
        te = min(te, starts[i + 1]) if i + 1 < len(starts) else te
        if re_ < te:
            _feed_file(reader, base, re_, te, check, scratch)
        prev = max(te, re_)
    return check.ok, check.checked


SPAN_PIECE = 8 << 20  # bytes of one span read (column blocks, small pieces)


def _span_pieces(st: TensorEntry, runs: Runs, isz: int, verify: bool) -> tuple["_StreamCheck", list[tuple[int, int]]]:
    """Short runs (column blocks, small pieces): the byte pieces to read, the whole
    checksummed ranges the runs touch (merged when they overlap or lie within SPAN_GAP: one
    read, not many), cut at SPAN_PIECE; and the check that verifies them as they stream."""
    check = _StreamCheck(st.checksums if verify else ())
    s_el, l_el = runs.starts, runs.lengths
    e_el = s_el + l_el
    bs, es = check.touch_runs(s_el * isz, e_el * isz)  # widened to whole checksummed ranges
    cut = np.flatnonzero(bs[1:] > np.maximum.accumulate(es)[:-1] + SPAN_GAP) + 1
    firsts, lasts = np.concatenate(([0], cut)), np.concatenate((cut, [len(bs)])) - 1
    span_b, span_e = bs[firsts], np.maximum.accumulate(es)[lasts]
    cap = (SPAN_PIECE // isz) * isz
    pieces = []
    for b, e in zip(span_b.tolist(), span_e.tolist()):
        pos, e = (b // isz) * isz, -(-e // isz) * isz
        while pos < e:
            pieces.append((pos, min(cap, e - pos)))
            pos += pieces[-1][1]
    return check, pieces


class _SpanStream:
    """The span reads of every short-run target, as one stream: up to ``depth`` pieces are
    read by the pool ahead of the one being verified and scattered (in order, on the calling
    thread), across target boundaries, so the disk never waits for the hashing, the
    scattering or the start of the next tensor. Memory: ``depth + 1`` buffers of
    SPAN_PIECE bytes, reused."""

    def __init__(self, pool, depth: int) -> None:
        self.pool, self.depth = pool, max(1, depth)
        self.bufs: list[torch.Tensor] = []  # allocated by the first run that reads
        self.jobs: list = []  # (reader, base, Windows of the runs, isz, dest, check, pieces, done)

    def add(self, reader, base: int, st: TensorEntry, runs: Runs, isz: int, dest: torch.Tensor, verify: bool,
            done: Callable[[tuple[bool, int]], None]) -> None:
        check, pieces = _span_pieces(st, runs, isz, verify)
        self.jobs.append((reader, base, Windows(runs.starts, runs.lengths, runs.local), isz, dest, check, pieces, done))

    def run(self) -> None:
        order = [(j, n) for j, job in enumerate(self.jobs) for n in range(len(job[6]))]
        if order and not self.bufs:
            self.bufs = [torch.empty(SPAN_PIECE, dtype=torch.uint8) for _ in range(self.depth + 1)]
        flight: deque = deque()

        def submit(k: int) -> None:
            j, n = order[k]
            reader, base, pieces = self.jobs[j][0], self.jobs[j][1], self.jobs[j][6]
            pos, size = pieces[n]
            buf = self.bufs[k % len(self.bufs)][:size]
            flight.append(self.pool.submit(reader.readinto, base + pos, memoryview(buf.numpy())))

        for k in range(min(self.depth, len(order))):
            submit(k)
        for k, (j, n) in enumerate(order):
            flight.popleft().result()
            if k + self.depth < len(order):
                submit(k + self.depth)
            _, _, windows, isz, dest, check, pieces, done = self.jobs[j]
            pos, size = pieces[n]
            buf = self.bufs[k % len(self.bufs)][:size]
            check.feed(pos, buf)
            copy_window(buf, pos // isz, (pos + size) // isz, windows, dest, isz)
            if n == len(pieces) - 1:
                done((check.ok, check.checked))
        for job in self.jobs:  # targets without any piece (nothing to read)
            if not job[6]:
                job[7]((job[5].ok, job[5].checked))
        self.jobs.clear()


def _split_runs(runs: Runs, cap: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs cut into pieces of at most ``cap`` elements: (starts, lengths, local offsets)."""
    starts, lengths, local = runs.starts, runs.lengths, runs.local
    if len(lengths) == 0 or int(lengths.max()) <= cap:
        return starts, lengths, local
    reps = -(-lengths // cap)
    idx = np.repeat(np.arange(len(lengths)), reps)
    first = np.cumsum(reps) - reps
    k = np.arange(int(reps.sum())) - np.repeat(first, reps)
    s = starts[idx] + k * cap
    ln = np.minimum(cap, lengths[idx] - k * cap)
    lo = local[idx] + k * cap
    return s, ln, lo


def _read_coded(e: Entry, st: TensorEntry, man: Manifest, files: "_Files", verify
                ) -> tuple[list[tuple[str, str]], int]:
    """Decode this rank's runs of a coded tensor, window by window: the codes and scales (or
    low halves and model weights) of each window are read, checked as they stream, decoded.
    Returns the ``(file, tensor)`` whose bytes failed their checks (the model weight's own,
    for a master decoded from it) and the bytes checked."""
    local = e.local.detach()
    isz = local.element_size()
    direct = local.device.type == "cpu" and local.is_contiguous()
    out = local if direct else torch.empty(local.shape, dtype=local.dtype)
    dest = as_bytes(out)
    tag, coder = st.tag, st.coder
    model_name = coder.model_of(st.args)
    model = man.tensors[("model", model_name)] if model_name is not None else None
    exc = st.exceptions if coder.exceptions else None
    regions = [(p, man.files[st.file].data_start + part.begin, _StreamCheck(part.checksums)) for p, part in st.parts.items()]
    if model is not None:
        regions.append(("model", man.files[model.file].data_start + model.begin, _StreamCheck(model.checksums)))
    starts, lengths, locs = _split_runs(e.layout.runs(), CODED_WINDOW)
    ends = starts + lengths
    scratch: dict[str, list[torch.Tensor]] = {}  # per region, two buffers reused across windows
    held: dict[str, tuple[int, int, torch.Tensor]] = {}  # per region: the last window's bytes
    windows = 0
    i, n = 0, len(starts)
    while i < n:
        lo = int(starts[i])
        j = max(i + 1, int(np.searchsorted(ends, lo + CODED_WINDOW, side="right")))
        hi = int(ends[j - 1])
        ranges = coder.byte_ranges(tag, lo, hi)
        if model is not None:
            misz = torch_dtype(model.dtype).itemsize
            ranges["model"] = (lo * misz, hi * misz)
        got = {}
        for p, base, check in regions:
            b, end = ranges[p]
            eb, ee = check.touch(b, end) if verify != "none" else (b, end)  # whole checksummed ranges
            bufs = scratch.setdefault(p, [torch.empty(0, dtype=torch.uint8)] * 2)
            slot = windows % 2  # ping-pong: the previous window's bytes stay intact
            if bufs[slot].numel() < ee - eb:
                bufs[slot] = torch.empty(ee - eb, dtype=torch.uint8)
            buf = bufs[slot][: ee - eb]
            fresh = eb
            prev = held.get(p)
            if prev is not None and prev[0] <= eb < prev[1]:  # bytes already read (and hashed): reuse them,
                k = min(prev[1], ee) - eb  # so what is decoded is what was verified
                buf[:k].copy_(prev[2][eb - prev[0] : eb - prev[0] + k])
                fresh = eb + k
            if ee > fresh:
                files.get(model.file if p == "model" else st.file).readinto(base + fresh, memoryview(buf[fresh - eb :].numpy()))
            if verify != "none":
                check.feed(eb, buf)
            held[p] = (eb, ee, buf)
            got[p] = buf[b - eb : end - eb]
        windows += 1
        mt = got.pop("model").view(torch_dtype(model.dtype)) if model is not None else None
        try:
            vals = codecs.decode_range(tag, got, lo, hi, mt, exc).to(local.dtype)
        except FormatError as e:
            raise FormatError(f"{st.file}: tensor {st.role}/{st.name}: {e}") from None
        copy_runs(as_bytes(vals), starts[i:j] - lo, dest, locs[i:j], lengths[i:j], isz)
        i = j
    if not direct:
        local.copy_(out)
    failed = sorted({(model.file, model.name) if p == "model" else (st.file, st.name) for p, _, c in regions if not c.ok})
    return failed, sum(c.checked for _, _, c in regions)


def read_whole(storage, ckpt: str, man: Manifest, role: str, name: str, readers: dict) -> torch.Tensor:
    """One stored tensor, whole (coded tensors decoded), with every checksum range verified
    (offline tools). ``readers`` caches open files (headers checked once); the caller closes them."""
    st = man.tensors[(role, name)]
    model_name = st.coder.model_of(st.args)
    files = [st.file] + ([man.tensors[("model", model_name)].file] if model_name is not None else [])
    for f in files:
        if f not in readers:
            readers[f] = open_file(storage, ckpt, man, f)
    if st.coder.coded:
        x = torch.empty(st.shape, dtype=torch_dtype(st.dtype))
        shim = _Files(storage, ckpt, man)
        shim.readers = readers
        failed, _ = _read_coded(Entry(role, name, x, Layout.full(st.shape)), st, man, shim, "full")
        if failed:
            f, n = failed[0]
            what = (f"tensor {n!r} (role {role})" if f == st.file else
                    f"tensor {n!r} (role model, read to decode {name!r} of role {role})")
            raise ChecksumError(f"{ckpt}/{f}: {what}: stored bytes do not match their checksums", failed)
        return x
    r = readers[st.file]
    x = torch.empty(st.shape, dtype=torch_dtype(st.dtype))
    if st.nbytes:
        buf = x.reshape(-1).view(torch.uint8)
        r.readinto(man.files[st.file].data_start + st.begin, memoryview(buf.numpy()))
        for b, e, h in st.checksums:
            if Hasher.of(memoryview(buf[b:e].numpy())) != h:
                raise ChecksumError(
                    f"{ckpt}/{st.file}: tensor {name!r} (role {role}) bytes [{b}, {e}) do not match their checksum",
                    [(st.file, name)],
                )
    return x


def check_stored(reader: RandomReader, data_start: int, st: TensorEntry, buf: torch.Tensor) -> list[tuple[str, int, int]]:
    """Read every checksummed range of ``st`` (each part of a coded tensor) through ``buf``;
    return ``(part, begin, end)`` of the ranges that differ."""
    bad = []
    cap = buf.numel()
    for part, _, _, _, begin, _, checksums in st.stored():
        for b, e, h in checksums:
            hasher = Hasher()
            pos = b
            while pos < e:
                k = min(cap, e - pos)
                mv = memoryview(buf[:k].numpy())
                reader.readinto(data_start + begin + pos, mv)
                hasher.update(mv)
                pos += k
            if hasher.hexdigest() != h:
                bad.append((part, b, e))
    return bad


def _verify_share(man: Manifest, storage, ckpt, comm: Comm, already: set, sees: set | None = None) -> tuple[int, int, list]:
    """verify="full": tensors are dealt to ranks (that see their file) by size; each checks its
    share whole."""
    loads = [0] * comm.world
    mine: list[TensorEntry] = []
    if sees is None:  # shared storage: every rank sees every file
        sees_all = [set(man.files)] * comm.world
    else:  # node-local: every rank takes part, whatever it sees
        sees_all = [set(json.loads(b)) for b in comm.all_gather_bytes(json.dumps(sorted(sees)).encode(), "load (the files each node sees)")]
    for t in sorted(man.tensors.values(), key=lambda t: (-t.nbytes, t.role, t.name)):
        if not t.coder.stores:
            continue
        cands = [k for k in range(comm.world) if t.file in sees_all[k]] or list(range(comm.world))
        r = min(cands, key=lambda k: (loads[k], k))
        loads[r] += t.nbytes
        if r == comm.rank and t.key not in already:
            mine.append(t)
    files = _Files(storage, ckpt, man)
    buf = torch.empty(WINDOW, dtype=torch.uint8)
    bad, n = [], 0
    try:
        for t in sorted(mine, key=lambda t: (t.file, t.begin)):
            reader = files.get(t.file)
            if check_stored(reader, man.files[t.file].data_start, t, buf):
                bad.append((t.file, t.name))
            n += t.nbytes
    finally:
        files.close()
    return files.bytes_read, len(mine), bad
