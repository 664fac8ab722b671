"""Command line: ``unickpt inspect PATH [--json]``, ``unickpt verify PATH``,
``unickpt export SRC DST [--dtype bf16|fp16|fp32]``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from . import __version__
from ._metrics import human_bytes
from .errors import UnickptError
from .loader import read_manifest
from .manifest import Manifest


def _safe(v) -> str:
    """Text from a checkpoint, printable: control characters (terminal escape sequences a
    crafted manifest could carry) are shown escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(v))


def _codec_counts(man: Manifest) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in man.tensors.values():
        out[t.codec] = out.get(t.codec, 0) + 1
    return dict(sorted(out.items()))


def _inspect(args) -> int:
    ckpt, man = read_manifest(args.path)
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
                      "container": f.container} for n, f in man.files.items()},
        "compression": man.compression,
        "codecs": _codec_counts(man),
        "saved_by": man.saved_by,
        "extra": man.extra,
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"checkpoint   {_safe(ckpt)}")
    print(f"format       unickpt v{man.format_version}, step {man.step}, created {_safe(man.created)}")
    sb = man.saved_by
    print(f"saved by     {sb.get('world_size', '?')} ranks on {len(sb.get('nodes', []))} node(s), unickpt {_safe(sb.get('unickpt_version', '?'))}")
    if sb.get("strategy"):
        print(f"strategy     {_safe(json.dumps(sb['strategy']))}")
    print(f"size         {human_bytes(man.total_bytes)} in {len(man.files)} files, {len(man.tensors)} tensors")
    if man.compression:
        c = man.compression
        print(f"compression  quant {c.get('quant') or 'O0'}, master {c.get('master', 'full')}, zstd {c.get('zstd') or 'off'}; "
              + ", ".join(f"{k} x{n}" for k, n in info["codecs"].items()))
    for role, n in man.bytes_by_role().items():
        print(f"  {role:<11}{human_bytes(n):>12}  {roles.get(role, 0)} tensors")
    if args.tensors:
        for (role, name), t in sorted(man.tensors.items()):
            codec = "" if t.codec == "raw" else f"  [{t.codec}]"
            sums = [c[2] for *_, cs in t.stored() for c in cs]
            print(f"  {role}/{_safe(name)}  {t.dtype}{list(t.shape)}{codec}  {t.file}  {' '.join(sums[:4])}{' ...' if len(sums) > 4 else ''}")
    return 0


def _verify(args) -> int:
    ckpt, man = read_manifest(args.path)  # (format >= 2: the manifest's own checksum is checked here)
    bad = verify_checkpoint(ckpt, man, progress=not args.quiet)
    if bad:
        for f, n, why in bad:
            print(f"BAD  {f}: {'tensor ' + repr(_safe(n)) + ': ' if n else ''}{why}", file=sys.stderr)
        tensors = {(f, n) for f, n, _ in bad if n}
        others = sorted({f for f, n, _ in bad if not n})
        print(f"{len(tensors)} of {len(man.tensors)} tensors failed verification"
              + (f"; so did {', '.join(others)}" if others else ""), file=sys.stderr)
        return 1
    extra = f" and {len(man.aux)} other files" if man.aux else ""
    note = "" if man.format_version >= 2 else " (format 1: the manifest, headers and other files carry no checksum)"
    print(f"ok: {len(man.tensors)} tensors in {len(man.files)} files{extra} match their checksums{note}")
    return 0


def verify_checkpoint(ckpt: str, man: Manifest, progress: bool = False) -> list[tuple[str, str, str]]:
    """Check every stored tensor against its checksum; return ``(file, tensor, reason)``."""
    import torch

    from .format import Hasher
    from .loader import WINDOW, check_stored, open_file
    from .storage import storage_for

    storage, _ = storage_for(ckpt)
    total = sum(t.nbytes for t in man.tensors.values())
    bar = _Bar(total, "verify") if progress else None
    buf = torch.empty(WINDOW, dtype=torch.uint8)
    bad: list[tuple[str, str, str]] = []
    by_file: dict[str, list] = {}
    for t in man.tensors.values():
        by_file.setdefault(t.file, []).append(t)
    done = 0
    for fname in sorted(by_file):
        ts = sorted(by_file[fname], key=lambda t: t.begin)
        try:
            reader = open_file(storage, ckpt, man, fname)
        except UnickptError as e:
            bad += [(fname, t.name, str(e)) for t in ts]
            continue
        try:
            base = man.files[fname].data_start
            for t in ts:
                for part, b, e in check_stored(reader, base, t, buf):
                    what = f"part {part!r}" if part else "the tensor"
                    bad.append((fname, t.name, f"bytes [{b}, {e}) of {what} do not match their checksum"))
                done += t.nbytes
                if bar:
                    bar.update(done)
        finally:
            reader.close()
    if bar:
        bar.close()
    if man.format_version >= 2:  # files tools read (export copies config.json) must be listed
        for name in ("config.json", "model.safetensors.index.json"):
            if name not in man.aux and storage.exists(storage.join(ckpt, name)):
                bad.append((name, "", "not part of the checkpoint (its manifest does not list it)"))
    for name, (size, digest) in sorted(man.aux.items()):  # index, config.json...
        try:
            data = storage.read_bytes(storage.join(ckpt, name), max(size, 0))
        except UnickptError as e:
            bad.append((name, "", str(e)))
            continue
        if len(data) != size or Hasher.of(data) != digest:
            bad.append((name, "", "does not match the size and checksum the manifest records"))
    return bad


class _Bar:
    """A minimal progress bar on stderr (only when it is a terminal)."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label = max(total, 1), label
        self.t0 = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.last = 0.0

    def update(self, done: int) -> None:
        now = time.perf_counter()
        if not self.tty or (now - self.last < 0.1 and done < self.total):
            return
        self.last = now
        frac = min(done / self.total, 1.0)
        rate = done / max(now - self.t0, 1e-9) / 1e9
        bar = "#" * int(frac * 30)
        sys.stderr.write(f"\r{self.label} [{bar:<30}] {frac * 100:5.1f}% {human_bytes(done)} {rate:.2f} GB/s")
        sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")

    def progress(self, done: int, total: int) -> None:
        """Use as a library ``progress=`` callback."""
        self.total = max(total, 1)
        self.update(done)


def _with_bar(label: str, quiet: bool, fn):
    """Run ``fn(progress)`` with a progress bar on stderr (none with ``quiet``)."""
    bar = _Bar(1, label) if not quiet else None
    try:
        return fn(bar and bar.progress)
    finally:
        if bar:
            bar.close()


def _export(args) -> int:
    from .export import DTYPE_NAMES, export_hf

    res = _with_bar("export", args.quiet, lambda progress: export_hf(
        args.src, args.dst, dtype=DTYPE_NAMES[args.dtype] if args.dtype else None,
        max_shard_bytes=_size(args.max_shard_size), overwrite=args.overwrite, progress=progress,
    ))
    print(f"exported {res['tensors']} tensors ({human_bytes(res['bytes'])}) in {res['files']} files to {res['path']} "
          f"in {res['seconds']:.2f} s ({res['gbps']:.2f} GB/s)")
    return 0


def _reshard(args) -> int:
    from .offline import reshard_offline

    res = _with_bar("reshard", args.quiet, lambda progress: reshard_offline(
        args.src, args.dst, drop_optimizer=args.drop_optimizer, master=args.master, quant=args.quant,
        max_file_bytes=_size(args.max_file_size) if args.max_file_size else None, zstd=args.zstd,
        overwrite=args.overwrite, progress=progress,
    ))
    print(f"wrote {res['tensors']} tensors ({human_bytes(res['bytes'])}, {human_bytes(res['stored_bytes'])} on disk) "
          f"to {res['path']} in {res['seconds']:.2f} s")
    return 0


def _convert(args) -> int:
    from .offline import convert_from_dcp

    res = _with_bar("convert", args.quiet,
                    lambda progress: convert_from_dcp(args.from_dcp, args.dst, overwrite=args.overwrite, progress=progress))
    print(f"converted {res['tensors']} tensors ({human_bytes(res['bytes'])}) to {res['path']} in {res['seconds']:.2f} s"
          + (f"; skipped {len(res['skipped'])} non-tensor entries" if res["skipped"] else ""))
    return 0


def _size(text: str) -> int:
    """``5GiB``, ``512M``, ``4096``: a positive whole number of bytes (InvalidArgumentError otherwise)."""
    import math

    from .errors import InvalidArgumentError

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="unickpt", description="Unified distributed checkpoints.")
    p.add_argument("--version", action="version", version=f"unickpt {__version__}")
    p.add_argument("--storage-options", metavar="JSON",
                   help="options of the fsspec file system of s3://, gs://... paths, as a JSON object (e.g. "
                        "'{\"client\": \"s3fs\"}'); default: $UNICKPT_STORAGE_OPTIONS, credentials from the standard "
                        "AWS environment")
    sub = p.add_subparsers(dest="cmd", required=True)
    pi = sub.add_parser("inspect", help="describe a checkpoint")
    pi.add_argument("path", help="checkpoint directory, or a root of step-* checkpoints (newest)")
    pi.add_argument("--json", action="store_true", help="print one JSON object")
    pi.add_argument("--tensors", action="store_true", help="list every tensor")
    pi.set_defaults(fn=_inspect)
    pv = sub.add_parser("verify", help="check every tensor against its checksum (exit 1 on mismatch)")
    pv.add_argument("path")
    pv.add_argument("-q", "--quiet", action="store_true")
    pv.set_defaults(fn=_verify)
    pe = sub.add_parser("export", help="write the model weights as a Hugging Face model folder")
    pe.add_argument("src", help="checkpoint directory, or a root of step-* checkpoints (newest)")
    pe.add_argument("dst", help="destination folder (created atomically)")
    pe.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="cast the weights (default: as stored)")
    pe.add_argument("--max-shard-size", default="5GiB", help="largest safetensors shard (default 5GiB)")
    pe.add_argument("--overwrite", action="store_true", help="replace DST (kept intact until the new one is in place)")
    pe.add_argument("-q", "--quiet", action="store_true")
    pe.set_defaults(fn=_export)
    pr = sub.add_parser("reshard", help="rewrite a checkpoint offline (other file sizes, fewer roles), streaming")
    pr.add_argument("src")
    pr.add_argument("dst")
    pr.add_argument("--quant", choices=["O0", "O1", "O2"], default="O0", help="Adam moments: O1 8-bit, O2 4-bit (O0: as stored, decoded)")
    pr.add_argument("--master", choices=["full", "residual", "drop"], default="full", help="fp32 masters: full, residual (bf16 + 2 bytes, bit-exact) or drop (rebuilt from the model)")
    pr.add_argument("--drop-optimizer", action="store_true")
    pr.add_argument("--max-file-size", help="split files beyond this size (e.g. 2GiB)")
    pr.add_argument("--zstd", type=int, metavar="LEVEL", help="zstd-frame optimizer and master files (model files stay plain)")
    pr.add_argument("--overwrite", action="store_true")
    pr.add_argument("-q", "--quiet", action="store_true")
    pr.set_defaults(fn=_reshard)
    pc = sub.add_parser("convert", help="import a torch.distributed.checkpoint directory, streaming")
    pc.add_argument("--from-dcp", required=True, metavar="DCP_DIR")
    pc.add_argument("dst")
    pc.add_argument("--overwrite", action="store_true")
    pc.add_argument("-q", "--quiet", action="store_true")
    pc.set_defaults(fn=_convert)
    args = p.parse_args(argv)
    if args.storage_options is not None:
        os.environ["UNICKPT_STORAGE_OPTIONS"] = args.storage_options
    try:
        return args.fn(args)
    except (UnickptError, NotImplementedError, ValueError, OSError) as e:
        print(f"unickpt {args.cmd}: {type(e).__name__}: {_safe(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
