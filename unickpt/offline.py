"""Offline, single-process tools that stream a checkpoint tensor by tensor (peak memory: the
largest tensor plus I/O buffers): ``unickpt reshard`` (rewrite with other files or without
some roles) and ``unickpt convert --from-dcp`` (import a torch.distributed.checkpoint).

Both write a new unickpt checkpoint into a temporary sibling with fresh checksums and
commit it atomically; the destination is never left half-written, and an existing one stays
intact until the new one is in place.
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import time
from typing import Any, Callable

import torch

from . import __version__
from . import commit as _commit
from ._metrics import gbps, human_bytes, log
from .errors import FormatError, StateDictError
from .format import Hasher, build_header, dtype_name, itemsize, order_key, torch_dtype
from .loader import read_manifest, read_whole
from .manifest import INDEX_NAME, MANIFEST_NAME, FileEntry, Manifest, TensorEntry
from .storage import storage_for
from .transport import node_id

__all__ = ["reshard_offline", "convert_from_dcp"]

Progress = Callable[[int, int], None] | None


class _Writer:
    """A new checkpoint written tensor by tensor, committed at the end."""

    def __init__(self, dst, overwrite: bool) -> None:
        self.storage, self.final = storage_for(dst)
        _commit.require_parent(self.storage, self.final)
        _commit.check_destination(self.storage, self.final, overwrite)
        parent, name = self.storage.parent(self.final), self.storage.basename(self.final)
        _commit.sweep_stale(self.storage, parent, name)
        self.tmp = self.storage.join(parent, _commit.tmp_name(name, _commit.new_token()))
        self.storage.makedirs(self.tmp)
        self.where: dict[tuple[str, str], tuple[str, Any]] = {}
        self.files: dict[str, tuple[str, bytes, int]] = {}  # name -> (role, header, size)
        self.writers: dict = {}
        self.sums: dict[tuple[str, str], str] = {}

    def layout(self, entries: list[tuple[str, str, str, tuple[int, ...]]], max_file_bytes: int | None) -> list:
        """Assign files; returns the entries in write order."""
        order = []
        for role in sorted({e[0] for e in entries}):
            mine = sorted((e for e in entries if e[0] == role), key=lambda e: order_key(e[2], e[1]))
            parts, cur, size = [], [], 0
            for e in mine:
                n = math.prod(e[3]) * itemsize(e[2])
                if cur and max_file_bytes and size + n > max_file_bytes:
                    parts.append(cur)
                    cur, size = [], 0
                cur.append(e)
                size += n
            parts.append(cur)
            for i, part in enumerate(parts, start=1):
                fname = f"{role}-{i:05d}-of-{len(parts):05d}.safetensors"
                header, infos = build_header(((e[1], e[2], e[3]) for e in part), {"format": "pt", "unickpt_role": role})
                size = len(header) + sum(info.nbytes for info in infos)
                self.files[fname] = (role, header, size)
                path = self.storage.join(self.tmp, fname)
                self.storage.create_file(path, size)
                w = self.writers[fname] = self.storage.open_writer(path)
                w.write_at(0, memoryview(header))
                for e, info in zip(part, infos):
                    self.where[(e[0], e[1])] = (fname, info)
                    order.append(e)
        return order

    def write(self, role: str, name: str, x: torch.Tensor) -> None:
        fname, info = self.where[(role, name)]
        header = self.files[fname][1]
        if x.numel():
            data = x.contiguous().reshape(-1).view(torch.uint8)
            mv = memoryview(data.numpy())
            self.sums[(role, name)] = Hasher.of(mv)
            self.writers[fname].write_at(len(header) + info.begin, mv)

    def commit(self, *, step, state, extra, strategy: dict) -> str:
        for fname, w in self.writers.items():
            frags = w.close()
            self.storage.finish_file(self.storage.join(self.tmp, fname), frags, self.files[fname][2])
        self.writers.clear()
        tensors = {}
        for (role, name), (fname, info) in self.where.items():
            ranges = ((0, info.nbytes, self.sums[(role, name)]),) if info.nbytes else ()
            tensors[(role, name)] = TensorEntry(role, name, fname, info.dtype, info.shape, info.begin, info.end, ranges, "raw", 0)
        files = {n: FileEntry(n, role, node_id(), 0, size, len(header)) for n, (role, header, size) in self.files.items()}
        man = Manifest(
            step=step, files=files, tensors=tensors, state=state, extra=extra,
            saved_by={"world_size": 1, "nodes": [node_id()], "strategy": strategy, "unickpt_version": __version__,
                      "torch_version": torch.__version__.split("+")[0]},
            created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        )
        idx = man.hf_index()
        if idx is not None:
            self.storage.write_bytes(self.storage.join(self.tmp, INDEX_NAME), idx)
        self.storage.write_bytes(self.storage.join(self.tmp, MANIFEST_NAME), man.to_json())
        _commit.publish(self.storage, self.tmp, self.final)
        self.storage.close()
        return self.final

    def abort(self) -> None:
        for w in self.writers.values():
            w.abort()
        self.storage.close()
        self.storage.remove_tree(self.tmp)


def reshard_offline(
    src, dst, *, drop_optimizer: bool = False, master: str = "full", quant: str = "O0",
    max_file_bytes: int | None = None, zstd: int | None = None, overwrite: bool = False, progress: Progress = None,
) -> dict:
    """Rewrite checkpoint ``src`` at ``dst``: other file sizes, without the optimizer
    (``drop_optimizer``) or the master weights (``master="drop"``); fresh checksums."""
    if quant != "O0" or master == "residual" or zstd:
        raise NotImplementedError("quantized, residual-master and zstd output need the compression issue; use quant O0, master full|drop")
    if master not in ("full", "drop"):
        raise ValueError(f"master must be full, residual or drop, got {master!r}")
    t0 = time.perf_counter()
    ckpt, man = read_manifest(src)
    keep = [t for t in man.tensors.values()
            if not (drop_optimizer and t.role == "optimizer") and not (master == "drop" and t.role == "master")]
    entries = [(t.role, t.name, t.dtype, t.shape) for t in keep]
    w = _Writer(dst, overwrite)
    readers: dict = {}
    total, done = sum(t.nbytes for t in keep), 0
    try:
        for role, name, _, _ in w.layout(entries, max_file_bytes):
            w.write(role, name, read_whole(w.storage, ckpt, man, role, name, readers))
            done += man.tensors[(role, name)].nbytes
            if progress:
                progress(done, total)
        strategy = dict(man.saved_by.get("strategy") or {}, resharded_from=ckpt)
        path = w.commit(step=man.step, state=man.state, extra=man.extra, strategy=strategy)
    except BaseException:
        w.abort()
        raise
    finally:
        for r in readers.values():
            r.close()
    secs = time.perf_counter() - t0
    log.info("resharded %s -> %s: %d tensors, %s in %.2f s", ckpt, path, len(keep), human_bytes(total), secs)
    return {"path": path, "tensors": len(keep), "bytes": total, "seconds": secs, "gbps": gbps(total, secs)}


def convert_from_dcp(dcp_dir, dst, *, overwrite: bool = False, progress: Progress = None) -> dict:
    """Import a torch.distributed.checkpoint directory, one tensor at a time. Keys
    ``role.rest`` whose first component is a valid role name keep it as the role; others go to
    role ``other``. Non-tensor entries (pickled objects in DCP) are skipped and listed."""
    import re

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    t0 = time.perf_counter()
    reader = FileSystemReader(os.fspath(dcp_dir))
    try:
        meta = reader.read_metadata()
    except Exception as e:
        raise FormatError(f"{dcp_dir}: not a torch.distributed.checkpoint directory ({type(e).__name__}: {e})") from None
    role_re = re.compile(r"[a-z][a-z0-9_]{0,31}")
    entries, skipped, keymap = [], [], {}
    for key, md in sorted(meta.state_dict_metadata.items()):
        if not isinstance(md, TensorStorageMetadata):
            skipped.append(key)
            continue
        head, _, rest = key.partition(".")
        role, name = (head, rest) if rest and role_re.fullmatch(head) else ("other", key)
        if name == "__metadata__":
            raise StateDictError(f"{dcp_dir}: key {key!r} maps to a reserved tensor name")
        entries.append((role, name, dtype_name(md.properties.dtype), tuple(md.size)))
        keymap[(role, name)] = key
    w = _Writer(dst, overwrite)
    total = sum(math.prod(e[3]) * itemsize(e[2]) for e in entries)
    done = 0
    try:
        for role, name, dt, shape in w.layout(entries, None):
            x = torch.empty(shape, dtype=torch_dtype(dt))
            dcp.load({keymap[(role, name)]: x}, storage_reader=FileSystemReader(os.fspath(dcp_dir)), no_dist=True)
            w.write(role, name, x)
            done += x.numel() * x.element_size()
            if progress:
                progress(done, total)
        path = w.commit(step=None, state={}, extra={"converted_from_dcp": os.path.abspath(os.fspath(dcp_dir)), "skipped_non_tensors": skipped},
                        strategy={"source": "torch.distributed.checkpoint"})
    except BaseException:
        w.abort()
        raise
    secs = time.perf_counter() - t0
    if skipped:
        log.warning("convert: skipped %d non-tensor entries (DCP pickles them): %s", len(skipped), skipped[:10])
    return {"path": path, "tensors": len(entries), "bytes": total, "seconds": secs, "skipped": skipped, "gbps": gbps(total, secs)}
