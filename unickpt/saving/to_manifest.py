"""The ranks' reports (checksums, sizes, frames, quantization errors) assembled into the
checkpoint's manifest, on rank 0."""

from __future__ import annotations

from typing import Mapping

from .._metrics import log
from ..codecs import FromModel, Raw, get
from ..compress import EXCEPTION_WARN, Compression, error_record, merge_error
from ..errors import UnickptError
from ..format import Hasher
from ..io.fileset import file_entry, new_manifest
from ..manifest import Manifest, Part, TensorEntry
from ..plan import SavePlan


__all__ = ["aux_entries", "build_manifest", "exception_report"]


def aux_entries(files: Mapping[str, bytes], extra_files: Mapping[str, str] | None) -> dict[str, tuple[int, str]]:
    """Size and checksum of the checkpoint's other files (index, extra files), for the manifest."""
    out = {n: (len(b), Hasher.of(b)) for n, b in files.items()}
    for n, text in (extra_files or {}).items():
        b = text.encode()
        out[n] = (len(b), Hasher.of(b))
    return out


def exception_report(plan: SavePlan, rank: int, exceptions: dict) -> dict:
    """Residual exceptions of the tensors this rank is a written source of."""
    out = {}
    for key, (idx, bits) in exceptions.items():
        t = plan.tensors.get(key)
        if t is not None and len(idx) and t.sources_of(rank):  # (its own pieces only: O(1) in the world size)
            out[f"{key[0]}/{key[1]}"] = [idx.tolist(), bits.tolist()]
    return out


def _tiled(ext: list, nbytes: int, what: str) -> tuple:
    ext = sorted(tuple(e) for e in ext)
    pos = 0
    for b, e, _ in ext:
        if b != pos:
            raise UnickptError(f"{what}: checksummed ranges leave bytes {pos}..{b} unwritten")
        pos = e
    if pos != nbytes:
        raise UnickptError(f"{what}: only {pos} of {nbytes} bytes were written")
    return tuple(ext)


def build_manifest(plan: SavePlan, reports: list[dict], step, json_state, extra, strategy, dropped=None,
              comp: Compression | None = None, name_of=str, lossy_generations: int = 0,
              step_args: dict | None = None) -> Manifest:
    """``name_of``: the stored name of a planned file (:meth:`unickpt.io.commit.Transaction.file_name`).
    ``lossy_generations``: those of the state saved, before this save; ``step_args``: what
    this save adds to quantized tensors' tags (:func:`~unickpt.saving.writer.step_args`)."""
    checksums: dict[str, list] = {}
    qerr: dict[str, list] = {}
    sizes: dict[str, int] = {}
    excs: dict[str, list] = {}
    framed: dict[str, dict] = {}
    for r in reports:
        framed.update(r.get("zstd", {}))
        for k, ext in r.get("checksums", {}).items():
            checksums.setdefault(k, []).extend(ext)
        for name, n in r.get("files", {}).items():
            sizes[name] = sizes.get(name, 0) + n
        for k, st in r.get("qerr", {}).items():
            merge_error(qerr.setdefault(k, []), st)
        for k, (idx, bits) in r.get("exceptions", {}).items():
            e = excs.setdefault(k, [[], []])
            e[0].extend(idx)
            e[1].extend(bits)
    tensors = {}
    for t in plan.tensors.values():
        what = f"tensor {t.name!r} (role {t.role})"
        k = f"{t.role}/{t.name}"
        if t.codec is None:
            ext = _tiled(checksums.get(k, []), t.nbytes, what)
            tensors[t.key] = TensorEntry(t.role, t.name, name_of(t.file), t.dtype, t.shape, t.begin, t.end, ext, Raw.name,
                                         t.writer)
            continue
        codec = t.codec["codec"]
        args = {a: v for a, v in t.codec.items() if a != "codec"}
        if get(codec).exceptions:  # a residual master: every rank's exceptions, in index order
            idx, bits = excs.get(k, [[], []])
            order = sorted(range(len(idx)), key=idx.__getitem__)
            args["exceptions"] = [[idx[i] for i in order], [bits[i] for i in order]]
            n = t.numel
            if len(idx) > max(16, n * EXCEPTION_WARN):
                log.warning("%s: %d of %d master elements are not reproduced by bf16 model + low 16 bits; the model "
                            "weights are not the bf16 rounding of the master weights (stored as exceptions)", what, len(idx), n)
            parts = {"low16": Part(f"{t.name}::low16", "I16", t.shape, t.begin, t.end, _tiled(checksums.get(k, []), t.nbytes, what))}
            dtype = "F32"
        else:
            parts = {}
            for p, (key, dt, sh, b, e) in t.parts.items():
                parts[p] = Part(key, dt, sh, b, e, _tiled(checksums.get(f"{k}#{p}", []), e - b, f"{what} part {p}"))
            dtype = t.dtype
            args.update((step_args or {}).get(t.key, {}))
            args["generations"] = lossy_generations + 1
            if k in qerr:
                args["error"] = error_record(qerr[k])
        tensors[t.key] = TensorEntry(t.role, t.name, name_of(t.file), dtype, t.shape, t.begin, t.end, (), codec, t.writer,
                                     parts, args)
    for (role, name), (dt, shape, model) in (dropped or {}).items():
        m = tensors[("model", model)]
        tensors[(role, name)] = TensorEntry(role, name, m.file, dt, tuple(shape), 0, 0, (), FromModel.name, m.writer,
                                            {}, {"model": model})
    files = {}
    for f in plan.files:
        if sizes.get(f.name) != f.size:
            raise UnickptError(f"{f.name}: writers reported {sizes.get(f.name)} bytes, planned {f.size}")
        z = framed.get(f.name) or {}
        files[name_of(f.name)] = file_entry(name_of(f.name), f.role, f.node, f.writer, f.size, f.header, z.get("stored"),
                                            z.get("frames", ()))
    quantized = any(t.codec is not None and t.quantized for t in plan.tensors.values())
    generations = lossy_generations + (1 if quantized else 0)
    applied = {get(t.codec["codec"]).needs_model for t in plan.tensors.values() if t.codec is not None} | (
        {True} if dropped else set())
    if comp is not None and comp.master != "full" and True not in applied:  # recorded as applied
        import dataclasses

        comp = dataclasses.replace(comp, master="full")
    record = comp.to_json() if comp is not None and comp.active else {}
    if generations:  # (the state's history, also through lossless saves: the next resume carries it on)
        record["lossy_generations"] = generations
    return new_manifest(world_size=plan.world, nodes=plan.nodes, strategy=strategy, compression=record, step=step,
                        files=files, tensors=tensors, state=json_state, extra=extra)
