"""`unickpt export`: the model part of a checkpoint as a Hugging Face model folder.

Streams tensor by tensor (peak memory: the largest tensor, twice when casting), verifies
every byte it reads against the checkpoint's checksums, writes ``model-0000i-of-0000n``
safetensors shards, ``model.safetensors.index.json`` and ``config.json`` (when the
checkpoint has one) into a temporary sibling, and renames it into place: DST appears
complete or not at all, and an existing DST stays intact until the new one is in place.
"""

from __future__ import annotations

import json
import os
import time
from typing import Callable

import torch

from . import commit as _commit
from ._metrics import gbps, human_bytes, log
from .errors import CheckpointNotFoundError, ChecksumError, FormatError, TensorMissingError
from .format import Hasher, build_header, dtype_name, order_key, torch_dtype
from .loader import open_files, read_manifest, read_whole
from .manifest import INDEX_NAME, _finite_float, _no_constant
from .storage import storage_for

__all__ = ["export_hf"]

DTYPE_NAMES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def export_hf(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 << 30,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Write the model weights of checkpoint ``src`` as a Hugging Face folder at ``dst``.

    Returns figures: ``{"path", "files", "tensors", "bytes", "seconds", "gbps"}``.
    """
    t0 = time.perf_counter()
    ckpt, man = read_manifest(src)
    src_storage, _ = storage_for(ckpt)  # the source and the destination may be on different stores
    storage, final = storage_for(dst)
    model = sorted((n for (r, n) in man.tensors if r == "model"))
    if not model:
        raise TensorMissingError(f"{ckpt}: no model tensors to export")
    readers: dict = {}
    # the source files are checked (regular, of the recorded size, headers intact) before
    # anything of the claimed size is created
    open_files(src_storage, ckpt, man, {man.tensors[("model", n)].file for n in model}, readers)
    try:
        conf = _config(src_storage, ckpt, man, dtype)
        txn = _commit.Transaction(storage, final, overwrite=overwrite, folder=True)
        txn.begin()
    except BaseException:
        for r in readers.values():
            r.close()
        raise
    tmp = txn.tmp
    out_dtype = {n: dtype_name(dtype) if dtype is not None else man.tensors[("model", n)].dtype for n in model}
    nbytes = {n: man.tensors[("model", n)].numel * torch_dtype(out_dtype[n]).itemsize for n in model}
    # shards: tensors in safetensors order, cut at max_shard_bytes
    order = sorted(model, key=lambda n: order_key(out_dtype[n], n))
    shards: list[list[str]] = [[]]
    size = 0
    for n in order:
        if shards[-1] and size + nbytes[n] > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += nbytes[n]
    total = sum(nbytes.values())
    done = 0
    try:
        weight_map = {}
        for i, names in enumerate(shards, start=1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            header, infos = build_header(
                ((n, out_dtype[n], man.tensors[("model", n)].shape) for n in names), {"format": "pt"}
            )
            path = storage.join(tmp, fname)
            storage.create_file(path, len(header) + sum(nbytes[n] for n in names))
            w = storage.open_writer(path, size=len(header) + sum(nbytes[n] for n in names))
            try:
                w.write_at(0, memoryview(header))
                for n, info in zip(names, infos):
                    x = read_whole(src_storage, ckpt, man, "model", n, readers)
                    if x.dtype != torch_dtype(out_dtype[n]):
                        x = x.to(torch_dtype(out_dtype[n]))
                    data = x.reshape(-1).view(torch.uint8) if x.numel() else torch.empty(0, dtype=torch.uint8)
                    w.write_at(len(header) + info.begin, memoryview(data.numpy()))
                    weight_map[n] = fname
                    done += nbytes[n]
                    if progress is not None:
                        progress(done, total)
                frags = w.close()
            except BaseException:
                w.abort()
                raise
            storage.finish_file(path, frags, len(header) + sum(nbytes[n] for n in names))
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        txn.put(INDEX_NAME, json.dumps(index, indent=2).encode())
        if conf is not None:
            txn.put("config.json", json.dumps(conf, indent=2).encode())
        txn.commit()
    except BaseException:
        txn.abort()
        raise
    finally:
        for r in readers.values():
            r.close()
        storage.close()
    secs = time.perf_counter() - t0
    log.info("exported %d tensors (%s) from %s to %s in %.2f s (%.2f GB/s)", len(model), human_bytes(total), ckpt, final, secs, gbps(total, secs))
    return {"path": final, "files": len(shards), "tensors": len(model), "bytes": total, "seconds": secs, "gbps": gbps(total, secs)}


CONFIG_LIMIT = 1 << 20


def _config(storage, ckpt: str, man, dtype) -> dict | None:
    """The checkpoint's ``config.json`` (a regular file, checked against the manifest's
    checksum from format 2 on), with ``torch_dtype`` updated; None if there is none."""
    path = storage.join(ckpt, "config.json")
    listed = man.aux.get("config.json")
    if not storage.exists(path):
        if listed is not None:
            raise CheckpointNotFoundError(f"{path}: listed in the manifest but missing")
        return None
    data = storage.read_bytes(path, CONFIG_LIMIT)
    if listed is not None:
        if (len(data), Hasher.of(data)) != tuple(listed):
            raise ChecksumError(f"{path}: does not match the size and checksum the manifest records", [("config.json", "")])
    elif man.format_version >= 2:
        raise FormatError(f"{path}: not part of the checkpoint (the manifest does not list it); pass it with "
                          "save(..., extra_files={'config.json': ...}) or remove it")
    else:
        log.warning("%s: format %d checkpoints do not checksum config.json; copied unverified", path, man.format_version)
    try:
        conf = json.loads(data.decode("utf-8"), parse_constant=_no_constant, parse_float=_finite_float)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FormatError(f"{path}: not valid JSON ({type(e).__name__}: {str(e)[:120]})") from None
    if not isinstance(conf, dict):
        raise FormatError(f"{path}: must hold a JSON object, not {type(conf).__name__}")
    if dtype is not None:
        conf["torch_dtype"] = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[dtype]
    return conf

