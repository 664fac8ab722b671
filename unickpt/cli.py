"""Command line: ``unickpt inspect|verify|export|reshard|convert|clean-memory``.

Every command takes ``--json`` (exactly one JSON object on stdout: the result, its figures,
or the error), ``-q/--quiet`` (no progress) and ``--debug``. Exit codes: 0 done, 1 a
verification found damage, 2 an error of the user or the input (one line on stderr, never a
traceback: bad arguments, missing or odd paths, typed checkpoint errors, Ctrl-C, also while
starting up), 3 a bug in unickpt (one line and a hint; the traceback with ``--debug`` or
``UNICKPT_DEBUG=1``), 141 stdout was closed by its reader (``... | head -1``; nothing on
stderr, the status a shell reports for a tool ended by SIGPIPE). Progress goes to stderr: a
tqdm bar on a terminal, a line every ~5 s or 10% otherwise.

Only the standard library and unickpt's light modules are imported with this module;
torch and the readers are imported by :func:`main`, under its Ctrl-C handling.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
import warnings
from typing import TYPE_CHECKING, Any, Callable

from ._metrics import gbps, human_bytes
from ._version import __version__
from .errors import (CheckpointExistsError, CheckpointNotFoundError, FormatError, InvalidArgumentError, StorageError,


                     UnickptError)

if TYPE_CHECKING:
    from .manifest import Manifest

__all__ = ["main", "verify_checkpoint"]

OK, FAILED, ERROR, BUG = 0, 1, 2, 3
#: stdout closed by its reader (``| head``): 128 + SIGPIPE, what a shell reports for tools it ends
PIPE_CLOSED = 141
ZSTD_LEVELS = (1, 22)
#: errors of the user, the input or the environment: one line, exit 2
USER_ERRORS = (UnickptError, OSError, ValueError, NotImplementedError)
Progress = Callable[[int, int], None] | None


class UsageError(Exception):
    """The command line itself is wrong (argparse's message, or an option value)."""


class _Parser(argparse.ArgumentParser):
    """argparse that raises :class:`UsageError` instead of printing usage and exiting, and
    takes no abbreviated options (``--jso`` would be ``--json`` to argparse but not to
    :func:`main`, which looks for ``--json`` to answer errors in JSON)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"{message} (see {self.prog} --help)")


class _Progress:
    """The ``progress(done, total)`` callback of one command, on stderr: a tqdm bar on a
    terminal; otherwise, after the first ``first_s`` seconds, a line each ``every_s`` seconds
    or 10% of the bytes, and the final line; nothing with ``quiet``."""

    every_s = 5.0
    first_s = 2.0  # no intermediate line before this

    def __init__(self, label: str, quiet: bool) -> None:
        self.label, self.on = label, not quiet
        self.tty = self.on and sys.stderr.isatty()
        self.bar: Any = None
        self.t0 = self.last = time.perf_counter()
        self.tenth = 0

    def __call__(self, done: int, total: int) -> None:
        if not self.on:
            return
        if self.tty:
            if self.bar is None:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=self.label, unit="B", unit_scale=True, file=sys.stderr,
                                leave=False, dynamic_ncols=True)
            if self.bar.total != total:
                self.bar.total = total
            self.bar.update(done - self.bar.n)
            return
        now, tenth = time.perf_counter(), done * 10 // max(total, 1)
        final = done >= total
        if final and self.tenth > 10:
            return  # the 100% line is out already
        # intermediate lines only for runs long enough to want them; the last one always
        if final or (now - self.t0 >= self.first_s and (tenth > self.tenth or now - self.last >= self.every_s)):
            self.tenth, self.last = (11 if final else tenth), now
            print(f"unickpt {self.label}: {100 * done / max(total, 1):.0f}% ({human_bytes(done)} of "
                  f"{human_bytes(total)}), {gbps(done, now - self.t0):.2f} GB/s", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _with_progress(label: str, args, fn: Callable[[Progress], Any]):
    """``fn(progress)`` with this command's progress on stderr."""
    p = _Progress(label, args.quiet)
    try:
        return fn(p)
    finally:
        p.close()


def _safe(v) -> str:
    """Text from a checkpoint, printable: control characters (terminal escape sequences a
    crafted manifest could carry) are shown escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(v))


def _warn(args, text: str) -> None:
    """A warning line on stderr, also listed in the ``--json`` object."""
    print(f"unickpt {args.cmd}: warning: {text}", file=sys.stderr)
    args.warnings.append(text)


class _Said(logging.Handler):
    """The library's WARNING records during a command, said as the command's own warnings
    (:func:`_warn`): a line on stderr and an entry of ``warnings`` in the ``--json`` object.
    (Without a handler of its own, Python's last resort printed them, and --json left them out.)"""

    def __init__(self, args) -> None:
        super().__init__(logging.WARNING)
        self.args = args

    def emit(self, record: logging.LogRecord) -> None:
        try:
            _warn(self.args, _safe(record.getMessage()))
        except Exception:
            self.handleError(record)


# --- commands: each returns (exit code, result for --json, text for stdout) -----------------


def _frame_kinds(f) -> dict[str, int]:
    """How many frames of a framed file are stored each way (unickpt.container)."""
    names = {0: "raw", 1: "zstd", 2: "byte-grouped"}
    out: dict[str, int] = {}
    for fr in f.frames:
        out[names.get(fr[4], str(fr[4]))] = out.get(names.get(fr[4], str(fr[4])), 0) + 1
    return out


def _codec_counts(man: Manifest) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in man.tensors.values():
        out[t.codec] = out.get(t.codec, 0) + 1
    return dict(sorted(out.items()))


def _local(path: str) -> bool:
    return "://" not in path


def _source(path: str, what: str = "checkpoint directory") -> str:
    """``path`` as a source: an existing file is said to be one (the library only says it
    found no checkpoint directory there)."""
    if _local(path) and os.path.isfile(path):
        err = FormatError if what.startswith("torch.distributed") else CheckpointNotFoundError
        raise err(f"{path}: is a file, not a {what}")
    return path


def _read_manifest(path: str):
    from .loading import read_manifest

    return read_manifest(_source(path))


def _quant_by_role(man) -> dict:
    """Per role: the quantized tensors' lossy generations (the most any has) and their
    recorded errors (the largest relative L2 and max abs error; checkpoints that recorded
    none show None)."""
    out: dict[str, dict] = {}
    for (role, _), t in man.tensors.items():
        if not t.coder.quantized:
            continue
        q = out.setdefault(role, {"tensors": 0, "generations": 0, "max_rel_l2": None, "max_abs": None})
        q["tensors"] += 1
        q["generations"] = max(q["generations"], t.args.get("generations", 1))
        err = t.args.get("error") or {}
        for k, src in (("max_rel_l2", "rel_l2"), ("max_abs", "max_abs")):
            if src in err:
                q[k] = err[src] if q[k] is None else max(q[k], err[src])
    return out


def _inspect(args):
    ckpt, man = _read_manifest(args.path)
    roles: dict[str, int] = {}
    for role, _ in man.tensors:
        roles[role] = roles.get(role, 0) + 1
    info = {
        "path": ckpt,
        "format_version": man.format_version,
        "step": man.step,
        "created": man.created,
        "tensors": len(man.tensors),
        "tensors_by_role": roles,
        "bytes": man.total_bytes,
        "bytes_by_role": man.bytes_by_role(),
        "files": {n: {"role": f.role, "node": f.node, "writer": f.writer, "size": f.size, "stored": f.stored,
                      "container": f.container, **({"frames": _frame_kinds(f)} if f.container == "zstd" else {})}
                  for n, f in man.files.items()},
        "compression": man.compression,
        "codecs": _codec_counts(man),
        "lossy_generations": man.lossy_generations,
        "quantization": _quant_by_role(man),
        "saved_by": man.saved_by,
        "extra": man.extra,
    }
    if args.tensors:
        info["tensor_list"] = [{"role": r, "name": n, "dtype": t.dtype, "shape": list(t.shape), "codec": t.codec,
                                "file": t.file, **({"error": t.args["error"]} if "error" in t.args else {})}
                               for (r, n), t in sorted(man.tensors.items())]
    if args.json:
        return OK, info, ""
    sb = man.saved_by
    lines = [
        f"checkpoint   {_safe(ckpt)}",
        f"format       unickpt v{man.format_version}, step {man.step}, created {_safe(man.created)}",
        f"saved by     {sb.get('world_size', '?')} ranks on {len(sb.get('nodes', []))} node(s), "
        f"unickpt {_safe(sb.get('unickpt_version', '?'))}",
    ]
    if sb.get("strategy"):
        lines.append(f"strategy     {_safe(json.dumps(sb['strategy']))}")
    lines.append(f"size         {human_bytes(man.total_bytes)} in {len(man.files)} files, {len(man.tensors)} tensors")
    if man.compression:
        c = man.compression
        lines.append(f"compression  quant {c.get('quant') or 'O0'}, master {c.get('master', 'full')}, "
                     f"zstd {c.get('zstd') or 'off'}{', lossless (byte-grouped)' if c.get('lossless') else ''}; "
                     "tensor codecs: " + ", ".join(f"{k} x{n}" for k, n in info["codecs"].items()))
    for role, n in man.bytes_by_role().items():
        q = info["quantization"].get(role)
        err = "" if q is None else (f"; {q['tensors']} quantized: lossy generations {q['generations']}"
                                    + ("" if q["max_rel_l2"] is None else f", rel L2 error <= {q['max_rel_l2']:.3g}, "
                                       f"max abs error {q['max_abs']:.3g}"))
        lines.append(f"  {role:<11}{human_bytes(n):>12}  {roles.get(role, 0)} tensors{err}")
    if args.tensors:
        for (role, name), t in sorted(man.tensors.items()):
            codec = f"  [{t.codec}]" if t.coder.coded else ""
            sums = [c[2] for *_, cs in t.stored() for c in cs]
            lines.append(f"  {role}/{_safe(name)}  {t.dtype}{list(t.shape)}{codec}  {t.file}  "
                         f"{' '.join(sums[:4])}{' ...' if len(sums) > 4 else ''}")
    return OK, info, "\n".join(lines)


def _verify(args):
    t0 = time.perf_counter()
    ckpt, man = _read_manifest(args.path)  # (format >= 2: the manifest's own checksum is checked here)
    node = args.node
    nodes = sorted({f.node for f in man.files.values()} | {n for f in man.files.values() for n in f.replicas})
    if node is not None and node not in nodes:
        raise InvalidArgumentError(f"--node {node!r}: the checkpoint's files were written on node(s) {nodes}")
    unchecked: list[tuple[str, str, str]] = []
    bad = _with_progress("verify", args, lambda progress: verify_checkpoint(ckpt, man, progress, node=node,
                                                                             unchecked=unchecked))
    secs = time.perf_counter() - t0
    here = [t for t in man.tensors.values() if _on_node(man.files[t.file], node)]
    files_here = [f for f in man.files.values() if _on_node(f, node)]
    elsewhere = sorted(f.name for f in man.files.values() if not _on_node(f, node))
    nbytes = sum(t.nbytes for t in here)
    res: dict[str, Any] = {"path": ckpt, "tensors": len(here), "files": len(files_here), "other_files": len(man.aux),
                           "bytes": nbytes, "seconds": secs, "gbps": gbps(nbytes, secs),
                           "bad": [{"file": f, "tensor": n, "reason": why} for f, n, why in bad],
                           "unchecked": [{"file": f, "tensor": n, "reason": why} for f, n, why in unchecked],
                           "verdict": "damaged" if bad else ("could not check" if unchecked else "intact")}
    if node is not None:
        res["node"], res["elsewhere"] = node, elsewhere
    stray = _unlisted(ckpt, man, {f for f, _, _ in bad})
    if stray:
        res["unlisted"] = stray
        _warn(args, f"{len(stray)} entr{'y' if len(stray) == 1 else 'ies'} of {_safe(ckpt)} not part of the checkpoint "
                    f"(its manifest does not list them, and no load reads them): "
                    f"{', '.join(_safe(n) for n in stray[:8])}{', ...' if len(stray) > 8 else ''}")
    if bad:
        tensors = {(f, n) for f, n, _ in bad if n}
        others = sorted({f for f, n, _ in bad if not n})
        summary = (f"{len(tensors)} of {len(here)} tensors failed verification"
                   + (f"; so did {', '.join(others)}" if others else ""))
        if not args.json:
            for f, n, why in bad:
                print(f"BAD  {_safe(f)}: {'tensor ' + repr(_safe(n)) + ': ' if n else ''}{_safe(why)}", file=sys.stderr)
            gone = _absent(ckpt, {f for f, n, _ in bad if n}) if node is None and len(nodes) > 1 else set()
            if gone:  # one node's directory of a node-local checkpoint?
                print(f"note: the missing files were written on node(s) {sorted({man.files[f].node for f in gone})}; on "
                      "node-local storage each node's directory holds its own files only: `unickpt verify PATH --node "
                      "ID` checks one node's", file=sys.stderr)
        if unchecked:
            summary += f"; {len({f for f, _, _ in unchecked})} file(s) could not be read, so were not checked"
        print(f"unickpt verify: {_safe(summary)}", file=sys.stderr)
        res["error"] = {"type": "ChecksumError", "message": summary}
        return FAILED, res, ""
    if unchecked:  # nothing found damaged, but not everything could be checked: no verdict
        files = sorted({f for f, _, _ in unchecked})
        summary = (f"could not check {len(files)} file(s) ({', '.join(files[:4])}{' ...' if len(files) > 4 else ''}): "
                   f"{unchecked[0][2]}; the rest match their checksums")
        if not args.json:
            for f, n, why in unchecked:
                print(f"UNCHECKED  {_safe(f)}: {'tensor ' + repr(_safe(n)) + ': ' if n else ''}{_safe(why)}",
                      file=sys.stderr)
        print(f"unickpt verify: {_safe(summary)}", file=sys.stderr)
        res["error"] = {"type": "StorageError", "message": summary}
        return ERROR, res, ""
    extra = f" and {len(man.aux)} other files" if man.aux else ""
    note = "" if man.format_version >= 2 else " (format 1: the manifest, headers and other files carry no checksum)"
    of_node = "" if node is None else f" of node {node}"
    rest = (f"; {len(elsewhere)} files of other nodes not checked here ({', '.join(sorted({man.files[f].node for f in elsewhere}))})"
            if elsewhere else "")
    return OK, res, (f"ok: {len(here)} tensors in {len(files_here)} files{of_node}{extra} match their checksums{note} "
                     f"({human_bytes(nbytes)} in {secs:.2f} s, {gbps(nbytes, secs):.2f} GB/s){rest}")


def _unlisted(ckpt: str, man, reported: set[str] = frozenset()) -> list[str]:
    """Entries of the checkpoint directory that its manifest does not list (a stray
    ``*.safetensors`` copied in, an editor's backup...): never read, but a folder that looks
    like more than the checkpoint is worth a word. Not those ``reported`` already (an
    unlisted config.json fails the check). Empty where the store cannot list."""
    from .manifest import MANIFEST_NAME
    from .io.storage import storage_for

    storage, _ = storage_for(ckpt)
    try:
        names = storage.listdir(ckpt)
    except (OSError, UnickptError):
        return []
    finally:
        storage.close()
    known = set(man.files) | set(man.aux) | {MANIFEST_NAME} | set(reported)
    return sorted(n for n in names if n not in known)


def _absent(ckpt: str, names: set[str]) -> set[str]:
    """Those of the files ``names`` that the checkpoint directory does not hold."""
    from .io.storage import storage_for

    storage, _ = storage_for(ckpt)
    try:
        return {f for f in names if not storage.exists(storage.join(ckpt, f))}
    finally:
        storage.close()


def _on_node(f, node: str | None) -> bool:
    """Whether file entry ``f`` lies in ``node``'s directory (every file when ``node`` is None)."""
    return node is None or f.node == node or node in f.replicas


def verify_checkpoint(ckpt: str, man: Manifest, progress: Progress = None, node: str | None = None,
                      unchecked: list | None = None) -> list[tuple[str, str, str]]:
    """Check every stored tensor against its checksum; return ``(file, tensor, reason)`` of
    what is damaged (missing, malformed, or bytes that do not match). ``progress(done,
    total)`` is called with the bytes checked so far. ``node``: the directory is that node's
    of a node-local checkpoint; only the files it holds (written there, or replicated to it)
    are checked. ``unchecked``: where a file cannot be read (permission denied, EIO: a
    :class:`~unickpt.errors.StorageError`, which says nothing of the bytes) its tensors go
    there as ``(file, tensor, reason)`` and the check goes on; without it, that error raises."""

    def cannot_read(e: BaseException, fname: str, names: list[str]) -> bool:
        if unchecked is None or not isinstance(e, StorageError) or isinstance(e, CheckpointNotFoundError):
            return False
        unchecked.extend((fname, n, f"could not be read: {e}") for n in names)
        return True

    import torch

    from .format import Hasher
    from .io.files import open_file
    from .loading.verify import WINDOW, check_stored
    from .io.storage import storage_for

    storage, _ = storage_for(ckpt)
    total = sum(t.nbytes for t in man.tensors.values() if _on_node(man.files[t.file], node))
    buf = torch.empty(WINDOW, dtype=torch.uint8)
    bad: list[tuple[str, str, str]] = []
    by_file: dict[str, list] = {}
    for t in man.tensors.values():
        if _on_node(man.files[t.file], node):
            by_file.setdefault(t.file, []).append(t)
    done = 0
    for fname in sorted(by_file):
        ts = sorted(by_file[fname], key=lambda t: t.begin)
        try:
            reader = open_file(storage, ckpt, man, fname)
        except UnickptError as e:
            if not cannot_read(e, fname, [t.name for t in ts]):
                bad += [(fname, t.name, str(e)) for t in ts]
            continue
        try:
            base = man.files[fname].data_start
            for i, t in enumerate(ts):
                try:
                    found = list(check_stored(reader, base, t, buf))
                except StorageError as e:
                    if cannot_read(e, fname, [x.name for x in ts[i:]]):
                        break
                    raise
                for part, b, e in found:
                    what = f"part {part!r}" if part else "the tensor"
                    bad.append((fname, t.name, f"bytes [{b}, {e}) of {what} do not match their checksum"))
                done += t.nbytes
                if progress is not None:
                    progress(done, total)
        finally:
            reader.close()
    if man.format_version >= 2:  # files tools read (export copies config.json) must be listed
        for name in ("config.json", "generation_config.json", "model.safetensors.index.json"):
            if name not in man.aux and storage.exists(storage.join(ckpt, name)):
                bad.append((name, "", "not part of the checkpoint (its manifest does not list it)"))
    for name, (size, digest) in sorted(man.aux.items()):  # index, config.json...
        try:
            data = storage.read_bytes(storage.join(ckpt, name), max(size, 0))
        except UnickptError as e:
            if not cannot_read(e, name, [""]):
                bad.append((name, "", str(e)))
            continue
        if len(data) != size or Hasher.of(data) != digest:
            bad.append((name, "", "does not match the size and checksum the manifest records"))
    return bad


def _check_export_destination(dst: str, overwrite: bool) -> None:
    """The destination's checks of the write itself (commit.Transaction, for a folder), made
    before the export reads configs (transformers logs its own warnings there): an error
    about DST comes first and alone."""
    from .io.commit import Transaction
    from .io.storage import storage_for

    storage, final = storage_for(dst)
    try:
        txn = Transaction(storage, final, overwrite=overwrite, folder=True)
        if not (txn.marker and overwrite):  # (on object stores that check replaces the folder)
            txn._check_destination()
    finally:
        storage.close()


def _titan_mapping(src: str, config: str | None):
    """``Mapping.hf_from_torchtitan`` with the heads of the config export writes (``--config``,
    or the checkpoint's own config.json)."""
    from .errors import MappingError
    from .export import _aux_json, _given_config
    from .io.storage import storage_for
    from .loading import read_manifest
    from .mapping import Mapping

    conf = _given_config(config)
    if conf is None:
        ckpt, man = read_manifest(src)
        storage, _ = storage_for(ckpt)
        try:
            conf = _aux_json(storage, ckpt, man, "config.json")
        finally:
            storage.close()
    heads = None if conf is None else conf.get("num_attention_heads")
    kv = None if conf is None else conf.get("num_key_value_heads", heads)
    hd = None if conf is None else conf.get("head_dim")
    hidden = None if conf is None else conf.get("hidden_size")
    if type(heads) is not int or heads <= 0 or type(kv) is not int or kv <= 0 or not (hd is None or type(hd) is int):
        raise InvalidArgumentError("--from-torchtitan needs the model's attention heads as integers: pass --config with "
                                   "a Hugging Face config.json (num_attention_heads, num_key_value_heads, head_dim or "
                                   f"hidden_size); got num_attention_heads={heads!r}, num_key_value_heads={kv!r}, "
                                   f"head_dim={hd!r}")
    if hd is None and type(hidden) is int and hidden % heads == 0:
        hd = hidden // heads
    try:
        return Mapping.hf_from_torchtitan(num_heads=heads, num_kv_heads=kv, head_dim=hd)
    except MappingError as e:
        raise InvalidArgumentError(f"--from-torchtitan: {e}") from None


def _export(args):
    from .export import DTYPE_NAMES, export_hf
    from .io.storage import storage_for

    max_shard = _size(args.max_shard_size)
    _source(args.src)
    _check_export_destination(args.dst, args.overwrite)
    mapping = _titan_mapping(args.src, args.config) if args.from_torchtitan else None
    res = _with_progress("export", args, lambda progress: export_hf(
        args.src, args.dst, dtype=DTYPE_NAMES[args.dtype] if args.dtype else None,
        max_shard_bytes=max_shard, config=args.config, overwrite=args.overwrite, progress=progress, mapping=mapping,
    ))
    storage, final = storage_for(res["path"])
    try:
        has_config = storage.exists(storage.join(final, "config.json"))
    finally:
        storage.close()
    if not has_config:
        _warn(args, f"the checkpoint has no config.json, so {_safe(res['path'])} has none: it will not load with "
                    "from_pretrained; pass --config FILE (a config.json, or a folder holding one)")
    return OK, res, (f"exported {res['tensors']} tensors ({human_bytes(res['bytes'])}) in {res['files']} files to "
                     f"{_safe(res['path'])} in {res['seconds']:.2f} s ({res['gbps']:.2f} GB/s)")


def _reshard(args):
    from .offline import reshard_offline

    drop = list(args.drop_role)
    if args.drop_optimizer:
        _warn(args, "--drop-optimizer is deprecated; use --drop-role optimizer")
        drop.append("optimizer")
    max_file = _size(args.max_file_size) if args.max_file_size is not None else None
    lo, hi = ZSTD_LEVELS
    if args.zstd is not None and not lo <= args.zstd <= hi:
        raise InvalidArgumentError(f"--zstd {args.zstd}: zstd must be a level from {lo} to {hi}")
    _source(args.src)
    res = _with_progress("reshard", args, lambda progress: reshard_offline(
        args.src, args.dst, drop_roles=drop, master=args.master, quant=args.quant,
        max_file_bytes=max_file, zstd=args.zstd, overwrite=args.overwrite, progress=progress,
        lossless=args.lossless,
    ))
    res = dict(res, dropped_roles=sorted(set(drop)))
    return OK, res, (f"wrote {res['tensors']} tensors ({human_bytes(res['bytes'])}, {human_bytes(res['stored_bytes'])} "
                     f"on disk) to {_safe(res['path'])} in {res['seconds']:.2f} s ({res['gbps']:.2f} GB/s)")


def _convert(args):
    from .offline import convert_from_dcp

    _source(args.from_dcp, "torch.distributed.checkpoint directory")

    def run(progress):
        with warnings.catch_warnings():  # DCP warns that it runs without a process group: on purpose here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            return convert_from_dcp(args.from_dcp, args.dst, overwrite=args.overwrite, progress=progress)

    res = _with_progress("convert", args, run)
    return OK, res, (f"converted {res['tensors']} tensors ({human_bytes(res['bytes'])}) to {_safe(res['path'])} in "
                     f"{res['seconds']:.2f} s" + (f"; skipped {len(res['skipped'])} non-tensor entries" if res["skipped"] else ""))


def _clean_memory(args):
    from .memtier import clean

    removed = clean(args.dir, force=args.force)
    return OK, {"removed": removed}, (f"removed {len(removed)} snapshot director{'y' if len(removed) == 1 else 'ies'} "
                                      f"from {_safe(args.dir)}" if removed else f"nothing to remove in {_safe(args.dir)}")


def _size(text: str) -> int:
    """``5GiB``, ``512M``, ``4096``: a positive whole number of bytes (InvalidArgumentError otherwise)."""
    import math

    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = units.get(t[-1:], 1)
    try:
        v = float(t[:-1] if mult > 1 else t) * mult
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and 1 <= v <= 1 << 60):
        raise InvalidArgumentError(f"size {text!r}: expected a positive size such as 5GiB, 512M or 4096")
    return int(v)


# --- the command line ----------------------------------------------------------------------


def _parser() -> _Parser:
    common = _Parser(add_help=False)
    common.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout "
                        "(the result and its figures, or the error); progress and logs go to stderr")
    common.add_argument("-q", "--quiet", action="store_true", help="no progress bar or progress lines")
    common.add_argument("--debug", action="store_true", help="show the traceback of an internal error "
                        "(also UNICKPT_DEBUG=1)")
    common.add_argument("--storage-options", metavar="JSON", dest="c_storage_options",
                        help="options of the fsspec file system of s3://, gs://... paths, as a JSON object (e.g. "
                             "'{\"client\": \"s3fs\"}'); default: $UNICKPT_STORAGE_OPTIONS")
    p = _Parser(prog="unickpt", description="Unified distributed checkpoints.",
                epilog="exit codes: 0 done, 1 verification failed, 2 error (one line on stderr), 3 internal error")
    p.add_argument("--version", action="version", version=f"unickpt {__version__}")
    p.add_argument("--storage-options", metavar="JSON",
                   help="options of the fsspec file system of s3://, gs://... paths, as a JSON object (e.g. "
                        "'{\"client\": \"s3fs\"}'); default: $UNICKPT_STORAGE_OPTIONS, credentials from the standard "
                        "AWS environment")
    for flags, dest in ((("--json",), "g_json"), (("-q", "--quiet"), "g_quiet"), (("--debug",), "g_debug")):
        p.add_argument(*flags, dest=dest, action="store_true", help=argparse.SUPPRESS)  # also before the command
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    pi = sub.add_parser("inspect", parents=[common], help="describe a checkpoint")
    pi.add_argument("path", help="checkpoint directory, or a root of step-* checkpoints (newest)")
    pi.add_argument("--tensors", action="store_true", help="list every tensor")
    pi.set_defaults(fn=_inspect)
    pv = sub.add_parser("verify", parents=[common], help="check every tensor against its checksum (exit 1 on mismatch)")
    pv.add_argument("path", help="checkpoint directory, or a root of step-* checkpoints (newest)")
    pv.add_argument("--node", metavar="ID", help="PATH is node ID's directory of a node-local checkpoint: check the "
                    "files it holds (the others live on their nodes)")
    pv.set_defaults(fn=_verify)
    pe = sub.add_parser("export", parents=[common], help="write the model weights as a Hugging Face model folder")
    pe.add_argument("src", help="checkpoint directory, or a root of step-* checkpoints (newest)")
    pe.add_argument("dst", help="destination folder (created atomically)")
    pe.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="cast the weights (default: as stored)")
    pe.add_argument("--max-shard-size", default="5GiB", metavar="SIZE", help="largest safetensors shard (default 5GiB)")
    pe.add_argument("--config", metavar="FILE", help="the config.json to write into DST: the file, or a folder holding it (default: the checkpoint's own)")
    pe.add_argument("--overwrite", action="store_true", help="replace DST (kept intact until the new one is in place)")
    pe.add_argument("--from-torchtitan", action="store_true", help="SRC holds torchtitan Llama names: write Hugging "
                    "Face names, the q/k rows permuted (heads from --config or the checkpoint's config.json)")
    pe.set_defaults(fn=_export)
    pr = sub.add_parser("reshard", parents=[common],
                        help="rewrite a checkpoint offline (other file sizes, fewer roles, compression), streaming")
    pr.add_argument("src", help="checkpoint directory, or a root of step-* checkpoints (newest)")
    pr.add_argument("dst", help="destination checkpoint (created atomically)")
    pr.add_argument("--quant", choices=["O0", "O1", "O2"], default="O0",
                    help="Adam moments: O1 8-bit, O2 4-bit (O0: as stored, decoded)")
    pr.add_argument("--master", choices=["full", "residual", "drop"], default="full",
                    help="fp32 masters: full, residual (bf16 + 2 bytes, bit-exact) or drop (rebuilt from the model)")
    pr.add_argument("--drop-role", action="append", default=[], metavar="ROLE",
                    help="leave out this role (tensors and JSON state); repeat for several")
    pr.add_argument("--drop-optimizer", action="store_true", help="deprecated: --drop-role optimizer")
    pr.add_argument("--max-file-size", metavar="SIZE", help="split files beyond this size (e.g. 2GiB)")
    pr.add_argument("--zstd", type=int, metavar="LEVEL", help="zstd-frame optimizer and master files (model files stay plain)")
    pr.add_argument("--lossless", action="store_true",
                    help="byte-grouped entropy coding of every file, model included (bit-exact; not with --zstd)")
    pr.add_argument("--overwrite", action="store_true", help="replace DST (kept intact until the new one is in place)")
    pr.set_defaults(fn=_reshard)
    pc = sub.add_parser("convert", parents=[common], help="import a torch.distributed.checkpoint directory, streaming")
    pc.add_argument("--from-dcp", required=True, metavar="DCP_DIR", help="the torch.distributed.checkpoint directory")
    pc.add_argument("dst", help="destination checkpoint (created atomically)")
    pc.add_argument("--overwrite", action="store_true", help="replace DST (kept intact until the new one is in place)")
    pc.set_defaults(fn=_convert)
    pm = sub.add_parser("clean-memory", parents=[common],
                        help="free the memory tier's snapshots left on this node by a job that is gone")
    pm.add_argument("dir", help="the node's memory directory (a {node} in it is this node's id)")
    pm.add_argument("--force", action="store_true", help="even if a process of the owning job still runs here")
    pm.set_defaults(fn=_clean_memory)
    return p


def _command_of(argv: list[str]) -> str | None:
    return next((a for a in argv if a in ("inspect", "verify", "export", "reshard", "convert", "clean-memory")), None)


def _where(e: BaseException) -> str:
    """``file.py:line`` of the innermost frame of unickpt in ``e``'s traceback."""
    here = os.path.dirname(os.path.abspath(__file__))
    frames = [f for f in traceback.extract_tb(e.__traceback__) if os.path.dirname(os.path.abspath(f.filename)) == here]
    return f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""


def _stdout_gone() -> None:
    """After a broken pipe (``unickpt inspect ... | head``): Python's documented recipe, point
    stdout at devnull so the interpreter's final flush does not fail again (nor print
    "Exception ignored")."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout is not a file (redirected in-process)
        pass


def _start_up() -> None:
    """The slow part of starting (torch, the readers): inside :func:`main`'s handling, so that
    a Ctrl-C while they load is the usual one line, not a traceback."""
    import importlib

    importlib.import_module("torch")
    importlib.import_module(".loading", __package__)


def _cli_wording(message: str) -> str:
    """A library message as the command line says it (``--overwrite``, not ``overwrite=True``)."""
    return message.replace("use --overwrite / overwrite=True", "use --overwrite").replace(
        "pass overwrite=True", "pass --overwrite")


def _run(argv: list[str], said: list[str] | None = None) -> tuple[int, dict, str]:
    """Parse and run one command; typed results, or an exception."""
    _start_up()
    args = _parser().parse_args(argv)
    args.json, args.quiet, args.debug = args.json or args.g_json, args.quiet or args.g_quiet, args.debug or args.g_debug
    if args.storage_options is not None and args.c_storage_options is not None \
            and args.storage_options != args.c_storage_options:
        raise UsageError("--storage-options given twice (before and after the command) with different values")
    if args.c_storage_options is not None:  # (after the command)
        args.storage_options = args.c_storage_options
    from .io.objstore import parse_options

    if args.storage_options is not None:
        try:
            parse_options(args.storage_options, "--storage-options")
        except InvalidArgumentError as e:
            raise UsageError(str(e)) from None
        os.environ["UNICKPT_STORAGE_OPTIONS"] = args.storage_options
    elif os.environ.get("UNICKPT_STORAGE_OPTIONS"):  # (from the environment: checked as the option is)
        try:
            parse_options(os.environ["UNICKPT_STORAGE_OPTIONS"], "UNICKPT_STORAGE_OPTIONS")
        except InvalidArgumentError as e:
            raise UsageError(str(e)) from None
    args.warnings = said if said is not None else []
    handler = _Said(args)  # the library's warnings (logged) are the command's: on stderr and in --json
    lib = logging.getLogger("unickpt")
    lib.addHandler(handler)
    try:
        rc, res, text = args.fn(args)
    finally:
        lib.removeHandler(handler)
    if args.warnings:
        res = dict(res, warnings=args.warnings)
    return rc, res, text


def _out(text: str) -> bool:
    """``text`` on stdout; False when the reader has gone (broken pipe)."""
    try:
        print(text)
        sys.stdout.flush()
        return True
    except BrokenPipeError:
        _stdout_gone()
        return False


def main(argv: list[str] | None = None) -> int:
    """Run ``unickpt ARGV``; return the exit code (0, 1, 2 or 3: see the module docstring)."""
    argv = [str(a) for a in (sys.argv[1:] if argv is None else argv)]
    cmd = _command_of(argv)
    as_json = "--json" in argv
    debug = "--debug" in argv or os.environ.get("UNICKPT_DEBUG", "") not in ("", "0")
    prefix = f"unickpt {cmd}" if cmd else "unickpt"
    said: list[str] = []  # the command's warnings, also when it fails
    try:
        rc, res, text = _run(argv, said)
    except KeyboardInterrupt:
        rc, error, line = ERROR, {"type": "KeyboardInterrupt", "message": "interrupted"}, "interrupted (Ctrl-C)"
    except UsageError as e:
        rc, error, line = ERROR, {"type": "UsageError", "message": str(e)}, f"error: {e}"
    except SystemExit as e:  # --help, --version: argparse printed them
        return e.code if isinstance(e.code, int) else OK
    except USER_ERRORS as e:
        if debug:
            traceback.print_exc()
        msg = _cli_wording(str(e)) if isinstance(e, CheckpointExistsError) else str(e)
        rc, error, line = ERROR, {"type": type(e).__name__, "message": msg}, f"{type(e).__name__}: {msg}"
    except Exception as e:
        if debug:
            raise
        rc, error = BUG, {"type": type(e).__name__, "message": str(e), "internal": True}
        line = (f"internal error: {type(e).__name__}: {e}{_where(e)} (a bug in unickpt; rerun with --debug or "
                "UNICKPT_DEBUG=1 for the traceback and report it)")
    else:
        out = json.dumps({"command": cmd, "ok": rc == OK, "exit_code": rc, **res}, indent=2, default=str) if as_json else text
        if out and not _out(out):  # the reader left (``| head -1``): normal use, said by the exit code only
            return PIPE_CLOSED
        return rc
    print(f"{prefix}: {_safe(line)}", file=sys.stderr)
    if as_json:
        _out(json.dumps({"command": cmd, "ok": False, "exit_code": rc, "error": error,
                         **({"warnings": said} if said else {})}, indent=2))
    return rc


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
