"""Loading the model part of a checkpoint for inference: whole or tensor-parallel sliced,
reading model bytes only (never optimizer or master files)."""

from __future__ import annotations

import fnmatch
import os
import re
import warnings
from typing import Any, Callable, Iterable

import torch

from ._metrics import log
from .errors import InvalidArgumentError, LayoutError, TensorMissingError
from .format import torch_dtype
from .io.files import open_files
from .io.storage import storage_for
from .layout import Layout, ShardedTensor
from .loading import LoadOptions, load, read_manifest
from .mapping import Mapping, mapped_targets
from .transport import LOCAL


__all__ = ["load_for_inference", "llama_tp_dim"]

_COLUMN = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight$")
_ROW = re.compile(r"\.(o_proj|down_proj)\.weight$")


def llama_tp_dim(name: str, shape: tuple[int, ...]) -> int | None:
    """Megatron rules for Llama names: q/k/v/gate/up split rows (dim 0), o/down split columns
    (dim 1); everything else (embeddings, norms, lm_head) is replicated."""
    if _COLUMN.search(name):
        return 0
    if _ROW.search(name):
        return 1
    return None


def load_for_inference(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    tp_rank: int | None = None,
    tp_size: int | None = None,
    keys: Iterable[str] | None = None,
    tp_dim: Callable[[str, tuple[int, ...]], int | None] = llama_tp_dim,
    options: LoadOptions | None = None,
    **deprecated: Any,
) -> dict[str, torch.Tensor]:
    """The model weights of the checkpoint at ``path`` (a checkpoint or a root of ``step-*``).

    Args:
        dtype: cast to this dtype (default: as stored).
        device: where the returned tensors live.
        tp_rank, tp_size: return this rank's tensor-parallel blocks, split by ``tp_dim``
            (default: Megatron rules for Llama names); replicated tensors come whole.
        keys: names or shell-style patterns (``"model.layers.0.*"``) to load; default all
            (per-rank values saved with ``unickpt.per_rank`` are not weights: never returned).
        options: a :class:`~unickpt.LoadOptions` for the rare knobs: ``storage_options`` (a
            URL ``path``'s file system, docs/storage.md), ``verify``, and ``mapping``: return
            the tensors that :class:`~unickpt.Mapping` makes from the stored ones
            (:meth:`Mapping.targets`: e.g. ``Mapping.fused(config, tp_rank=, tp_size=)``, the
            fused serving layout of one TP rank, or ``Mapping.hf_from_torchtitan(config)``),
            each read from only the byte ranges it needs; ``keys`` then name its targets. The
            mapping cuts TP shards itself: not with ``tp_rank``/``tp_size``.

    Works in one process whether or not torch.distributed is initialised (no collective).
    ``storage_options=`` beside ``options`` is deprecated (a warning; pass it in ``options``).
    """
    if deprecated:
        if set(deprecated) != {"storage_options"} or options is not None:
            raise InvalidArgumentError(f"load_for_inference: unexpected argument(s) {sorted(deprecated)}: the rare "
                                       "knobs (storage_options, mapping, verify) go in options=unickpt.LoadOptions(...)")
        warnings.warn("load_for_inference(storage_options=...) is deprecated: pass "
                      "options=unickpt.LoadOptions(storage_options=...)", DeprecationWarning, stacklevel=2)
        options = LoadOptions(storage_options=deprecated["storage_options"])
    if options is None:
        options = LoadOptions()
    if not isinstance(options, LoadOptions):
        raise InvalidArgumentError(f"options must be a unickpt.LoadOptions or None, got {type(options).__name__}")
    mapping, storage_options = options.mapping, options.storage_options
    if mapping is not None and tp_size is not None:
        raise InvalidArgumentError("a mapping cuts tensor-parallel shards itself (Mapping.fused(config, tp_rank=, "
                                   "tp_size=)): give tp_rank/tp_size to the mapping, not to load_for_inference")
    if (tp_rank is None) != (tp_size is None):
        raise InvalidArgumentError("give both tp_rank and tp_size, or neither")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise InvalidArgumentError(f"dtype must be a floating torch.dtype (torch.bfloat16...) or None, got {dtype!r}: "
                                   "weights are not converted to integers")
    if not callable(tp_dim):
        raise InvalidArgumentError(f"tp_dim must be a callable (name, shape) -> dimension or None, got {tp_dim!r}")
    if isinstance(keys, (str, bytes)):
        raise InvalidArgumentError(f"keys must be a list of names or patterns, got one string {keys!r}: pass [{keys!r}]")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InvalidArgumentError(f"device: {e}") from None
    if tp_size is not None and not (type(tp_size) is int and tp_size >= 1 and type(tp_rank) is int and 0 <= tp_rank < tp_size):
        raise InvalidArgumentError(f"need an integer tp_size >= 1 and 0 <= tp_rank < tp_size, got tp_rank={tp_rank!r}, tp_size={tp_size!r}")
    ckpt, man = read_manifest(path, storage_options=storage_options)
    # tied weights (aliases) are returned under every name, as the same tensor
    stored_name = {n: n for (r, n) in man.tensors if r == "model"}
    stored_name.update({n: t for (r, n), t in man.aliases.items() if r == "model"})
    per_rank = sorted(n for n, t in stored_name.items() if ("model", t) in man.per_rank)
    names = sorted(n for n in stored_name if n not in per_rank)
    if per_rank:
        log.info("load_for_inference %s: %d per-rank value(s) of the model role are not weights, not returned: %s",
                 ckpt, len(per_rank), per_rank[:5])
    if not names:
        raise TensorMissingError(f"{ckpt}: the checkpoint holds no model tensors" +
                                 (f" (only per-rank values: {per_rank[:5]})" if per_rank else ""))
    if mapping is not None:
        return _mapped(ckpt, man, mapping, {n: man.tensors[("model", stored_name[n])] for n in names}, keys, dtype,
                       device, options)
    if keys is not None:
        pats = list(keys)
        chosen = [n for n in names if any(n == p or fnmatch.fnmatchcase(n, p) for p in pats)]
        missing = [p for p in pats if not any(n == p or fnmatch.fnmatchcase(n, p) for n in names)]
        if missing:
            hint = [p for p in missing if any(n == p or fnmatch.fnmatchcase(n, p) for n in per_rank)]
            raise TensorMissingError(f"{ckpt}: no model tensor matches {missing}" + (
                f" ({hint} name per-rank values, one per saving rank, which are not weights: load them with "
                "unickpt.load into unickpt.per_rank targets)" if hint else ""))
        names = chosen
    # the files are checked (regular, of the recorded size, headers intact) before the shapes
    # the manifest claims are allocated
    storage, _ = storage_for(ckpt, storage_options)
    readers: dict = {}
    open_files(storage, ckpt, man, {man.tensors[("model", stored_name[n])].file for n in names}, readers)
    for r in readers.values():
        r.close()
    targets: dict[str, ShardedTensor | torch.Tensor] = {}
    for n in sorted(names, key=lambda n: n != stored_name[n]):  # stored names first: aliases reuse their target
        if stored_name[n] != n and stored_name[n] in targets and not (tp_size and tp_size > 1):
            targets[n] = targets[stored_name[n]]
            continue
        st = man.tensors[("model", stored_name[n])]
        sdt = torch_dtype(st.dtype)
        dim = tp_dim(n, st.shape) if tp_size and tp_size > 1 else None
        if dim is not None and not (type(dim) is int and 0 <= dim < len(st.shape)):
            raise LayoutError(f"{ckpt}/{st.file}: tensor {n!r} of shape {list(st.shape)} has no dimension {dim!r} to split "
                              "for tensor parallelism (tp_dim must return a dimension of the tensor, or None)")
        if dim is None:
            targets[n] = torch.empty(st.shape, dtype=sdt)
            continue
        if st.shape[dim] % tp_size:
            raise LayoutError(f"{ckpt}/{st.file}: tensor {n!r} dim {dim} of size {st.shape[dim]} does not split into tp_size={tp_size}")
        k = st.shape[dim] // tp_size
        offsets = [0] * len(st.shape)
        sizes = list(st.shape)
        offsets[dim], sizes[dim] = tp_rank * k, k
        targets[n] = ShardedTensor(torch.empty(sizes, dtype=sdt), Layout(st.shape, tuple(offsets), tuple(sizes)))
    load({"model": targets}, ckpt, group=LOCAL, missing="warn", options=options)
    out: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor] = {}  # tied weights stay one tensor
    for n, t in targets.items():
        x = t.local if isinstance(t, ShardedTensor) else t
        if id(x) not in done:
            done[id(x)] = x.to(device=device, dtype=dtype or x.dtype)
        out[n] = done[id(x)]
    return out


def _chosen(ckpt: str, names: list[str], keys: Iterable[str] | None, what: str = "model tensor") -> list[str]:
    """The names ``keys`` (names or shell patterns) choose; a key that chooses none: refused."""
    if keys is None:
        return names
    pats = list(keys)
    missing = [p for p in pats if not any(n == p or fnmatch.fnmatchcase(n, p) for n in names)]
    if missing:
        raise TensorMissingError(f"{ckpt}: no {what} matches {missing}")
    return [n for n in names if any(n == p or fnmatch.fnmatchcase(n, p) for p in pats)]


def _mapped(ckpt: str, man, mapping: Mapping, stored: dict, keys, dtype, device, options: LoadOptions) -> dict:
    """:func:`load_for_inference` through a mapping: its targets (:func:`mapped_targets`),
    each of its sources' dtype, loaded by the load plan (only the boxes each needs)."""
    planned = mapped_targets(mapping, stored, ckpt)
    chosen = _chosen(ckpt, list(planned), keys, "target of the mapping")
    targets = {n: torch.empty(planned[n].shape, dtype=torch_dtype(planned[n].dtype)) for n in chosen}
    storage, _ = storage_for(ckpt, options.storage_options)
    readers: dict = {}
    try:  # the files are checked (regular, of the recorded size, headers intact) before a byte is read
        open_files(storage, ckpt, man, {stored[s].file for n in chosen for s in planned[n].sources}, readers)
    finally:
        for r in readers.values():
            r.close()
    load({"model": targets}, ckpt, group=LOCAL, options=options)
    return {n: t.to(device=device, dtype=dtype or t.dtype) for n, t in targets.items()}
