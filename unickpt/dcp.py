"""torch.distributed.checkpoint (DCP) interop, both ways (docs/dcp.md).

* :class:`StorageReader`: ``dcp.load(state, storage_reader=unickpt.dcp.StorageReader(path))``
  loads any unickpt checkpoint into any layout DCP's planner asks for (DTensor, FSDP2, TP,
  plain tensors), through unickpt's loader: only the byte ranges a rank needs are read, coded
  tensors are decoded, and every returned byte is checked against the manifest's checksums.
* :class:`StorageWriter`: ``dcp.save(state, storage_writer=unickpt.dcp.StorageWriter(path))``
  (or ``dcp.async_save``) writes a normal unickpt checkpoint through unickpt's collective save
  pipeline: whole tensors, manifest, checksums, atomic commit. No ``.metadata`` pickle.

Mapping (the one :func:`unickpt.state.flatten` uses): a DCP key path ``(role, *rest)`` is the
tensor ``".".join(rest)`` of role ``role``; a one-component path is a top-level tensor, role
``other``. JSON values travel in the manifest's ``state`` at their nested path; DCP's bytes
entries are served as ``torch.save`` bytes of those JSON values. Anything else is refused:
nothing is pickled.

Call order (DCP's): writers ``reset -> set_up_storage_writer -> prepare_local_plan ->
prepare_global_plan (coordinator) -> write_data (every rank: the collective save, committed
here) -> finish (coordinator: nothing left to do)``; readers ``reset -> read_metadata ->
set_up_storage_reader -> prepare_local_plan -> prepare_global_plan (coordinator) ->
read_data`` (local reads; collective only for ``{node}`` paths).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import types
import warnings
from typing import Any, Mapping

import torch
from torch.distributed.checkpoint import storage as _dcp_storage
from torch.distributed.checkpoint.metadata import (


    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.futures import Future

from .io import catalog as _catalog
from .loading import LoadOptions
from .loading.locate import changed
from .loading.session import read_all
from .loading.verify import verify_share
from .errors import (
    CheckpointChangedError,
    ChecksumError,
    FormatError,
    InvalidArgumentError,
    NotSupportedError,
    ShapeMismatchError,
    StateDictError,
    TensorMissingError,
)
from .format import torch_dtype
from .layout import Layout
from .manifest import Manifest, name_problem
from .saving import DEFAULT_BUCKET, SaveOptions, SaveResult, save_entries
from .state import _ROLE, OTHER_ROLE, Entry, from_json, is_state_value, like_target, set_json_path, tie, to_json
from .io.storage import per_node, storage_for
from .transport import Comm

__all__ = ["StorageReader", "StorageWriter"]

WriteResult = _dcp_storage.WriteResult


def _role_name(path: tuple) -> tuple[str, str]:
    """(role, tensor name) of a DCP key path, as :func:`unickpt.state.flatten` names it."""
    parts = [str(p) for p in path]
    if len(parts) == 1:
        return OTHER_ROLE, parts[0]
    return parts[0], ".".join(parts[1:])


def _fqn(role: str, name: str) -> str:
    """DCP key of stored tensor ``(role, name)``: ``role.name``; top-level (role ``other``): ``name``."""
    return name if role == OTHER_ROLE else f"{role}.{name}"


def _json_leaves(value: Any, path: tuple, out: dict[str, tuple[tuple, Any]]) -> None:
    """The leaves DCP's flattening (``_traverse.traverse_state_dict``) makes of a JSON value:
    mappings are walked, lists only when they hold a mapping or a list that is walked."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            _json_leaves(v, path + (str(k),), out)
    elif isinstance(value, list) and not _terminal(value):
        for i, v in enumerate(value):
            _json_leaves(v, path + (i,), out)
    else:
        out[".".join(map(str, path))] = (path, value)


def _terminal(value: list) -> bool:
    return not any(isinstance(x, Mapping) or (isinstance(x, list) and not _terminal(x)) for x in value)


def _done(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


# -- reading -------------------------------------------------------------------------------


class StorageReader(_dcp_storage.StorageReader):
    """A :class:`torch.distributed.checkpoint.StorageReader` over a unickpt checkpoint.

    Args:
        path: a checkpoint directory, a root holding ``step-*`` checkpoints (the newest
            committed one), a ``{node}`` node-local path, or a URL (``s3://``, any fsspec URL).
        storage_options: options of the fsspec file system of a URL ``path``.
        verify: ``"auto"`` (default) checks every checksummed range behind every byte
            returned; ``"full"`` also checks every stored byte (dealt out over the ranks);
            ``"none"`` skips checks (explicit opt-out).
        process_group: the group given to ``dcp.load`` (default: the default group). Used only
            for ``{node}`` paths (pieces this node does not hold are read by ranks that hold
            them and sent) and ``verify="full"`` there.
        mapping: a :class:`~unickpt.Mapping`: the checkpoint as the tensors it makes
            (:meth:`Mapping.targets`, in every role), so ``dcp.load`` fills a state dict of
            other names and layouts (a torchtitan model from a Hugging Face checkpoint:
            ``Mapping.torchtitan_from_hf(config)``); each piece DCP asks for reads only the
            boxes of the stored tensors it needs.

    Example::

        import torch.distributed.checkpoint as dcp
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, storage_reader=unickpt.dcp.StorageReader("ckpt"))
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)

    Failures raise DCP's ``CheckpointException``; ``e.failures[rank][0]`` is unickpt's typed
    error (:class:`~unickpt.errors.ChecksumError` naming file and tensor, ...). With
    ``no_dist=True``, torch reports a failure while reading the metadata (a missing
    checkpoint, a mapping refused) as an ``AssertionError`` quoting unickpt's error.
    """

    def __init__(self, path: str | os.PathLike, *, storage_options: Mapping[str, Any] | None = None,
                 verify: str = "auto", process_group=None, timeout_s: float | None = None, mapping=None) -> None:
        # checked as unickpt.load checks them (typed errors naming the argument)
        LoadOptions(verify=verify, storage_options=storage_options, timeout_s=timeout_s,  # type: ignore[arg-type]
                    mapping=mapping)
        self.mapping = mapping
        self.path = path
        self.storage_options = storage_options
        self.verify = verify
        self.process_group = process_group
        self.timeout_s = timeout_s
        self._clear()

    def _clear(self) -> None:
        self._storage = None
        self._ckpt: str | None = None
        self._man: Manifest | None = None
        self._json: dict[str, Any] = {}
        self._keys: dict[str, tuple[str, str]] = {}
        self._mapped: dict[str, tuple[str, str, tuple[int, ...]]] = {}  # DCP key -> (role, target, shape)
        self._rank = 0
        self._comm: Comm | None = None

    @property
    def checkpoint(self) -> str | None:
        """The checkpoint read (a root resolves to its newest committed step), once
        ``dcp.load`` has read its metadata; else None."""
        return None if self._ckpt is None else str(self._ckpt)

    @property
    def lossy_generations(self) -> int:
        """Lossy save/resume cycles the values read have been through (docs/compression.md,
        the error budget): pass them to the next save of this state,
        ``StorageWriter(path, options=unickpt.SaveOptions(lossy_generations=...))``."""
        if self._man is None:
            raise InvalidArgumentError("unickpt.dcp.StorageReader: nothing read yet (call dcp.load with it first)")
        return self._man.lossy_generations

    # DCP's interface, in its call order

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = checkpoint_id
        self._clear()

    def read_metadata(self) -> Metadata:
        """DCP :class:`Metadata` of the checkpoint: each stored tensor is one chunk at offset 0;
        JSON leaves of the manifest's ``state`` are bytes entries; ``planner_data`` maps every
        key to its path (tensors: ``(role, name)``, or ``(name,)`` for role ``other``)."""
        storage, p = storage_for(self.path, self.storage_options)
        ckpt, _, man = _catalog.open_checkpoint(storage, p)
        sdm: dict[str, Any] = {}
        paths: dict[str, tuple] = {}
        keys: dict[str, tuple[str, str]] = {}
        for (role, name), st in sorted(man.tensors.items()):
            fqn = _fqn(role, name)
            if fqn in keys:
                raise NotSupportedError(
                    f"{ckpt}: tensors {name!r} of role {role} and {keys[fqn][1]!r} of role {keys[fqn][0]} both have the "
                    f"DCP key {fqn!r}; load this checkpoint with unickpt.load")
            keys[fqn] = (role, name)
            shape = torch.Size(st.shape)
            sdm[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=torch_dtype(st.dtype)),
                size=shape,
                chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=shape)],
            )
            paths[fqn] = (name,) if role == OTHER_ROLE else (role, name)
        for (role, name), stored in sorted(man.aliases.items()):  # tied weights: every name reads the stored one
            fqn = _fqn(role, name)
            if fqn in keys:
                raise NotSupportedError(
                    f"{ckpt}: the tied name {name!r} of role {role} and the tensor {keys[fqn][1]!r} of role "
                    f"{keys[fqn][0]} both have the DCP key {fqn!r}; load this checkpoint with unickpt.load")
            keys[fqn] = (role, stored)
            sdm[fqn] = sdm[_fqn(role, stored)]
            paths[fqn] = (name,) if role == OTHER_ROLE else (role, name)
        mapped: dict[str, tuple[str, str, tuple[int, ...]]] = {}
        if self.mapping is not None:
            sdm, paths, keys, mapped = self._map(ckpt, man, sdm, paths, keys)
        leaves: dict[str, tuple[tuple, Any]] = {}
        for k, v in from_json(man.state).items():  # (NaN and infinities as floats: leaves)
            _json_leaves(v, (k,), leaves)
        for fqn, (path, value) in leaves.items():
            if fqn in sdm:
                raise NotSupportedError(f"{ckpt}: the DCP key {fqn!r} names both a tensor and a JSON value of the "
                                          "manifest's state; load this checkpoint with unickpt.load")
            sdm[fqn] = BytesStorageMetadata()
            paths[fqn] = path
        self._storage, self._ckpt, self._man, self._keys, self._mapped = storage, ckpt, man, keys, mapped
        self._json = {fqn: value for fqn, (_, value) in leaves.items()}
        return Metadata(state_dict_metadata=sdm, planner_data=paths, storage_meta=StorageMeta(checkpoint_id=ckpt))

    def _map(self, ckpt: str, man: Manifest, sdm: dict, paths: dict, keys: dict):
        """The tensor keys of the metadata replaced by the mapping's targets, role by role:
        a target no rule makes reads its stored tensor as before; the others are recorded
        (``mapped``) with their shapes and read through :func:`unickpt.mapping.expand`."""
        from .mapping import mapped_targets

        mapping = self.mapping
        out_sdm = {k: v for k, v in sdm.items() if k not in keys}  # (the JSON leaves)
        out_paths = {k: v for k, v in paths.items() if k not in keys}
        out_keys: dict[str, tuple[str, str]] = {}
        mapped: dict[str, tuple[str, str, tuple[int, ...]]] = {}
        by_role: dict[str, dict[str, str]] = {}
        for fqn, (role, stored) in keys.items():
            name = paths[fqn][-1]
            by_role.setdefault(role, {})[name] = stored
        for role, names in sorted(by_role.items()):
            planned = mapped_targets(mapping, {n: man.tensors[(role, s)] for n, s in names.items()}, ckpt)
            for t, m in planned.items():
                fqn = _fqn(role, t)
                if fqn in out_sdm or fqn in out_keys:
                    raise NotSupportedError(f"{ckpt}: the mapping's target {t!r} of role {role} has the DCP key {fqn!r} "
                                            "of another entry; load this checkpoint with unickpt.load")
                out_paths[fqn] = (t,) if role == OTHER_ROLE else (role, t)
                if m.pieces is None:  # read as it is named
                    out_keys[fqn] = (role, names[t])
                    out_sdm[fqn] = sdm[_fqn(role, t)]
                    continue
                mapped[fqn] = (role, t, m.shape)
                out_keys[fqn] = (role, t)
                size = torch.Size(m.shape)
                out_sdm[fqn] = TensorStorageMetadata(
                    properties=TensorProperties(dtype=torch_dtype(m.dtype)), size=size,
                    chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=size)])
        return out_sdm, out_paths, out_keys, mapped

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._man is None:  # metadata handed over without read_metadata: read ours
            self.read_metadata()
        rank = kwargs.get("rank")
        self._rank = rank if type(rank) is int else 0
        if per_node(self.path):
            self._comm = Comm(self.process_group, timeout_s=self.timeout_s)
            if type(rank) is int and rank != self._comm.rank:
                raise InvalidArgumentError(
                    f"unickpt.dcp.StorageReader: DCP runs this as rank {rank}, its process_group as rank "
                    f"{self._comm.rank}: pass dcp.load's process group as process_group= ('local' with no_dist=True)")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        # which checkpoint this rank resolved: every rank must read the same one
        return dataclasses.replace(plan, storage_data={"ckpt": os.path.basename(str(self._ckpt)),
                                                       "digest": self._man.source_digest})

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        seen = [(p.storage_data or {}) for p in plans]
        first = seen[0]
        for r, s in enumerate(seen):
            if s != first:
                raise CheckpointChangedError(
                    f"{self.path}: rank 0 resolved {first.get('ckpt')!r} and rank {r} {s.get('ckpt')!r} (or the same name "
                    "with another manifest): a save committed while the ranks looked; pass the checkpoint directory")
        if self._comm is not None and len(plans) != self._comm.world:
            raise InvalidArgumentError(f"dcp.load runs on {len(plans)} rank(s) but process_group has {self._comm.world}: "
                                       "pass dcp.load's process group as process_group=")
        return [dataclasses.replace(p, storage_data={"rank": i, "world": len(plans)}) for i, p in enumerate(plans)]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        if self._man is None:
            raise InvalidArgumentError("unickpt.dcp.StorageReader.read_data before read_metadata")
        entries: list[Entry] = []
        casts: list[tuple[torch.Tensor, torch.Tensor]] = []
        commits = []
        err: BaseException | None = None
        try:
            self._targets(plan, planner, entries, casts, commits)
        except Exception as e:
            if self._comm is None:
                raise
            err, entries = e, []  # node-local: still in the collectives (the peers' reads come through us)
        try:
            self._read(entries, plan, err)  # (raises err)
        finally:
            self._comm = None  # the load's last collective: hold no process group past it (see write_data)
        for target, dest in casts:
            target.copy_(dest.view(target.shape) if dest.shape != target.shape else dest)
        for ri, target in commits:
            planner.commit_tensor(ri, target)
        return _done(None)

    def _targets(self, plan: LoadPlan, planner: LoadPlanner, entries: list, casts: list, commits: list) -> None:
        """What ``plan`` asks: JSON values handed to the planner now, tensors as entries to
        read (into ``entries``; a dtype DCP casts goes through a buffer: ``casts``), each
        with the read item to commit (``commits``)."""
        man, ckpt = self._man, self._ckpt
        for ri in plan.items:
            fqn = ri.storage_index.fqn
            if ri.type == LoadItemType.BYTE_IO:
                if fqn not in self._json:
                    raise TensorMissingError(f"{ckpt}: no JSON value {fqn!r} in the manifest's state")
                value = self._json[fqn]
                cur = getattr(planner, "state_dict", None)  # (DefaultLoadPlanner's: the target's values)
                cur = cur.get(ri.dest_index.fqn) if isinstance(cur, Mapping) else None
                value = like_target(cur, value)  # JSON has no tuples: the target's kinds (betas)
                buf = io.BytesIO()
                torch.save(value, buf)  # a JSON value of the (checksummed) manifest
                buf.seek(0)
                planner.load_bytes(ri, buf)
                continue
            key = self._keys.get(fqn)
            if key is None:
                raise TensorMissingError(f"{ckpt}: no tensor {fqn!r} in the checkpoint")
            if fqn in self._mapped:
                self._target_mapped(ri, planner, fqn, entries, casts, commits)
                continue
            st = man.tensors[key]
            if any(ri.storage_index.offset or ()):
                raise FormatError(f"{ckpt}: DCP asks tensor {fqn!r} from a chunk at {list(ri.storage_index.offset)}; "
                                  "unickpt stores each tensor whole (one chunk at offset 0)")
            target = planner.resolve_tensor(ri).detach()
            lay = Layout(tuple(st.shape), tuple(ri.storage_offsets), tuple(ri.lengths))
            if target.numel() != lay.numel:
                raise ShapeMismatchError(f"{ckpt}/{st.file}: tensor {fqn!r}: DCP's target piece has shape "
                                         f"{list(target.shape)}, the read asks {list(ri.lengths)}")
            dest = target
            if target.dtype != torch_dtype(st.dtype):  # DCP casts on load: read the stored dtype, then copy
                dest = torch.empty(target.shape, dtype=torch_dtype(st.dtype))
                casts.append((target, dest))
            entries.append(Entry(key[0], key[1], dest, lay))
            commits.append((ri, target))

    def _target_mapped(self, ri, planner: LoadPlanner, fqn: str, entries: list, casts: list, commits: list) -> None:
        """A read item of a mapped target: its piece as boxes of the stored tensors
        (:func:`unickpt.mapping.expand`)."""
        from .mapping import expand

        man, ckpt = self._man, self._ckpt
        role, t, shape = self._mapped[fqn]
        if any(ri.storage_index.offset or ()):
            raise FormatError(f"{ckpt}: DCP asks target {fqn!r} from a chunk at {list(ri.storage_index.offset)}; the "
                              "mapping's targets are one chunk at offset 0")
        target = planner.resolve_tensor(ri).detach()
        lay = Layout(tuple(shape), tuple(ri.storage_offsets), tuple(ri.lengths))
        if target.numel() != lay.numel:
            raise ShapeMismatchError(f"{ckpt}: target {fqn!r} of the mapping: DCP's target piece has shape "
                                     f"{list(target.shape)}, the read asks {list(ri.lengths)}")

        def stored_shape(r: str, name: str):  # (tied names read the stored tensor)
            st = man.entry(r, name)
            return None if st is None else tuple(st.shape)

        pieces = self.mapping.pieces(t, shape, lambda n: stored_shape(role, n))
        sdt = torch_dtype(man.entry(role, pieces[0].source).dtype)  # (one dtype: checked in read_metadata)
        dest = target
        if target.dtype != sdt or tuple(target.shape) != tuple(ri.lengths):
            dest = torch.empty(tuple(ri.lengths), dtype=sdt)
            casts.append((target, dest))
        for ent in expand([Entry(role, t, dest, lay)], self.mapping, stored_shape):
            if ent.key not in man.tensors and ent.key in man.aliases:  # a tied name: the stored tensor's bytes
                ent = dataclasses.replace(ent, name=man.aliases[ent.key])
            entries.append(ent)
        commits.append((ri, target))

    def _read(self, entries: list[Entry], plan: LoadPlan, err: BaseException | None = None) -> None:
        """unickpt's reading path (loading.session.read_all; node-local: remote.load_remote), then the
        checksum verdict. Raises typed errors naming file and tensor. Node-local, it is
        collective: a rank that failed before (``err``) still serves its peers' reads and
        meets them in every agreement, then raises ``err``."""
        man, storage, ckpt, verify = self._man, self._storage, self._ckpt, self.verify
        sd = plan.storage_data if isinstance(plan.storage_data, dict) else {}
        rank, world = sd.get("rank", self._rank), sd.get("world", 1)
        bad: list[tuple[str, str]] = []
        comm = self._comm
        sees = set(man.files)
        remote: list[Entry] = []
        if comm is not None:  # node-local: what this node does not hold is read by others and sent
            from .remote import files_needed

            sees = {f for f in man.files if storage.exists(storage.join(ckpt, f))}
            local = []
            for e in entries:
                (remote if e.layout.numel and not files_needed(man, e.key) <= sees else local).append(e)
            entries = local
        try:
            if err is None:
                _, _, bad = read_all(entries, man, storage, ckpt, verify, None, rank, world)
        except Exception as e:
            err = changed(storage, ckpt, man) or e
        if comm is not None:  # collective (every rank of dcp.load is in read_data), also after a failure
            from .remote import load_remote

            def read_for_peers(proxies, mode):
                return read_all(proxies, man, storage, ckpt, mode, None, comm.rank, comm.world)

            _, _, bad2, _, e2 = load_remote(comm, remote, man, sees, read_for_peers, DEFAULT_BUCKET, verify)
            bad += bad2
            err = err or e2
        if comm is not None and verify == "full":  # the share below is collective: every rank, or none
            comm.agree(err, "dcp load (reading)")
        if err is None and verify == "full":
            try:
                done = {e.key for e in entries if e.layout.is_full}
                if comm is not None:
                    _, _, bad3 = verify_share(man, storage, ckpt, comm, done, sees)
                else:  # shared storage: the share is dealt without talking (every rank sees every file)
                    _, _, bad3 = verify_share(man, storage, ckpt, types.SimpleNamespace(rank=rank, world=world),
                                                       done)
                bad += bad3
            except Exception as e:
                err = e
        if err is None and bad:
            err = changed(storage, ckpt, man) or ChecksumError(
                f"{ckpt}: damaged checkpoint: stored bytes do not match the manifest's checksums: "
                + "; ".join(f"tensor {n!r} in {f}" for f, n in bad)
                + " (the target state dict now holds unverified values: do not use it)", bad)
        if err is not None:
            raise err

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """True if ``checkpoint_id`` resolves to a committed unickpt checkpoint."""
        try:
            storage, p = storage_for(checkpoint_id)
            _catalog.resolve(storage, p)
            return True
        except Exception:
            return False


# -- writing -------------------------------------------------------------------------------


class StorageWriter(_dcp_storage.StorageWriter):
    """A :class:`torch.distributed.checkpoint.StorageWriter` that writes a unickpt checkpoint.

    ``dcp.save(state, storage_writer=unickpt.dcp.StorageWriter(path, step=100))`` (and
    ``dcp.async_save``) run unickpt's collective save over the same ranks: each rank's chunks
    (as DCP's planner dealt them out, replicated values on one rank) are described as pieces of
    whole tensors, written once, checksummed and committed atomically inside ``write_data``.
    The result loads with :func:`unickpt.load`, :class:`StorageReader`, ``safetensors`` and
    the CLI. Non-tensor values must be JSON values (None, bool, int, float, str, lists and
    dicts of them) or ``bytes`` (stored verbatim, at most 4 MiB each: a data loader's pickled
    state comes back as the same bytes, for its owner to unpickle): they go into the
    manifest's state; anything else raises :class:`~unickpt.errors.StateDictError` naming the
    key (nothing is pickled).

    With ``dcp.async_save`` (thread mode) on several ranks, the save runs on DCP's background
    thread: give it a group of its own (``pg = dist.new_group(backend="gloo")``), as
    ``process_group=pg`` to both ``dcp.async_save`` and this writer, or the thread's collectives
    would interleave with the training loop's on the default group (without one, a warning
    says so).

    Args:
        path: the checkpoint directory (URLs and ``{node}`` paths as for :func:`unickpt.save`);
            ``dcp.save(checkpoint_id=...)`` replaces it.
        options: a :class:`~unickpt.SaveOptions` (step, compression, overwrite, extra,
            storage_options...), as :func:`unickpt.save` takes it; ``strategy`` gains
            ``"writer": "unickpt.dcp.StorageWriter"``.
        process_group: the group given to ``dcp.save`` (default: the default group; ``"local"``
            with ``no_dist=True``).

    ``last_result`` holds the :class:`~unickpt.SaveResult` of the last save. The keywords of
    earlier releases (``step=``, ``quant=``, ``overwrite=``...) still work, with a
    ``DeprecationWarning``.
    """

    def __init__(self, path: str | os.PathLike, *, options: SaveOptions | None = None, process_group: Any = None,
                 **deprecated: Any) -> None:
        self.path = path
        self.process_group = process_group
        if deprecated:
            known = {f.name for f in dataclasses.fields(SaveOptions)} | {"quant", "master", "zstd"}
            unknown = sorted(set(deprecated) - known)
            if unknown:
                raise TypeError(f"StorageWriter() got unexpected keyword argument(s) {unknown}")
            if options is not None:
                raise InvalidArgumentError(f"pass {sorted(deprecated)} in options=SaveOptions(...), not beside it")
            warnings.warn(f"StorageWriter({', '.join(f'{k}=' for k in sorted(deprecated))}...) is deprecated: pass "
                          "options=unickpt.SaveOptions(...) (quant/master/zstd in compression=unickpt.Compression(...))",
                          DeprecationWarning, stacklevel=2)
            options = SaveOptions.of(**deprecated)
        if options is None:
            options = SaveOptions()
        if not isinstance(options, SaveOptions):
            raise InvalidArgumentError(f"options must be a unickpt.SaveOptions, got {type(options).__name__}")
        self.opts = dataclasses.replace(options, strategy={"writer": "unickpt.dcp.StorageWriter",
                                                          **dict(options.strategy or {})})
        self.last_result: SaveResult | None = None
        self._comm: Comm | None = None
        self._warned_thread = False

    def __getstate__(self) -> dict[str, Any]:
        """Process-mode ``dcp.async_save`` pickles the writer into its checkpointing process:
        a process group does not travel (that process has its own), nor do open handles."""
        state = dict(self.__dict__)
        state["_comm"] = None
        if state.get("process_group") not in (None, "local", "world"):
            state["process_group"] = None
        return state

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = checkpoint_id
        self._comm = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._check_thread()
        self._comm = Comm(self.process_group, timeout_s=self.opts.timeout_s)
        rank = kwargs.get("rank")
        if type(rank) is int and rank != self._comm.rank:
            raise InvalidArgumentError(
                f"unickpt.dcp.StorageWriter: DCP runs this as rank {rank}, its process_group as rank {self._comm.rank}: "
                "pass dcp.save's process group as process_group= ('local' with no_dist=True)")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if self._comm is not None and len(plans) != self._comm.world:
            raise InvalidArgumentError(
                f"dcp.save runs on {len(plans)} rank(s) but the writer's process_group has {self._comm.world}: pass "
                "dcp.save's process group as process_group= ('local' with no_dist=True)")
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        """Collective (every rank of ``dcp.save`` is here): this rank's chunks and JSON values
        go through unickpt's save pipeline, committed before this returns."""
        self._check_thread()
        comm = self._comm if self._comm is not None else Comm(self.process_group, timeout_s=self.opts.timeout_s)

        def read_plan() -> tuple[list[Entry], list[list], list[WriteResult]]:
            from .api import _check_shared

            got = self._collect(plan, planner)
            _check_shared(self.path, self.opts.storage_options, False, comm.group if comm.active else "local")
            return got

        entries, values, results = comm.step("dcp save (reading the plan)", read_plan)
        json_state: dict[str, Any] = {}
        if comm.world > 1:
            gathered = [json.loads(b) for b in comm.all_gather_bytes(json.dumps(values).encode(), "dcp save (the state's values)")]
        else:
            gathered = [values]
        for vals in gathered:
            for path, v in vals:
                set_json_path(json_state, tuple(path), v)
        try:
            self.last_result = save_entries(comm, (entries, json_state), None, self.path, self.opts)
        finally:  # committed (or failed) on every rank: the writer holds no process group past its save, so
            self._comm = None  # none outlives destroy_process_group (gloo aborts when one is freed at exit)
        return _done(results)

    def _check_thread(self) -> None:
        """Off the main thread (``dcp.async_save``'s thread mode) on several ranks, the default
        group carries this save's collectives: any collective the loop runs meanwhile on that
        group interleaves with them (gloo aborts a process on a mismatch). Said once per
        writer, as a warning (a loop that waits for the save before its next collective is
        safe, as with DCP's own writer)."""
        import threading

        import torch.distributed as dist

        if (self.process_group is None and not self._warned_thread
                and threading.current_thread() is not threading.main_thread()
                and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            self._warned_thread = True
            warnings.warn(
                "unickpt.dcp.StorageWriter runs on a background thread (dcp.async_save) over the default process "
                "group: a collective the training loop runs on that group before the save ends interleaves with the "
                "save's (gloo then aborts a process). Give the save a group of its own: pg = "
                "torch.distributed.new_group(backend='gloo'), passed as process_group=pg to both dcp.async_save and "
                "StorageWriter", UserWarning, stacklevel=2)

    def _collect(self, plan: SavePlan, planner: SavePlanner) -> tuple[list[Entry], list[list], list[WriteResult]]:
        mappings = getattr(planner, "mappings", None) or {}
        entries: list[Entry] = []
        values: list[list] = []
        results: list[WriteResult] = []
        seen: dict[tuple[str, str], str] = {}
        for item in plan.items:
            fqn = item.index.fqn
            path = tuple(mappings.get(fqn, (fqn,)))
            if item.type == WriteItemType.BYTE_IO:
                obj = planner.lookup_object(item.index)
                if not is_state_value(obj):
                    raise StateDictError(
                        f"{fqn!r} holds a {type(obj).__name__}, which unickpt cannot store: use tensors, bytes (e.g. "
                        "pickle.dumps of your own object, stored verbatim; a BytesIO's getvalue()) or JSON values "
                        "(None, bool, int, float, str, lists and dicts of them); nothing is pickled by unickpt")
                v = to_json(obj, fqn)  # tuples -> lists, infinities encoded, as in the manifest
                values.append([list(path), v])
                results.append(WriteResult(index=item.index, size_in_bytes=len(json.dumps(v)),
                                           storage_data={"state": list(path)}))
                continue
            role, name = _role_name(path)
            if len(path) > 1 and not _ROLE.match(role):
                raise StateDictError(f"top-level key {role!r} names a role (file prefix): use lowercase letters, digits, "
                                     "'_' (at most 32, starting with a letter)")
            why = name_problem(name)
            if why:
                raise StateDictError(f"{fqn!r}: cannot store a tensor under this name: {why}")
            if (role, name) in seen:
                raise NotSupportedError(
                    f"{fqn!r}: this rank holds several chunks of tensor {name!r} (role {role}) ({seen[(role, name)]} and "
                    f"{list(item.index.offset or ())}); unickpt.dcp takes one chunk per tensor and rank")
            td = item.tensor_data
            local = planner.resolve_data(item)
            if not isinstance(local, torch.Tensor) or td is None:
                raise StateDictError(f"{fqn!r}: DCP planned a tensor but resolved a {type(local).__name__}")
            local = local.detach()
            lay = Layout(tuple(td.size), tuple(td.chunk.offsets), tuple(td.chunk.sizes))
            if local.numel() != lay.numel:
                raise StateDictError(f"{fqn!r}: the resolved chunk has {local.numel()} elements, DCP's plan says "
                                     f"{lay.numel} (sizes {list(td.chunk.sizes)})")
            seen[(role, name)] = str(list(td.chunk.offsets))
            entries.append(Entry(role, name, local, lay))
            results.append(WriteResult(index=item.index, size_in_bytes=lay.numel * local.element_size(),
                                       storage_data={"role": role, "name": name}))
        return tie(entries), values, results  # tied weights stored once, as unickpt.save does

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Nothing left: the checkpoint was committed by every rank's ``write_data`` (the
        manifest replaces DCP's ``.metadata``, which is not written)."""
        return None

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=os.fspath(self.path))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """Any local path or URL names a checkpoint unickpt can write."""
        return isinstance(checkpoint_id, (str, os.PathLike)) and bool(os.fspath(checkpoint_id))
