"""`unickpt export`: the model part of a checkpoint as a Hugging Face model folder.

Streams tensor by tensor (peak memory: the largest tensor, twice when casting), verifies
every byte it reads against the checkpoint's checksums, writes ``model-0000i-of-0000n``
safetensors shards, ``model.safetensors.index.json``, ``config.json`` (the checkpoint's, or
the one passed as ``config=``) and ``generation_config.json`` (when the checkpoint has one)
into a temporary sibling, and renames it into place: DST appears complete or not at all, and
an existing DST stays intact until the new one is in place.

The folder is what ``save_pretrained`` would write: ``config.json`` names the dtype of the
weights (``dtype`` and ``torch_dtype``, in sub-configs too), and tied weights (an alias in
the manifest, or two equal copies) are written once, under the name ``save_pretrained``
keeps, when the config ties them (``tie_word_embeddings``).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import time
from typing import Any, Callable, Mapping

import torch

from ._metrics import gbps, human_bytes, log
from .errors import CheckpointNotFoundError, FormatError, InvalidArgumentError, StorageError, TensorMissingError
from .format import dtype_name, order_key, torch_dtype
from .io import commit as _commit
from .io.files import open_files, read_side_file
from .io.fileset import FileSet, file_name, pack, split_by_size
from .io.localfs import read_regular
from .io.storage import storage_for
from .loading import read_manifest
from .loading.coded import read_whole
from .manifest import INDEX_NAME, _finite_float, _no_constant


__all__ = ["export_hf"]

DTYPE_NAMES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CONFIG_LIMIT = 1 << 20
GENERATION_CONFIG = "generation_config.json"


def export_hf(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    config: str | os.PathLike | Mapping[str, Any] | Any | None = None,
    max_shard_bytes: int = 5 << 30,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
    mapping: Any = None,
) -> dict:
    """Write the model weights of checkpoint ``src`` as a Hugging Face folder at ``dst``.

    Args:
        dtype: cast every floating-point weight to it (``torch.bfloat16``,
            ``torch.float16``, ``torch.float32``); None keeps the stored dtypes.
            ``config.json`` names the weights' dtype either way, so ``from_pretrained``
            loads them as they are.
        config: the ``config.json`` to write, for checkpoints saved without one (or to
            replace theirs): a path to the file (or to a folder holding it), a dict, or a
            transformers config or model.
        max_shard_bytes: cut the weights into files of at most this size (a larger tensor
            gets a file of its own).
        overwrite: replace a folder already at ``dst``.
        progress: called with (bytes written, total bytes) after each tensor.
        mapping: write the tensors this :class:`~unickpt.Mapping` makes from the stored ones
            (:meth:`Mapping.targets`), e.g. ``Mapping.hf_from_torchtitan(config)`` for a
            torchtitan checkpoint; each is read from only the byte ranges it needs, verified,
            a batch of at most 256 MiB at a time.

    Returns figures: ``{"path", "files", "tensors", "bytes", "seconds", "gbps"}``.

    Example::

        export_hf("ckpt/step-00001000", "hf-model", dtype=torch.bfloat16)
        AutoModelForCausalLM.from_pretrained("hf-model")   # bf16 parameters
    """
    t0 = time.perf_counter()
    from .mapping import Mapping as _Mapping

    if mapping is not None and not isinstance(mapping, _Mapping):
        raise InvalidArgumentError(f"mapping must be a unickpt.Mapping or None, got {type(mapping).__name__}")
    if dtype is not None and dtype not in DTYPE_NAMES.values():
        raise InvalidArgumentError(f"export dtype must be one of torch.bfloat16, torch.float16, torch.float32, got {dtype!r}")
    given = _given_config(config)  # before anything is opened: a bad argument is the caller's to fix
    ckpt, man = read_manifest(src)
    src_storage, _ = storage_for(ckpt)  # the source and the destination may be on different stores
    storage, final = storage_for(dst)
    readers: dict = {}
    try:
        conf = given if given is not None else _aux_json(src_storage, ckpt, man, "config.json")
        gen = _aux_bytes(src_storage, ckpt, man, GENERATION_CONFIG)  # copied as it is, once checked
        # name written -> (shape, stored dtype), and how to read them
        if mapping is None:
            items, read = _plain_source(src_storage, ckpt, man, conf, readers)
        else:
            items, read = _mapped_source(src_storage, ckpt, man, conf, readers, mapping)
        out_dtype = {n: _out_dtype(dt, dtype) for n, (_, dt) in items.items()}
        if conf is not None:
            _set_dtype(conf, out_dtype)
        txn = _commit.Transaction(storage, final, overwrite=overwrite, folder=True)
        txn.begin()
    except BaseException:
        for r in readers.values():
            r.close()
        storage.close()
        raise
    try:
        shards, total = _write_shards(txn, storage, items, read, out_dtype, max_shard_bytes, progress)
        if conf is not None:
            txn.put("config.json", (json.dumps(conf, indent=2, sort_keys=True) + "\n").encode())
        if gen is not None:
            txn.put(GENERATION_CONFIG, gen)
        txn.commit()
    except BaseException:
        txn.abort()
        raise
    finally:
        for r in readers.values():
            r.close()
        storage.close()
    secs = time.perf_counter() - t0
    log.info("exported %d tensors (%s) from %s to %s in %.2f s (%.2f GB/s)", len(items), human_bytes(total), ckpt, final,
             secs, gbps(total, secs))
    return {"path": final, "files": shards, "tensors": len(items), "bytes": total, "seconds": secs, "gbps": gbps(total, secs)}


def _out_dtype(stored: str, dtype: torch.dtype | None) -> str:
    """What a tensor is written as: ``dtype`` for floating-point weights (integer and bool
    buffers keep theirs, as ``model.to(dtype)`` leaves them)."""
    return dtype_name(dtype) if dtype is not None and torch_dtype(stored).is_floating_point else stored


def _plain_source(storage, ckpt: str, man, conf, readers: dict):
    """The model role's tensors under their own names (tied ones once, as ``save_pretrained``
    writes them): ``({name: (shape, dtype)}, read)``; ``read(names)`` yields ``(name,
    tensor)`` in that order, each verified."""
    source = _names(ckpt, man)  # name written -> stored tensor holding its values
    # the source files are checked (regular, of the recorded size, headers intact) before
    # anything of the claimed size is created
    open_files(storage, ckpt, man, {man.tensors[("model", s)].file for s in source.values()}, readers)
    source = _drop_tied(storage, ckpt, man, source, _tied_keys(conf, source), readers)
    items = {n: (tuple(man.tensors[("model", s)].shape), man.tensors[("model", s)].dtype) for n, s in source.items()}

    def read(names):
        for n in names:
            yield n, read_whole(storage, ckpt, man, "model", source[n], readers)

    return items, read


MAPPED_BATCH = 256 << 20


def _mapped_source(storage, ckpt: str, man, conf, readers: dict, mapping):
    """:func:`_plain_source` through ``mapping``: its targets, read by the load plan (only the
    boxes each needs, verified) in batches of at most :data:`MAPPED_BATCH` bytes. Tied targets
    that are each one whole stored tensor are written once, as without a mapping."""
    from .loading import LoadOptions, load
    from .mapping import mapped_targets
    from .transport import LOCAL

    names = _names(ckpt, man)
    stored = {n: man.tensors[("model", s)] for n, s in names.items()}
    planned = mapped_targets(mapping, stored, ckpt)
    items = {t: (m.shape, m.dtype) for t, m in planned.items()}
    whole = {t: names[m.whole] for t, m in planned.items() if m.whole is not None}
    files = {stored[s].file for m in planned.values() for s in m.sources}
    open_files(storage, ckpt, man, files, readers)
    ties = {a: b for a, b in _tied_keys(conf, planned).items() if a in whole and b in whole}
    kept = _drop_tied(storage, ckpt, man, whole, ties, readers)
    items = {t: v for t, v in items.items() if t in kept or t not in whole}

    def read(order):
        batch: list[str] = []
        size = 0
        for n in [*order, None]:
            nb = 0 if n is None else math.prod(items[n][0]) * torch_dtype(items[n][1]).itemsize
            if batch and (n is None or size + nb > MAPPED_BATCH):  # (a batch: <= MAPPED_BATCH, or one tensor)
                got = {b: torch.empty(items[b][0], dtype=torch_dtype(items[b][1])) for b in batch}
                load({"model": got}, ckpt, group=LOCAL, options=LoadOptions(mapping=mapping))
                for b in batch:
                    yield b, got.pop(b)
                batch, size = [], 0
            if n is not None:
                batch.append(n)
                size += nb

    return items, read


def _write_shards(txn, storage, items: dict, read, out_dtype: dict[str, str], max_shard_bytes: int,
                  progress) -> tuple[int, int]:
    """The safetensors shards and the index into the transaction's folder: (files, bytes)."""
    nbytes = {n: math.prod(shape) * torch_dtype(out_dtype[n]).itemsize for n, (shape, _) in items.items()}
    # shards: tensors in safetensors order, cut at max_shard_bytes
    shards = split_by_size(sorted(items, key=lambda n: order_key(out_dtype[n], n)), nbytes.__getitem__, max_shard_bytes)
    total = sum(nbytes.values())
    done = 0
    weight_map = {}
    out = FileSet(storage, txn.tmp)
    for i, names in enumerate(shards, start=1):
        fname = file_name("model", i, len(shards))
        header, stored = pack(((n, out_dtype[n], items[n][0], n) for n in names), {"format": "pt"})
        fsize = len(header) + sum(nbytes[n] for n in names)
        out.create(fname, fsize)
        try:
            out.open(fname, fname, fsize, header=header)
            infos = {n: info for n, _, _, _, info in stored}
            for n, x in read([n for n, _, _, _, _ in stored]):
                info = infos[n]
                if x.dtype != torch_dtype(out_dtype[n]):
                    x = x.to(torch_dtype(out_dtype[n]))
                data = x.reshape(-1).view(torch.uint8) if x.numel() else torch.empty(0, dtype=torch.uint8)
                out.write(fname, info.begin, memoryview(data.numpy()))
                weight_map[n] = fname
                done += nbytes[n]
                if progress is not None:
                    progress(done, total)
            _, _, frags = out.close()
        except BaseException:
            out.abort()
            raise
        out.finish(fname, [(off, data) for _, off, data in frags], fsize)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    txn.put(INDEX_NAME, json.dumps(index, indent=2).encode())
    return len(shards), total


def _names(ckpt: str, man) -> dict[str, str]:
    """Every name of the model role (stored tensors and their aliases) -> the stored tensor
    holding its values."""
    per_rank = {n for r, n in getattr(man, "per_rank", ()) if r == "model"}
    for n in sorted(per_rank):  # one row per saving rank: not a weight of the model
        log.warning("%s: model tensor %r is stored per rank (unickpt.per_rank); not exported", ckpt, n)
    out = {n: n for (r, n) in man.tensors if r == "model" and n not in per_rank}
    for (r, n), target in getattr(man, "aliases", {}).items():
        if r == "model" and target not in per_rank:
            if ("model", target) not in man.tensors:  # (the manifest parser refuses this already)
                raise FormatError(f"{ckpt}: alias {n!r} of role model points to {target!r}, which is not stored")
            out[n] = target
    if not out:
        raise TensorMissingError(f"{ckpt}: no model tensors to export (the checkpoint has no role 'model')")
    return dict(sorted(out.items()))


def _tied_keys(conf: dict | None, names) -> dict[str, str]:
    """``{target: source}`` of the weights the config ties, as the installed transformers
    expands its model class's ``_tied_weights_keys`` (empty when the config does not tie,
    transformers is not installed, or the architecture is not one of its classes)."""
    if not conf or conf.get("tie_word_embeddings") is False:
        return {}
    arch = conf.get("architectures")
    if not (isinstance(arch, list) and arch and isinstance(arch[0], str)):
        return {}
    try:
        import transformers
    except ImportError:
        log.info("transformers is not installed: tied weights are exported under every name")
        return {}
    try:
        cls = getattr(transformers, arch[0], None)
    except Exception:  # (transformers' lazy module imports what the name maps to)
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        return {}
    try:
        tie = getattr(cls.config_class.from_dict(dict(conf)), "tie_word_embeddings", False)
    except Exception as e:  # transformers cannot read it: it cannot load the folder either
        log.warning("config.json: transformers cannot read it as a %s (%s); tied weights are exported under every name",
                    cls.config_class.__name__, e)
        return {}
    mapping = getattr(cls, "_tied_weights_keys", None)
    if not tie or not isinstance(mapping, dict):
        return {}
    if all(_PLAIN.match(k) for k in mapping.keys() | mapping.values()):  # the common case: names
        return dict(mapping)
    names = sorted(names)  # patterns: expanded against the checkpoint's names
    out: dict[str, str] = {}
    for target, src in mapping.items():
        sources = [n for n in names if re.search("^" + src, n)]
        targets = [n for n in names if re.search("^" + target, n)]
        if not sources or not targets or len(targets) % len(sources):
            continue
        for t, s in zip(targets, itertools.cycle(sources)):
            out[t] = out.get(s, s)
    return out


# PreTrainedModel.get_expanded_tied_weights_keys: a mapping of these needs no expansion
_PLAIN = re.compile(r"^[A-Za-z0-9_\.]+(weight)|(bias)$")


def _drop_tied(storage, ckpt: str, man, source: dict[str, str], ties: dict[str, str], readers: dict) -> dict[str, str]:
    """Without the tied targets whose values are their source's: one copy, under the name
    ``save_pretrained`` keeps (a pair stored with different values keeps both, as transformers
    then does not tie them)."""
    out = dict(source)
    for target, src in sorted(ties.items()):
        if target not in out or src not in out:
            continue  # one name only: written as it is (from_pretrained ties either way round)
        a, b = out[target], out[src]
        if a != b:
            ta, tb = man.tensors[("model", a)], man.tensors[("model", b)]
            same = ta.dtype == tb.dtype and ta.shape == tb.shape and torch.equal(
                read_whole(storage, ckpt, man, "model", a, readers), read_whole(storage, ckpt, man, "model", b, readers))
            if not same:
                log.warning("%s: the config ties %s to %s but the checkpoint holds different values; both are exported "
                            "(transformers will not tie them)", ckpt, target, src)
                continue
        del out[target]
    return out


_TORCH_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
                      torch.float64: "float64"}


def _set_dtype(conf: dict, out_dtype: dict[str, str]) -> None:
    """Name the weights' dtype in every key transformers reads it from (``dtype``, and
    ``torch_dtype`` for transformers 4), in sub-configs too, as ``save_pretrained`` records
    the model's dtype. Nothing changes when the floating weights do not share one dtype."""
    floating = {torch_dtype(d) for d in out_dtype.values() if torch_dtype(d).is_floating_point}
    if len(floating) != 1 or next(iter(floating)) not in _TORCH_DTYPE_NAMES:
        return
    name = _TORCH_DTYPE_NAMES[floating.pop()]

    def visit(d: dict, top: bool) -> None:
        if top or "model_type" in d:  # a (sub-)config
            d["dtype"] = d["torch_dtype"] = name
        for v in d.values():
            if isinstance(v, dict):
                visit(v, False)

    visit(conf, True)


def _parse_json(data: bytes, where: str) -> dict:
    try:
        obj = json.loads(data.decode("utf-8"), parse_constant=_no_constant, parse_float=_finite_float)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FormatError(f"{where}: not valid JSON ({type(e).__name__}: {str(e)[:120]})") from None
    if not isinstance(obj, dict):
        raise FormatError(f"{where}: must hold a JSON object, not {type(obj).__name__}")
    return obj


def _aux_json(storage, ckpt: str, man, name: str) -> dict | None:
    """The checkpoint's JSON side file ``name`` (a regular file, checked against the
    manifest's checksum from format 2 on) as a JSON object; None if there is none."""
    data = _aux_bytes(storage, ckpt, man, name)
    return None if data is None else _parse_json(data, storage.join(ckpt, name))


def _aux_bytes(storage, ckpt: str, man, name: str) -> bytes | None:
    """The bytes of :func:`_aux_json`'s file, checked (a JSON object)."""
    path = storage.join(ckpt, name)
    if name in man.aux:
        data = read_side_file(storage, ckpt, man, name, CONFIG_LIMIT)
    elif not storage.exists(path):
        return None
    elif man.format_version >= 2:
        raise FormatError(f"{path}: not part of the checkpoint (the manifest does not list it); pass it with "
                          f"save(..., extra_files={{'{name}': ...}}) or remove it")
    else:
        data = storage.read_bytes(path, CONFIG_LIMIT)
        log.warning("%s: format %d checkpoints do not checksum %s; copied unverified", path, man.format_version, name)
    _parse_json(data, path)
    return data


def _given_config(config) -> dict | None:
    """``config=`` of :func:`export_hf` as a JSON object (a fresh copy)."""
    if config is None:
        return None
    from .hf import hf_extra_files, is_hf_config, is_hf_model

    if is_hf_config(config) or is_hf_model(config):
        return _parse_json(hf_extra_files(config)["config.json"].encode(), "config")
    if isinstance(config, Mapping):
        try:
            data = json.dumps(dict(config), allow_nan=False).encode()
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(f"config: the dict must be JSON-serialisable (no NaN or Infinity): {e}") from None
        return _parse_json(data, "config")
    if not isinstance(config, (str, os.PathLike)):
        raise InvalidArgumentError(f"config must be a path to a config.json, a dict or a transformers config, "
                                   f"got {type(config).__name__}")
    path = os.fspath(config)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:  # (a FIFO or device is refused at once, never waited on)
        data = read_regular(path, CONFIG_LIMIT, follow=True)
    except (CheckpointNotFoundError, StorageError) as e:
        raise InvalidArgumentError(f"config {path}: cannot read it ({e})") from None
    return _parse_json(data, path)
