"""The load: ``find -> match -> read -> verify -> apply``, each stage agreed by every rank
(:func:`load`)."""

from __future__ import annotations

import os
from typing import Any, Callable, Literal, Mapping

from .._metrics import Phases, human_bytes, log
from ..errors import CheckpointNotFoundError, ChecksumError, FormatError, InvalidArgumentError
from ..io.storage import compared_path, per_node, storage_for
from ..manifest import Manifest
from ..state import Entry, apply_json_state
from ..transport import Comm
from .locate import changed, find, note_older_steps
from .options import LoadOptions, LoadResult, _LOAD_LEGACY
from .session import read_all
from .target import Target, agree_on_target, match_target
from .verify import verify_share


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
                     storage_options=o.storage_options, avoid_local=o.avoid_local, mapping=o.mapping)
    except (ChecksumError, FormatError, CheckpointNotFoundError) as e:  # (not found: a file the manifest lists)
        note_older_steps(e, path, o.storage_options)
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


def _load(state_dict, path, *, group, verify, missing, unexpected, cast, progress, bucket_bytes, timeout_s,
          storage_options, avoid_local, mapping=None) -> LoadResult:
    """The load's stages: find the checkpoint and share its manifest, match the target to it
    (nothing is written before every rank agrees), read (and receive, node-local), verify,
    then hand the values over. Each ends in one agreement, so a failure anywhere raises
    everywhere."""
    comm = Comm(group, timeout_s=timeout_s)
    ph = Phases()
    storage, p = storage_for(path, storage_options)
    if storage.caps.process_local and comm.world > 1:  # (every rank takes this branch)
        raise InvalidArgumentError(f"{os.fspath(path)}: memory:// lives in one process; {comm.world} ranks cannot "
                                   "share it (use a file system or an object store)")
    node_local = per_node(path)
    with ph.phase("manifest"):
        same = {"path": compared_path(path), "bucket_bytes": bucket_bytes}  # (verify and strict are per rank)
        # agreed here, not deferred: matching the target runs the stateful objects' own code
        # (state_dict(), which may make collectives; an optimizer's state is created), which
        # no rank may start while another has no manifest
        ckpt, _, man = find(comm, storage, p, node_local, same=same)
    with ph.phase("validate"):  # (a failed match agreed on in agree_on_target's first collective)
        t = comm.deferred("load (checking the target state dict)", lambda: match_target(state_dict, man, ckpt, comm, cast,
                                                                                              mapping))
        agree_on_target(comm, ckpt, man, t, missing, unexpected)
    assert t is not None
    reads = _Reads(storage, ckpt, man, comm, verify, ph)
    reads.run(t.entries, node_local, progress, bucket_bytes, avoid_local)
    reads.agree()
    for target, read, _ in t.casts:  # (cast=True: read in the stored dtype, converted into the target now)
        target.copy_(read)
    apply_json_state(t.state_dict, t.saved_state, comm.rank, comm.world, t.skipped,
                     top_level=any(not isinstance(v, Mapping) for v in t.state_dict.values()))
    comm.step("load (handing the loaded state to the stateful objects)", t.finish)  # (load_state_dict)
    if comm.rank == 0:
        _report_unused(ckpt, man, t, unexpected)
    res = LoadResult(path=ckpt, step=man.step, extra=dict(man.extra), tensors=len(reads.entries),
                     bytes_read=reads.bytes_read, seconds=ph.elapsed(), verified=reads.verified, missing=t.missing,
                     phases=dict(ph.seconds), received=reads.received, unexpected=t.unexpected, skipped=t.skipped,
                     lossy_generations=man.lossy_generations, cast=[label for _, _, label in t.casts])
    log.info("rank %d loaded %d tensors from %s: read %s in %.2f s (%.2f GB/s), %d checksums verified%s",
             comm.rank, res.tensors, ckpt, human_bytes(res.bytes_read), res.seconds, res.gbps, res.verified,
             f", received {human_bytes(res.received)} from peers" if res.received else "")
    return res


class _Reads:
    """The read and verify stages of one load on this rank: what it read, verified and
    received, and the first error (agreed on by :meth:`agree`, after the collectives every
    rank must run whatever happened here: node-local exchanges, full verification)."""

    def __init__(self, storage, ckpt: str, man: Manifest, comm: Comm, verify: str, ph: Phases) -> None:
        self.storage, self.ckpt, self.man, self.comm, self.verify, self.ph = storage, ckpt, man, comm, verify, ph
        self.bytes_read = self.verified = self.received = 0
        self.bad: list[tuple[str, str]] = []
        self.err: BaseException | None = None
        self.entries: list[Entry] = []
        self.sees: set[str] | None = None  # node-local: the files this rank's node holds

    def run(self, entries: list[Entry], node_local: bool, progress, bucket_bytes: int, avoid_local) -> None:
        man, comm = self.man, self.comm
        remote: list[Entry] = []
        if node_local:  # node-local files: this rank reads what its node holds, the rest is sent
            from ..remote import files_needed

            avoid = set(avoid_local)
            self.sees = {f for f in man.files if f not in avoid and self.storage.exists(self.storage.join(self.ckpt, f))}
            local = []
            for e in entries:
                (remote if e.layout.numel and not files_needed(man, e.key) <= self.sees else local).append(e)
            entries = local
        self.entries = entries
        # how many pieces each rank needs from other nodes rides the node-shared decision
        record = {"remote": len(remote)} if node_local and comm.world > 1 else None
        with self.ph.phase("read"):
            try:
                self._add(*read_all(entries, man, self.storage, self.ckpt, self.verify, progress, comm.rank, comm.world,
                                    comm=comm if comm.world > 1 else None, record=record))
            except Exception as e:  # agreed later: every rank raises, none waits alone
                self.err = changed(self.storage, self.ckpt, man) or e
            if node_local:  # collective, also for a rank whose own reads failed
                with self.ph.phase("exchange"):
                    self._exchange(remote, bucket_bytes, (record or {}).get("remote_counts"))
        if self.verify == "full":
            self.comm.agree(self.err, "load (reading)")
            with self.ph.phase("verify"):
                self._verify_share()

    def _add(self, nbytes: int, verified: int, bad: list) -> None:
        self.bytes_read += nbytes
        self.verified += verified
        self.bad += bad

    def _exchange(self, remote: list[Entry], bucket_bytes: int, counts: list[int] | None) -> None:
        from ..remote import load_remote

        comm, man = self.comm, self.man

        def read_for_peers(proxies, mode):
            return read_all(proxies, man, self.storage, self.ckpt, mode, None, comm.rank, comm.world)

        b2, v2, bad2, self.received, e2 = load_remote(comm, remote, man, self.sees, read_for_peers, bucket_bytes,
                                                      self.verify, counts)
        self._add(b2, v2, bad2)
        self.err = self.err or e2

    def _verify_share(self) -> None:
        """verify="full": every rank checks its share of what no rank read whole (collective)."""
        try:
            self._add(*verify_share(self.man, self.storage, self.ckpt, self.comm,
                                    {e.key for e in self.entries if e.layout.is_full}, self.sees))
        except Exception as e:
            self.err = e
        self.comm.agree(self.err, "load (verifying)")

    def agree(self) -> None:
        """One agreement for the reads and their checksums (unless verify="full")."""
        bad = list(dict.fromkeys(self.bad))  # (a model weight read for itself and for its master: once)
        err = self.err
        if bad and err is None:
            err = changed(self.storage, self.ckpt, self.man) or ChecksumError(
                f"{self.ckpt}: checksum mismatch: " + "; ".join(f"tensor {n!r} in {f}" for f, n in bad)
                + ": the checkpoint is damaged; do not use it (an older step, or another copy)", bad)
        self.comm.agree(err, "load (reading)" if self.verify != "full" else "load (checksums)")


def _report_unused(ckpt: str, man: Manifest, t: Target, on_unexpected: str) -> None:
    """Logs (rank 0): a whole role of the checkpoint that fed nothing (ignored, but never
    silently: the state dict of an optimizer whose state does not exist yet), and the values
    missing, unexpected (``warn``) and not restored."""
    unexpected = t.unexpected
    if on_unexpected == "ignore" and unexpected:
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
    for what, keys in (("not in the checkpoint", t.missing),
                       ("in the checkpoint but not in the target", unexpected if on_unexpected == "warn" else []),
                       ("not restored", t.skipped)):
        if keys:
            log.warning("load %s: %d value(s) %s: %s%s", ckpt, len(keys), what, ", ".join(keys[:8]),
                        " ..." if len(keys) > 8 else "")
