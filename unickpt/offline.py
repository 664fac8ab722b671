"""Offline, single-process tools that stream a checkpoint tensor by tensor (peak memory: the
largest tensor plus I/O buffers): ``unickpt reshard`` (rewrite with other files or without
some roles) and ``unickpt convert --from-dcp`` (import a torch.distributed.checkpoint).

Both write a new unickpt checkpoint into a temporary sibling with fresh checksums and
commit it atomically; the destination is never left half-written, and an existing one stays
intact until the new one is in place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import time
from typing import Callable, Iterable

import torch

from . import codecs
from ._metrics import gbps, human_bytes, log
from .codecs import FromModel, Raw, Residual16, chunk_elems, encode_chunk, stored_parts
from .codecs.kernels import BLOCK, split_master
from .compress import Compression, error_record, save_args, tag_for
from .errors import FormatError, InvalidArgumentError, StateDictError, UnickptError
from .format import Hasher, block_sums, dtype_name, itemsize, order_key, torch_dtype
from .io import commit as _commit
from .io.catalog import step_of_name
from .io.files import open_files, read_side_file
from .io.fileset import FileSet, file_entry, file_name, pack, new_manifest, split_by_size
from .io.storage import storage_for
from .loading import read_manifest
from .loading.coded import read_whole
from .manifest import INDEX_NAME, MANIFEST_NAME, name_problem, Manifest, Part, TensorEntry
from .transport import node_id


__all__ = ["reshard_offline", "convert_from_dcp"]

Progress = Callable[[int, int], None] | None


class _Writer:
    """A new checkpoint written tensor by tensor, committed at the end. Tensors may carry a
    codec tag (:mod:`unickpt.codecs`): quantized moments are encoded whole, residual
    masters are split against their model weight; ``zstd`` frames every non-model file,
    ``lossless`` byte-groups every file (:mod:`unickpt.container`)."""

    def __init__(self, dst, overwrite: bool, zstd: int | None = None, step: int | None = None,
                 lossless: bool = False) -> None:
        self.storage, self.final = storage_for(dst)
        # the write transaction of saves: begin() sweeps the temporaries of dead owners of
        # this destination (an earlier killed reshard) and records this process as the owner
        self.txn = _commit.Transaction(self.storage, self.final, overwrite=overwrite, step=step)
        try:
            self.txn.begin()
        except BaseException:  # (a Ctrl-C inside begin: its temporary may already exist)
            with _interrupts_held():
                self.txn.abort()
                self.storage.close()
            raise
        self.tmp = self.txn.tmp
        self.zstd, self.lossless = zstd, lossless
        self.where: dict[tuple[str, str], tuple[str, dict]] = {}  # key -> (file, part -> TensorInfo)
        self.meta: dict[tuple[str, str], tuple[str, tuple[int, ...], dict | None]] = {}  # key -> (dtype, shape, tag)
        self.files: dict[str, tuple[str, bytes, int]] = {}  # name -> (role, header, size)
        self.out = FileSet(self.storage, self.tmp)  # (file names: the stored ones, self.txn.file_name's)
        self.sums: dict[tuple[str, str, str], list] = {}
        self.args: dict[tuple[str, str], dict] = {}

    def layout(self, entries: list[tuple], max_file_bytes: int | None) -> list:
        """Assign files to ``(role, name, dtype, shape[, tag])`` entries; returns them in write
        order. Entries with a ``from_model`` tag store nothing."""
        entries = [tuple(e) + (None,) * (5 - len(e)) for e in entries]
        order = []
        for e in entries:
            self.meta[(e[0], e[1])] = (e[2], tuple(e[3]), e[4])
        for role in sorted({e[0] for e in entries}):
            mine = sorted((e for e in entries if e[0] == role), key=lambda e: order_key(e[2], e[1]))
            def size_of(e) -> int:
                return sum(math.prod(sh) * itemsize(dt) for _, _, dt, sh in stored_parts(e[1], e[2], e[3], e[4]))

            parts = [p for p in split_by_size(mine, size_of, max_file_bytes) if any(stored_parts(*x[1:5]) for x in p)]
            for i, part in enumerate(parts, start=1):
                fname = self.txn.file_name(file_name(role, i, len(parts)))
                header, stored = pack(((k, dt, sh, (e, pt)) for e in part for pt, k, dt, sh in stored_parts(*e[1:5])),
                                         {"format": "pt", "unickpt_role": role})
                size = len(header) + sum(info.nbytes for *_, info in stored)
                self.files[fname] = (role, header, size)
                z = self.zstd if role != "model" and not self.lossless else None
                self.out.create(fname, size, bool(z) or self.lossless)
                self.out.open(fname, fname, size, header=header, zstd=z, lossless=self.lossless)
                for _, _, _, (e, pt), info in stored:
                    self.where.setdefault((e[0], e[1]), (fname, {}))[1][pt] = info
            order += [e for p in parts for e in p if (e[0], e[1]) in self.where]
        order += [e for e in entries if (e[0], e[1]) not in self.where]  # from_model: nothing stored
        return order

    def _put(self, role, name, part: str, x: torch.Tensor, offset: int = 0) -> None:
        fname, infos = self.where[(role, name)]
        if x.numel():
            mv = memoryview(x.contiguous().reshape(-1).view(torch.uint8).numpy())
            self.sums.setdefault((role, name, part), []).extend(block_sums(mv, offset))
            self.out.write(fname, infos[part].begin + offset, mv)

    def write(self, role: str, name: str, x: torch.Tensor, model: torch.Tensor | None = None) -> None:
        """Store full tensor ``x`` as its tag says (``model``: the bf16 weight of a residual master)."""
        tag = self.meta[(role, name)][2]
        codec = codecs.get(tag["codec"]) if tag is not None else None
        if codec is None:
            self._put(role, name, "", x)
        elif codec.quantized:
            step = chunk_elems(tag, 1 << 24)  # bounded temporaries for huge tensors
            flat = x.reshape(-1)
            stats: list = []
            for a in range(0, flat.numel(), step):
                for part, off, data in encode_chunk(tag, flat[a : a + step], a, f"tensor {name!r} (role {role})", stats):
                    self._put(role, name, part, data, off)
            self.args.setdefault((role, name), {})["error"] = error_record(stats)
        elif codec.exceptions:  # a residual master
            res = split_master(x, model)
            self._put(role, name, "low16", res.low)
            self.args[(role, name)] = {"exceptions": [res.exc_index.tolist(), res.exc_bits.tolist()]}

    def commit(self, *, step, state, extra, strategy: dict, compression: dict | None = None,
               aliases: dict | None = None, per_rank: set | None = None, aux: dict[str, bytes] | None = None,
               world_size: int = 1) -> str:
        """``aliases``, ``per_rank``: as the manifest records them; ``aux``: side files (name ->
        bytes, checked already) written beside the data and listed in the manifest;
        ``world_size``: of the save that made the values (per-rank tensors hold a row per rank
        of it). The manifest is read back as a load reads it before anything is committed."""
        _, framed, fragments = self.out.close()
        for fname, (_, _, size) in self.files.items():
            if fname not in framed:  # (a framed file is written whole by its one writer)
                self.out.finish(fname, [(off, data) for k, off, data in fragments if k == fname], size)
        tensors = {}
        for (role, name), (dt, shape, tag) in self.meta.items():
            if tag is not None and not codecs.get(tag["codec"]).stores:  # a dropped master: its model's file
                m = tensors.get(("model", tag["model"])) or self._entry("model", tag["model"])
                tensors[(role, name)] = TensorEntry(role, name, m.file, dt, shape, 0, 0, (), tag["codec"], 0, {},
                                                    {"model": tag["model"]})
            else:
                tensors[(role, name)] = self._entry(role, name)
        files = {n: file_entry(n, role, node_id(), 0, size, header, *((framed[n].pos, framed[n].frames) if n in framed
                                                                      else ()))
                 for n, (role, header, size) in self.files.items()}
        man = new_manifest(world_size=world_size, nodes=[node_id()], strategy=strategy, step=step, files=files,
                           tensors=tensors, state=state, extra=extra, compression=compression or {},
                           aliases=dict(aliases or {}), per_rank=set(per_rank or ()))
        side = dict(aux or {})
        idx = man.hf_index()
        if idx is not None:
            side[INDEX_NAME] = idx
        for fname, data in sorted(side.items()):
            self.txn.put(fname, data)
        man.aux = {fname: (len(data), Hasher.of(data)) for fname, data in side.items()}
        blob = man.to_json()
        Manifest.from_json(blob, self.storage.join(self.final, MANIFEST_NAME))  # what a load will check, first
        self.txn.commit(blob)
        self.storage.close()
        return self.final

    def _entry(self, role: str, name: str) -> TensorEntry:
        dt, shape, tag = self.meta[(role, name)]
        fname, infos = self.where[(role, name)]

        def sums(part: str, n: int) -> tuple:
            return tuple(tuple(x) for x in sorted(self.sums.get((role, name, part), []))) if n else ()

        if tag is None:
            info = infos[""]
            return TensorEntry(role, name, fname, info.dtype, info.shape, info.begin, info.end, sums("", info.nbytes), Raw.name, 0)
        parts = {p: Part(i.name, i.dtype, i.shape, i.begin, i.end, sums(p, i.nbytes)) for p, i in infos.items()}
        args = {k: v for k, v in tag.items() if k != "codec"}
        args.update(self.args.get((role, name), {}))
        b, e = min(i.begin for i in infos.values()), max(i.end for i in infos.values())
        return TensorEntry(role, name, fname, dt, shape, b, e, (), tag["codec"], 0, parts, args)

    def abort(self) -> None:
        """Remove the temporary, to the end even through another Ctrl-C (held off meanwhile):
        the data files first, the owner record with the directory last, so that a kill -9
        on the way leaves a temporary the next write's sweep recognises as abandoned."""
        with _interrupts_held():
            try:
                self.out.abort()  # (best effort: the temporary goes anyway)
                if self.storage.caps.atomic_rename:  # (object stores: the transaction picks this write's objects)
                    for fname in self.files:
                        self.storage.remove_file(self.storage.join(self.tmp, fname))
            finally:
                try:
                    self.storage.close()
                finally:
                    self.txn.abort()


@contextlib.contextmanager
def _interrupts_held():
    """Ctrl-C does not interrupt the block (it is ignored while it runs: the interrupt that
    started a cleanup is already on its way up). Main thread only; elsewhere a no-op."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.getsignal(signal.SIGINT)
    if old is None:  # a handler not installed from Python: leave it alone
        yield
        return
    signal.signal(signal.SIGINT, lambda *_: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def reshard_offline(
    src, dst, *, drop_roles: Iterable[str] = (), master: str = "full", quant: str | None = "O0",
    max_file_bytes: int | None = None, zstd: int | None = None, eps: float | None = None, block: int = BLOCK,
    overwrite: bool = False, progress: Progress = None, lossless: bool = False,
) -> dict:
    """Rewrite checkpoint ``src`` at ``dst``, one tensor at a time: other file sizes, without
    the roles in ``drop_roles`` (their tensors and JSON state; e.g. ``["optimizer"]``), with
    the moments quantized (``quant`` O1/O2; O0 stores them decoded), masters
    ``full``/``residual``/``drop``, zstd-framed optimizer and master files or (``lossless``)
    every file byte-grouped, bit-exact (docs/compression.md); fresh checksums.
    ``eps`` defaults to the source's (when it was quantized), else 1e-8. A role the
    checkpoint lacks is an :class:`InvalidArgumentError` naming the roles it has. What loads
    stays as it was: tied weights (aliases), per-rank tensors and the side files
    (``config.json``... checked against the manifest first; the index is written anew) of the
    roles kept."""
    t0 = time.perf_counter()
    ckpt, man = read_manifest(src)
    drop = _roles_to_drop(ckpt, man, drop_roles)
    src_storage = storage_for(ckpt)[0]  # the destination may be on another store
    aux = _side_files(src_storage, ckpt, man)  # a damaged one fails here, before DST exists
    if eps is None:
        eps = float((man.compression or {}).get("eps", 1e-8))
    comp = Compression(quant=quant, master=master, zstd=zstd, eps=eps, block=block, lossless=lossless)
    keep = [t for t in man.tensors.values() if t.role not in drop]
    models = {t.name: t for t in keep if t.role == "model"}
    entries = []
    for t in keep:
        tag = tag_for(t.role, t.name, t.dtype, t.shape, comp)
        if tag is not None:  # (offline: the tag is what the manifest records)
            tag = {**tag, **save_args(tag, t.role, t.name, comp, man.step), "generations": man.lossy_generations + 1}
        m = models.get(t.name)
        if t.role == "master" and m is not None and m.shape == t.shape:
            if master == "drop":
                tag = {"codec": FromModel.name, "model": t.name}
            elif master == "residual" and t.dtype == "F32" and m.dtype == "BF16":
                tag = {"codec": Residual16.name, "model": t.name}
        entries.append((t.role, t.name, t.dtype, t.shape, tag))
    applied = {codecs.get(tag["codec"]) for *_, tag in entries if tag}
    if master != "full" and not any(c.needs_model for c in applied):  # recorded as it was applied
        log.warning("reshard %s: master=%r applies to no tensor (no master role, or no master of a model weight of "
                    "its name and shape%s): masters are stored as they are", ckpt, master,
                    ", bf16 for residual" if master == "residual" else "")
        comp = dataclasses.replace(comp, master="full")
    if quant in ("O1", "O2") and not any(c.quantized for c in applied):
        log.warning("reshard %s: quant=%r applies to no tensor (no Adam moments, exp_avg/exp_avg_sq, in the "
                    "optimizer role): stored as they are", ckpt, quant)
        comp = dataclasses.replace(comp, quant="O0")
    readers: dict = {}  # every source file checked before anything of the claimed size is created
    open_files(src_storage, ckpt, man, {man.tensors[(t.role, t.name)].file for t in keep if t.coder.stores}
               | {man.tensors[("model", m)].file for t in keep for m in [t.coder.model_of(t.args)] if m is not None},
               readers)
    try:
        w = _Writer(dst, overwrite, zstd, step=man.step, lossless=lossless)
    except BaseException:
        for r in readers.values():
            r.close()
        raise
    total, done = sum(math.prod(t.shape) * itemsize(t.dtype) for t in keep), 0
    try:
        for role, name, dt, shape, tag in w.layout(entries, max_file_bytes):
            codec = codecs.get(tag["codec"]) if tag is not None else None
            if codec is None or codec.stores:
                x = read_whole(src_storage, ckpt, man, role, name, readers)
                model = read_whole(src_storage, ckpt, man, "model", name, readers) if codec and codec.needs_model else None
                w.write(role, name, x, model)
            done += math.prod(shape) * itemsize(dt)
            if progress:
                progress(done, total)
        strategy = dict(man.saved_by.get("strategy") or {}, resharded_from=ckpt)
        state = {k: v for k, v in man.state.items() if k not in drop}
        step = man.step if man.step is not None else step_of_name(os.path.basename(w.final.rstrip("/")))
        path = w.commit(step=step, state=state, extra=man.extra, strategy=strategy,
                        compression=_compression_record(comp, man.lossy_generations, entries),
                        aliases={k: v for k, v in man.aliases.items() if k[0] not in drop},
                        per_rank={k for k in man.per_rank if k[0] not in drop}, aux=aux,
                        world_size=int(man.saved_by.get("world_size", 1)))
    except BaseException:
        w.abort()
        raise
    finally:
        for r in readers.values():
            r.close()
    secs = time.perf_counter() - t0
    _, out = read_manifest(path)
    log.info("resharded %s -> %s: %d tensors, %s -> %s on disk in %.2f s", ckpt, path, len(keep),
             human_bytes(man.total_bytes), human_bytes(out.total_bytes), secs)
    return {"path": path, "tensors": len(keep), "bytes": total, "stored_bytes": out.total_bytes, "seconds": secs,
            "gbps": gbps(total, secs)}


SIDE_FILE_LIMIT = 256 << 20


def _side_files(storage, ckpt: str, man: Manifest) -> dict[str, bytes]:
    """The checkpoint's side files but the index (``save(extra_files=...)``: config.json...),
    each a regular file matching the size and checksum its manifest records
    (:class:`ChecksumError` otherwise). Format 1 recorded none: its side files are not
    copied, and a warning names them."""
    out = {}
    for fname, (size, _) in sorted(man.aux.items()):
        if fname == INDEX_NAME:
            continue
        if not 0 <= size <= SIDE_FILE_LIMIT:
            raise FormatError(f"{storage.join(ckpt, fname)}: the manifest records {size} bytes for it (side files: "
                              f"at most {SIDE_FILE_LIMIT} bytes)")
        out[fname] = read_side_file(storage, ckpt, man, fname, size)
    if man.format_version < 2:
        old = [n for n in ("config.json", "generation_config.json") if storage.exists(storage.join(ckpt, n))]
        if old:
            log.warning("%s: format %d checkpoints do not checksum their side files; not copied: %s", ckpt,
                        man.format_version, ", ".join(old))
    return out


def _compression_record(comp: Compression, generations: int, entries: list) -> dict | None:
    """The manifest's ``compression``: the options applied and the lossy generations of the
    values (one more when this rewrite quantizes)."""
    rec = comp.to_json() if comp.active else {}
    g = generations + (1 if any(tag and codecs.get(tag["codec"]).quantized for *_, tag in entries) else 0)
    if g:
        rec["lossy_generations"] = g
    return rec or None


def _roles_to_drop(ckpt: str, man: Manifest, drop_roles: Iterable[str]) -> set[str]:
    """``drop_roles`` as a set, each a role of the checkpoint (tensors or JSON state), leaving
    some tensors; InvalidArgumentError otherwise."""
    drop = {drop_roles} if isinstance(drop_roles, str) else set(drop_roles)
    have = {t.role for t in man.tensors.values()} | {k for k, v in man.state.items() if isinstance(v, dict)}  # (a
    # top-level JSON value that is no dict, a run's "step" say, is no role)
    unknown = sorted(drop - have)
    if unknown:
        raise InvalidArgumentError(f"{ckpt}: cannot drop role {', '.join(map(repr, unknown))}: the checkpoint has "
                                   f"roles {', '.join(sorted(have)) or '(none)'}")
    if man.tensors and all(t.role in drop for t in man.tensors.values()):
        raise InvalidArgumentError(f"{ckpt}: dropping {', '.join(sorted(drop))} would leave no tensors")
    return drop


def convert_from_dcp(dcp_dir, dst, *, overwrite: bool = False, progress: Progress = None) -> dict:
    """Import a torch.distributed.checkpoint directory, one tensor at a time. Each key's path
    comes from the metadata's ``planner_data`` (DCP's flattening: ``fqn -> path``, validated;
    without it, the key itself): a path ``(role, *rest)`` whose ``role`` is a valid role name
    stores tensor ``".".join(rest)`` of that role; others go to role ``other`` under the key.
    Non-tensor entries are read with ``torch.load(weights_only=True)`` only (never DCP's full
    unpickling); JSON values go into the manifest's state at their path (so ``unickpt.load``
    restores e.g. an optimizer's ``param_groups``). The others are listed in ``skipped``
    (``"key: reason"``), logged, and recorded in the manifest's ``extra``."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .dcp_safe import SafeFileSystemReader, read_dcp_metadata
    from .state import _ROLE

    t0 = time.perf_counter()
    # untrusted input: .metadata is unpickled only through dcp_safe's allow-list (DCP's own
    # reader runs plain pickle.load on it) and validated; FormatError otherwise
    meta = read_dcp_metadata(dcp_dir)
    paths = _dcp_paths(dcp_dir, meta)
    entries, keymap, byte_keys = [], {}, []
    for key, md in sorted(meta.state_dict_metadata.items()):
        if not isinstance(md, TensorStorageMetadata):
            byte_keys.append(key)
            continue
        path = paths[key]
        role, name = (path[0], ".".join(map(str, path[1:]))) if len(path) > 1 and _ROLE.match(path[0]) \
            else ("other", key)
        why = name_problem(name)
        if why:
            raise StateDictError(f"{dcp_dir}: key {key!r} cannot be imported: {why}")
        if (role, name) in keymap:
            raise StateDictError(f"{dcp_dir}: keys {keymap[(role, name)]!r} and {key!r} both map to tensor {name!r} "
                                 f"of role {role}")
        entries.append((role, name, dtype_name(md.properties.dtype), tuple(md.size)))
        keymap[(role, name)] = key
    _check_dcp_claims(dcp_dir, meta, {keymap[(e[0], e[1])]: e for e in entries})
    state, skipped = _dcp_json_state(dcp_dir, meta, byte_keys, paths)
    w = _Writer(dst, overwrite)
    total = sum(math.prod(e[3]) * itemsize(e[2]) for e in entries)
    done = 0
    try:
        for role, name, dt, shape, _ in w.layout(entries, None):
            x = torch.empty(shape, dtype=torch_dtype(dt))
            # tensor entries only here: DCP's planner unpickles bytes entries with weights_only=False
            _dcp_load(dcp_dir, {keymap[(role, name)]: x}, SafeFileSystemReader(dcp_dir, metadata=meta), None,
                      f"tensor {keymap[(role, name)]!r}")
            w.write(role, name, x)
            done += x.numel() * x.element_size()
            if progress:
                progress(done, total)
        path = w.commit(step=None, state=state, extra={"converted_from_dcp": os.path.abspath(os.fspath(dcp_dir)),
                                                       "skipped_non_tensors": skipped},
                        strategy={"source": "torch.distributed.checkpoint"})
    except BaseException:
        w.abort()
        raise
    secs = time.perf_counter() - t0
    if skipped:
        log.warning("convert: skipped %d non-tensor entries that are not JSON values: %s", len(skipped), skipped[:10])
    return {"path": path, "tensors": len(entries), "bytes": total, "seconds": secs, "skipped": skipped,
            "gbps": gbps(total, secs)}


_DCP_PATH_MAX = 64  # components of one key path


def _dcp_paths(dcp_dir, meta) -> dict[str, tuple]:
    """``fqn -> path`` from the metadata's ``planner_data`` (DCP's default planner: the key
    paths its flattening made), validated: a non-empty tuple of str/int whose dotted join is
    the key. Keys it does not map (or no planner_data: a flat state dict) are their own path."""
    pd = getattr(meta, "planner_data", None)
    if pd is None:
        pd = {}
    if not isinstance(pd, dict):
        raise FormatError(f"{dcp_dir}: planner_data is a {type(pd).__name__}, not a dict of key paths")
    out = {}
    for key in meta.state_dict_metadata:
        p = pd.get(key)
        if p is None:
            out[key] = (key,)
            continue
        if (type(p) not in (tuple, list) or not 0 < len(p) <= _DCP_PATH_MAX
                or not all(type(c) is str or (type(c) is int and 0 <= c < (1 << 20)) for c in p)
                or type(p[0]) is not str or ".".join(map(str, p)) != key):
            raise FormatError(f"{dcp_dir}: planner_data maps key {key[:80]!r} to {str(p)[:80]}, not its path "
                              "(components of str/int joined by '.')")
        out[key] = tuple(p)
    return out


def _dcp_load(dcp_dir, state: dict, reader, planner, what: str) -> None:
    """``dcp.load`` in this process; DCP's wrapped failure becomes the reader's typed error."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)
    except CheckpointException as e:  # a BaseException: unwrap what the reader raised
        inner = next((exc for exc, _ in e.failures.values()), None)
        if isinstance(inner, UnickptError):
            raise inner from None
        raise FormatError(f"{dcp_dir}: cannot read {what} ({type(inner).__name__}: {inner})") from None


def _dcp_json_state(dcp_dir, meta, keys: list[str], paths: dict[str, tuple]) -> tuple[dict, list[str]]:
    """The JSON values among DCP's bytes entries ``keys``, nested at their paths, and
    ``"key: reason"`` for the others. Each entry is read through the confined reader and
    unpickled with ``torch.load(weights_only=True)`` (torch's restricted unpickler) only."""
    import io

    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from .dcp_safe import SafeFileSystemReader
    from .state import is_state_value, set_json_path, to_json

    if not keys:
        return {}, []
    values: dict[str, object] = {}
    skipped: dict[str, str] = {}

    class _WeightsOnly(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:  # never weights_only=False
            k = read_item.dest_index.fqn
            try:
                values[k] = torch.load(value, weights_only=True)
            except Exception as e:  # not loadable by the restricted unpickler: reported, not run
                said = re.sub(r"\x1b\[[0-9;]*[A-Za-z]|[\x00-\x1f\x7f]", " ", str(e))  # (torch's text has terminal colours)
                skipped[k] = f"refused by torch.load(weights_only=True) ({type(e).__name__}: {said[:120]})"

    _dcp_load(dcp_dir, {k: None for k in keys}, SafeFileSystemReader(dcp_dir, metadata=meta),
              _WeightsOnly(flatten_state_dict=False, flatten_sharded_tensors=False), "its non-tensor entries")
    state: dict = {}
    for k in sorted(values):
        v = values[k]
        if not is_state_value(v):
            skipped[k] = f"a {type(v).__name__}, not a JSON value"
            continue
        try:
            set_json_path(state, paths[k], to_json(v, k), FormatError)
        except (FormatError, StateDictError) as e:  # (StateDictError: a key unickpt reserves)
            skipped[k] = str(e)
    return state, [f"{k}: {skipped[k]}" for k in sorted(skipped)]


DCP_RATIO = 1 << 15  # most raw bytes one stored byte may claim under a compressing transform


def _check_dcp_claims(dcp_dir, meta, tensors: dict) -> None:
    """Before anything of the claimed sizes is allocated or created: every storage item lies
    inside a regular file of the DCP directory, and every tensor's claimed bytes are backed by
    its stored items (at most DCP_RATIO times more under a compressing transform)."""
    from .io.localfs import open_regular

    sizes: dict[str, int] = {}
    stored: dict[str, int] = {}
    compressed: set[str] = set()
    for idx, info in (getattr(meta, "storage_data", None) or {}).items():
        rel = info.relative_path
        if rel not in sizes:
            fd, st = open_regular(os.path.join(os.fspath(dcp_dir), rel))
            os.close(fd)
            sizes[rel] = st.st_size
        if info.offset + info.length > sizes[rel]:
            raise FormatError(f"{dcp_dir}: item {idx.fqn!r} claims bytes [{info.offset}, {info.offset + info.length}) "
                              f"of {rel!r}, which has {sizes[rel]} bytes")
        stored[idx.fqn] = stored.get(idx.fqn, 0) + info.length
        if getattr(info, "transform_descriptors", None):
            compressed.add(idx.fqn)
    for key, (_, _, dt, shape) in tensors.items():
        need = math.prod(shape) * itemsize(dt)
        have = stored.get(key, 0) * (DCP_RATIO if key in compressed else 1)
        if need > have:
            raise FormatError(f"{dcp_dir}: tensor {key!r} claims {need} bytes ({dt} {list(shape)}) but its stored "
                              f"items hold {stored.get(key, 0)}")
