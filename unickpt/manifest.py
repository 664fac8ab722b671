"""The manifest ``unickpt.json``: versioned schema, (de)serialisation and validation.

A manifest is plain JSON (never pickle). Loading validates every field a hostile or damaged
manifest could use to mislead a reader: file names are bare names inside the checkpoint
directory, offsets agree with dtype and shape, roles and codecs are known.

From format 2 on the manifest protects itself and everything beside the tensor bytes: its
last member ``manifest_xxh3_128`` is the xxh3-128 of the text before it (closed by ``}``),
each file entry records the xxh3-64 of its safetensors header (``header_xxh3``), and
``aux`` records size and xxh3-64 of the other files of the checkpoint (the Hugging Face
index, ``config.json``). These detect damage (bit flips, truncation, a mixed-up file), not
forgery: whoever can write the checkpoint can rewrite its checksums.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import xxhash

from . import codecs
from .codecs import MAX_BLOCK, Codec, Raw
from .errors import FormatError
from .format import DTYPES, MAX_DIMS, itemsize, valid_shape
from .names import (_RESERVED, BYTES_KEY, FLOAT_KEY, FLOAT_NAMES, MAX_BYTES, MAX_DEPTH, PER_RANK_KEY, RANK_VALUE_KEY,


                    RESERVED, name_problem)

__all__ = ["Manifest", "FileEntry", "TensorEntry", "FORMAT_VERSION", "MANIFEST_NAME", "INDEX_NAME"]

FORMAT_NAME = "unickpt"
FORMAT_VERSION = 2
MANIFEST_NAME = "unickpt.json"
INDEX_NAME = "model.safetensors.index.json"
MANIFEST_LIMIT = 512 << 20
MANIFEST_BASE = 16 << 20  # a manifest may always be this large; beyond, 4 bytes per checkpoint byte
DIGEST_KEY = "manifest_xxh3_128"
_DIGEST_TAIL = re.compile(rb',"manifest_xxh3_128":"([0-9a-f]{32})"\}\s*\Z')
_AUX = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")

_FILE = re.compile(r"^[a-z][a-z0-9_]{0,31}-\d{5,}-of-\d{5,}(\.[0-9a-f]{16})?\.safetensors$")
_ROLE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


@dataclass(frozen=True, slots=True)
class FileEntry:
    name: str
    role: str
    node: str
    writer: int
    size: int  # logical bytes (a safetensors file)
    data_start: int
    container: str = "plain"  # "zstd": stored as frames (unickpt.container)
    stored_size: int = -1
    frames: tuple = ()
    header_xxh3: str = ""  # of the safetensors header, bytes [0, data_start) (format >= 2)
    replicas: tuple[str, ...] = ()  # node-local saves: other nodes that hold a copy (memory tier)

    @property
    def stored(self) -> int:
        """Bytes on disk."""
        return self.stored_size if self.container == "zstd" else self.size

    def to_json(self) -> dict:
        out = {"role": self.role, "node": self.node, "writer": self.writer, "size": self.size, "data_start": self.data_start}
        if self.header_xxh3:
            out["header_xxh3"] = self.header_xxh3
        if self.container == "zstd":
            out.update(container="zstd", stored_size=self.stored_size, frames=[list(f) for f in self.frames])
        if self.replicas:
            out["replicas"] = list(self.replicas)
        return out


@dataclass(frozen=True, slots=True)
class Part:
    """One stored piece of a coded tensor: a safetensors entry ``key`` of its file."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int
    checksums: tuple[tuple[int, int, str], ...]

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    def to_json(self) -> dict:
        return {"key": self.key, "dtype": self.dtype, "shape": list(self.shape), "offsets": [self.begin, self.end],
                "checksums": [list(c) for c in self.checksums]}


@dataclass(frozen=True, slots=True)
class TensorEntry:
    role: str
    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offsets inside the file's data section (as in the safetensors header)
    end: int
    checksums: tuple[tuple[int, int, str], ...]  # (begin, end, xxh3) tiling the stored bytes
    codec: str = Raw.name  # the name of its codec (unickpt.codecs; ``coder`` is the object)
    writer: int = 0
    parts: dict[str, Part] = field(default_factory=dict)  # coded tensors: codes/scales, low16
    args: dict[str, Any] = field(default_factory=dict)  # codec arguments (group, eps, model...)

    @property
    def coder(self) -> Codec:
        """The codec object of ``codec`` (:mod:`unickpt.codecs`; the name is checked when the
        manifest is parsed)."""
        return codecs.get(self.codec)

    @property
    def nbytes(self) -> int:
        """Stored bytes (all parts of a coded tensor; 0 for masters rebuilt from the model)."""
        if self.coder.coded:
            return sum(p.nbytes for p in self.parts.values())
        return self.end - self.begin

    def stored(self) -> list[tuple[str, str, str, tuple[int, ...], int, int, tuple]]:
        """``(part, header key, dtype, shape, begin, end, checksums)`` of the bytes stored."""
        if not self.coder.coded:
            return [("", self.name, self.dtype, self.shape, self.begin, self.end, self.checksums)]
        return [(k, p.key, p.dtype, p.shape, p.begin, p.end, p.checksums) for k, p in sorted(self.parts.items())]

    @property
    def tag(self) -> dict:
        return {"codec": self.codec, **self.args}

    @property
    def exceptions(self):
        """Residual masters: (global indices int64, fp32 bits int32) tensors."""
        import torch

        exc = self.args.get("exceptions") or [[], []]
        return torch.tensor(exc[0], dtype=torch.int64), torch.tensor(exc[1], dtype=torch.int64).to(torch.int32)

    @property
    def key(self) -> tuple[str, str]:
        return (self.role, self.name)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_json(self) -> dict:
        out = {
            "file": self.file,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "offsets": [self.begin, self.end],
            "checksums": [list(c) for c in self.checksums],
            "codec": self.codec,
            "writer": self.writer,
        }
        if self.coder.coded:
            out["parts"] = {k: p.to_json() for k, p in sorted(self.parts.items())}
            out["codec_args"] = self.args
        return out


@dataclass(slots=True)
class Manifest:
    step: int | None
    files: dict[str, FileEntry]
    tensors: dict[tuple[str, str], TensorEntry]
    state: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    saved_by: dict[str, Any] = field(default_factory=dict)
    created: str = ""
    checksum_algo: str = "xxh3_64"
    format_version: int = FORMAT_VERSION
    compression: dict[str, Any] = field(default_factory=dict)
    aux: dict[str, tuple[int, str]] = field(default_factory=dict)  # other files: name -> (size, xxh3)
    aliases: dict[tuple[str, str], str] = field(default_factory=dict)
    """Tied weights: ``(role, name) -> stored name`` of the same role holding its values."""
    per_rank: set[tuple[str, str]] = field(default_factory=set)
    """Tensors stored once per rank (:func:`unickpt.per_rank`): dimension 0 is the saving rank."""
    source_digest: str = ""  # xxh3-128 of the bytes this manifest was parsed from

    def to_json(self) -> bytes:
        roles: dict[str, dict[str, dict]] = {}
        for (role, name), t in sorted(self.tensors.items()):
            roles.setdefault(role, {})[name] = t.to_json()
        obj = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "step": self.step,
            "created": self.created,
            "checksum_algo": self.checksum_algo,
            "saved_by": self.saved_by,
            "compression": self.compression,
            "files": {n: f.to_json() for n, f in sorted(self.files.items())},
            "tensors": roles,
            "state": self.state,
            "extra": self.extra,
            "aux": {n: list(v) for n, v in sorted(self.aux.items())},
        }
        if self.aliases:
            al: dict[str, dict[str, str]] = {}
            for (role, name), target in sorted(self.aliases.items()):
                al.setdefault(role, {})[name] = target
            obj["aliases"] = al
        if self.per_rank:
            pr: dict[str, list[str]] = {}
            for role, name in sorted(self.per_rank):
                pr.setdefault(role, []).append(name)
            obj["per_rank"] = pr
        body = json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
        why = density_problem(body)
        if why:  # (saves check their JSON state before writing; this is the last word)
            raise FormatError(f"the manifest would hold {why}, more than a reader parses: store dense JSON state "
                              "(long lists of small lists) in a tensor")
        return body[:-1] + b',"' + DIGEST_KEY.encode() + b'":"' + xxhash.xxh3_128_hexdigest(body).encode() + b'"}'

    @property
    def total_bytes(self) -> int:
        """Bytes on disk (compressed files count compressed)."""
        return sum(f.stored for f in self.files.values())

    @property
    def lossy_generations(self) -> int:
        """Lossy save/resume cycles the values of this checkpoint have been through: the
        count its save recorded (``compression.lossy_generations``), else 1 when it holds
        quantized tensors (checkpoints before the count), else 0."""
        g = self.compression.get("lossy_generations")
        per_tensor = max((t.args.get("generations", 1) for t in self.tensors.values() if t.coder.quantized), default=0)
        # (the larger: a manifest whose record says fewer cycles than its tensors must not reset the budget)
        return max(g, per_tensor) if type(g) is int and g >= 0 else per_tensor

    def entry(self, role: str, name: str) -> "TensorEntry | None":
        """The stored tensor ``role/name`` names: itself, or the one a tied name (alias)
        stands for; None when neither."""
        return self.tensors.get((role, name)) or self.tensors.get((role, self.aliases.get((role, name), "")))

    def bytes_by_role(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for f in self.files.values():
            out[f.role] = out.get(f.role, 0) + f.stored
        return dict(sorted(out.items()))

    def hf_index(self) -> bytes | None:
        """Hugging Face ``model.safetensors.index.json`` for the model role, if any."""
        model = {n: t for (r, n), t in self.tensors.items() if r == "model"}
        if not model:
            return None
        obj = {
            "metadata": {"total_size": sum(t.nbytes for t in model.values()), "format": "unickpt"},
            "weight_map": {n: model[n].file for n in sorted(model)},
        }
        return json.dumps(obj, indent=2).encode()

    @staticmethod
    def from_json(data: bytes, where: str) -> "Manifest":
        why = density_problem(data)  # bounds parse memory
        if why:
            raise FormatError(f"{where}: {why}: not a manifest")
        m = _DIGEST_TAIL.search(data)
        digest_ok = m is not None and xxhash.xxh3_128_hexdigest(data[: m.start()] + b"}") == m.group(1).decode()
        if m is not None and not digest_ok:  # damaged: refused before it costs a parse
            raise FormatError(f"{where}: manifest is damaged (its checksum does not match its content)")
        try:
            obj = json.loads(data.decode("utf-8"), parse_constant=_no_constant, parse_float=_finite_float)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
            if m is not None and not digest_ok:
                raise FormatError(f"{where}: manifest is damaged (its checksum does not match its content)") from None
            raise FormatError(f"{where}: manifest is not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None
        if m is not None and not digest_ok:  # a checksum present but wrong: damage, whatever the version says
            raise FormatError(f"{where}: manifest is damaged (its checksum does not match its content)")
        if isinstance(obj, dict) and type(obj.get("format_version")) is int and 2 <= obj["format_version"] <= FORMAT_VERSION:
            if m is None:
                raise FormatError(f"{where}: manifest of format {obj['format_version']} does not end with its "
                                  f"checksum ({DIGEST_KEY!r} as the last member of the bytes unickpt wrote): damaged, "
                                  "truncated or re-serialised")
            if not digest_ok:
                raise FormatError(f"{where}: manifest is damaged (its checksum does not match its content)")
        try:
            man = _parse(obj, where)
            man.source_digest = xxhash.xxh3_128_hexdigest(data)
            return man
        except (ValueError, TypeError, RecursionError, AttributeError, KeyError, OverflowError) as e:
            if isinstance(e, FormatError):
                raise
            raise FormatError(f"{where}: malformed manifest ({type(e).__name__}: {str(e)[:200]})") from None


def data_file_name(name: str) -> bool:
    """``name`` has the form of a checkpoint data file (``role-NNNNN-of-NNNNN.safetensors``;
    on object stores ``role-NNNNN-of-NNNNN.TOKEN.safetensors``, TOKEN 16 hex digits naming the
    write, see :meth:`unickpt.io.commit.Transaction.file_name`)."""
    return bool(_FILE.fullmatch(name))


DENSE_ALLOWANCE = 1 << 18
"""JSON objects and arrays a manifest may hold however densely packed (parse memory ~45x the
text, ~35 MiB at most); beyond it, at most one per 8 bytes of text (~15x the text)."""


def density_problem(data: bytes, allowance: int = DENSE_ALLOWANCE, more: tuple[int, int] = (0, 0)) -> str | None:
    """Why ``data`` (JSON text) holds too many objects and arrays for its size to be parsed
    within the bound above, or None. Brackets inside strings count too (a cheap, conservative
    count before any parse); saves check their JSON state with the same count
    (:func:`unickpt.saving.save_entries`), so what a save commits a load parses. ``more``:
    ``(brackets, bytes)`` of text counted elsewhere, to be added."""
    containers = data.count(b"{") + data.count(b"[") + more[0]
    size = len(data) + more[1]
    if containers > max(size // 8 + 64, allowance):
        return f"{containers} JSON objects/arrays (or brackets in strings) in {size} bytes"
    return None


def manifest_cap(checkpoint_bytes: int) -> int:
    """Largest manifest a checkpoint whose data files take ``checkpoint_bytes`` can need."""
    return min(MANIFEST_LIMIT, MANIFEST_BASE + 4 * max(checkpoint_bytes, 0))


def _int(v, where: str) -> int:
    if type(v) is not int:
        raise FormatError(f"{where}: expected an integer, got {type(v).__name__}")
    return v


def _req(obj: dict, key: str, kind, where: str):
    if not isinstance(obj, dict) or key not in obj:
        raise FormatError(f"{where}: missing field {key!r}")
    v = obj[key]
    if kind is int:
        ok = type(v) is int
    else:
        ok = isinstance(v, kind)
    if not ok:
        raise FormatError(f"{where}: field {key!r} has the wrong type ({type(v).__name__})")
    return v


_HEX = re.compile(r"[0-9a-f]{16}")


def _no_constant(name: str):
    raise ValueError(f"{name} is not strict JSON")


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"{text[:40]} is not a finite number")
    return v


def _checksums(raw: list, nbytes: int, where: str) -> tuple[tuple[int, int, str], ...]:
    """Checksummed ranges must tile ``[0, nbytes)`` in order."""
    out = []
    pos = 0
    for c in raw:
        if not (isinstance(c, list) and len(c) == 3 and type(c[0]) is int and type(c[1]) is int and isinstance(c[2], str)):
            raise FormatError(f"{where}: checksums must be [begin, end, hex] triples")
        b, e, h = c
        if b != pos or e <= b or not _HEX.fullmatch(h):
            raise FormatError(f"{where}: checksum ranges must tile the tensor's bytes in order (got [{b}, {e}) at {pos})")
        out.append((b, e, h))
        pos = e
    if pos != nbytes and not (nbytes == 0 and not out):
        raise FormatError(f"{where}: checksums cover {pos} of {nbytes} bytes")
    return tuple(out)


def _parts(t: dict, codec: Codec, args: dict, dtype: str, shape: tuple[int, ...], fe: FileEntry, w: str,
           name: str) -> dict[str, Part]:
    """Validate a coded tensor's arguments and parts against what its codec needs."""
    expect = codec.check_record(args, dtype, shape, w)
    if not isinstance(args.get("model", ""), str):
        raise FormatError(f"{w}: codec_args.model must be a tensor name")
    raw = t.get("parts", {})
    if not isinstance(raw, dict) or set(raw) != set(expect):
        raise FormatError(f"{w}: codec {codec.name} has parts {sorted(expect)}, the manifest lists {sorted(raw) if isinstance(raw, dict) else raw!r}")
    out = {}
    for p, (dt, sh) in expect.items():
        pw = f"{w} part {p!r}"
        pj = raw[p]
        key = _req(pj, "key", str, pw)
        if key != f"{name}{RESERVED}{p}":
            raise FormatError(f"{pw}: stored under key {key!r}, expected the tensor's name + '{RESERVED}{p}'")
        pdt = _req(pj, "dtype", str, pw)
        psh_raw = _req(pj, "shape", list, pw)
        if not valid_shape(psh_raw):
            raise FormatError(f"{pw}: shape must be at most {MAX_DIMS} non-negative integers (product < 2^62)")
        psh = tuple(psh_raw)
        offs = _req(pj, "offsets", list, pw)
        if pdt != dt or psh != tuple(sh):
            raise FormatError(f"{pw}: stored as {pdt} {list(psh)}, codec {codec.name} needs {dt} {list(sh)}")
        if len(offs) != 2 or not all(type(o) is int for o in offs):
            raise FormatError(f"{pw}: offsets must be two integers")
        b, e = offs
        if not (0 <= b <= e <= fe.size - fe.data_start) or e - b != math.prod(sh) * itemsize(dt):
            raise FormatError(f"{pw}: offsets [{b}, {e}) do not fit {dt} {list(sh)} inside file {fe.name!r}")
        out[p] = Part(key, pdt, psh, b, e, _checksums(_req(pj, "checksums", list, pw), e - b, pw))
    return out


def _parse(obj: Any, where: str) -> Manifest:
    """A manifest from its parsed JSON, every field checked (FormatError naming ``where``
    and the field): its files, tensors (their codecs' records, :mod:`unickpt.codecs`), state,
    side files, aliases and per-rank tensors, in that order (each check may rely on the
    earlier ones)."""
    if not isinstance(obj, dict) or obj.get("format") != FORMAT_NAME:
        raise FormatError(f"{where}: not a unickpt manifest (field 'format' must be {FORMAT_NAME!r})")
    version = _req(obj, "format_version", int, where)
    if version > FORMAT_VERSION or version < 1:
        raise FormatError(
            f"{where}: format_version {version} is not supported by this unickpt (reads 1..{FORMAT_VERSION}); upgrade unickpt"
        )
    step = obj.get("step")
    if step is not None and type(step) is not int:
        raise FormatError(f"{where}: field 'step' must be an integer or null")
    files = _parse_files(obj, version, where)
    tensors = _parse_tensors(obj, files, where)
    state, extra, saved_by = obj.get("state", {}), obj.get("extra", {}), obj.get("saved_by", {})
    if not isinstance(state, dict) or not isinstance(extra, dict) or not isinstance(saved_by, dict):
        raise FormatError(f"{where}: 'state', 'extra' and 'saved_by' must be objects")

    bad = sorted(k for k in state if k in _RESERVED)
    if bad:
        raise FormatError(f"{where}: state: the top-level key {bad[0]!r} is reserved by unickpt")
    _typed_fields(saved_by, _SAVED_BY, f"{where}: saved_by")
    compression = obj.get("compression") or {}
    if not isinstance(compression, dict):
        raise FormatError(f"{where}: 'compression' must be an object")
    _typed_fields(compression, _COMPRESSION, f"{where}: compression")
    if not isinstance(obj.get("created", ""), str) or not isinstance(obj.get("checksum_algo", ""), str):
        raise FormatError(f"{where}: 'created' and 'checksum_algo' must be strings")
    aux = _parse_aux(obj, where)
    aliases = _parse_aliases(obj, tensors, where)
    world = saved_by.get("world_size")
    _check_state_values(state, world, f"{where}: state")
    per_rank = _parse_per_rank(obj, tensors, world, where)
    return Manifest(step=step, files=files, tensors=tensors, state=state, extra=extra, saved_by=saved_by,
                    created=str(obj.get("created", "")), checksum_algo=str(obj.get("checksum_algo", "xxh3_64")),
                    format_version=version, compression=compression, aux=aux, aliases=aliases, per_rank=per_rank)


def _parse_files(obj: dict, version: int, where: str) -> dict[str, FileEntry]:
    files: dict[str, FileEntry] = {}
    for name, f in _req(obj, "files", dict, where).items():
        w = f"{where}: file {name!r}"
        if not _FILE.fullmatch(name):
            raise FormatError(f"{w}: not a valid checkpoint file name (role-NNNNN-of-NNNNN.safetensors, no path)")
        size = _req(f, "size", int, w)
        start = _req(f, "data_start", int, w)
        writer = _req(f, "writer", int, w)
        if size < 0 or not (8 <= start <= size):
            raise FormatError(f"{w}: data_start {start} and size {size} are inconsistent")
        hx = f.get("header_xxh3", "")
        if version >= 2 and not (isinstance(hx, str) and _HEX.fullmatch(hx)):
            raise FormatError(f"{w}: 'header_xxh3' must be 16 hex digits")
        replicas = f.get("replicas", [])
        if not _str_list(replicas) or len(set(replicas)) != len(replicas) or f.get("node") in replicas:
            raise FormatError(f"{w}: 'replicas' must be a list of distinct node names other than the file's node")
        container = f.get("container", "plain")
        if container == "zstd":
            from .container import check_frames

            stored = _req(f, "stored_size", int, w)
            if stored < 0:
                raise FormatError(f"{w}: stored_size must be >= 0")
            frames = tuple(check_frames(_req(f, "frames", list, w), size, stored, w))
            files[name] = FileEntry(name, _req(f, "role", str, w), _req(f, "node", str, w), writer, size, start,
                                    "zstd", stored, frames, hx, tuple(replicas))
        elif container == "plain":
            files[name] = FileEntry(name, _req(f, "role", str, w), _req(f, "node", str, w), writer, size, start,
                                    header_xxh3=hx, replicas=tuple(replicas))
        else:
            raise FormatError(f"{w}: unknown container {container!r} (this unickpt knows plain, zstd)")
    return files


def _parse_tensors(obj: dict, files: dict[str, FileEntry], where: str) -> dict[tuple[str, str], TensorEntry]:
    tensors: dict[tuple[str, str], TensorEntry] = {}
    for role, group in _req(obj, "tensors", dict, where).items():
        if not _ROLE.fullmatch(role) or not isinstance(group, dict):
            raise FormatError(f"{where}: invalid role {role!r}")
        for name, t in group.items():
            w = f"{where}: tensor {name!r} (role {role})"
            why = name_problem(name)
            if why:
                raise FormatError(f"{where}: invalid tensor name: {why}")
            fname = _req(t, "file", str, w)
            if fname not in files:
                raise FormatError(f"{w}: file {fname!r} is not listed in 'files'")
            dtype = _req(t, "dtype", str, w)
            if dtype not in DTYPES:
                raise FormatError(f"{w}: unknown dtype {dtype!r}")
            shape = _req(t, "shape", list, w)
            if not valid_shape(shape):
                raise FormatError(f"{w}: shape must be at most {MAX_DIMS} non-negative integers (product < 2^62)")
            offs = _req(t, "offsets", list, w)
            if len(offs) != 2 or not all(type(o) is int for o in offs):
                raise FormatError(f"{w}: offsets must be two integers")
            codec = t.get("codec", Raw.name)
            if codec not in codecs.names():
                raise FormatError(f"{w}: unknown codec {codec!r} (this unickpt knows {', '.join(codecs.names())})")
            coder = codecs.get(codec)
            b, e = offs
            fe = files[fname]
            if not (0 <= b <= e <= fe.size - fe.data_start):
                raise FormatError(f"{w}: offsets [{b}, {e}) fall outside file {fname!r}")
            if not coder.coded and e - b != math.prod(shape) * itemsize(dtype):
                raise FormatError(f"{w}: {e - b} bytes stored, expected {math.prod(shape) * itemsize(dtype)} for {dtype} {shape}")
            parts: dict[str, Part] = {}
            args: dict = {}
            if not coder.coded:
                checksums = _checksums(_req(t, "checksums", list, w), e - b, w)
            else:
                checksums = ()
                args = _req(t, "codec_args", dict, w)
                if "codec" in args:
                    raise FormatError(f"{w}: codec_args may not name a codec (the entry's 'codec' does)")
                parts = _parts(t, coder, args, dtype, tuple(shape), fe, w, name)
            tensors[(role, name)] = TensorEntry(
                role, name, fname, dtype, tuple(shape), b, e, checksums, codec, _int(t.get("writer", 0), w), parts, args
            )
    for (role, name), t in tensors.items():
        c = t.coder
        if c.needs_model:
            w = f"{where}: tensor {name!r} (role {role})"
            m = tensors.get(("model", t.args.get("model")))
            if m is None or m.coder.coded or m.shape != t.shape or (c.model_dtype is not None and m.dtype != c.model_dtype):
                raise FormatError(f"{w}: codec {t.codec} needs a raw model tensor {t.args.get('model')!r} of the same shape"
                                  f"{f' in {c.model_dtype}' if c.model_dtype else ''}")
    return tensors


def _parse_aux(obj: dict, where: str) -> dict[str, tuple[int, str]]:
    aux: dict[str, tuple[int, str]] = {}
    for n, v in (obj.get("aux") or {}).items() if isinstance(obj.get("aux") or {}, dict) else [(None, None)]:
        if not (isinstance(n, str) and _AUX.fullmatch(n) and n != MANIFEST_NAME and isinstance(v, list) and len(v) == 2
                and type(v[0]) is int and v[0] >= 0 and isinstance(v[1], str) and _HEX.fullmatch(v[1])):
            raise FormatError(f"{where}: 'aux' must map bare file names to [size, xxh3] (entry {n!r})")
        aux[n] = (v[0], v[1])
    return aux


def _parse_aliases(obj: dict, tensors: dict, where: str) -> dict[tuple[str, str], str]:
    aliases: dict[tuple[str, str], str] = {}
    raw_al = obj.get("aliases") or {}
    if not isinstance(raw_al, dict):
        raise FormatError(f"{where}: 'aliases' must be an object")
    for role, group in raw_al.items():
        if not isinstance(group, dict):
            raise FormatError(f"{where}: aliases of role {role!r} must be an object")
        for name, target in group.items():
            if name_problem(name) or not isinstance(target, str) or (role, target) not in tensors \
                    or (role, name) in tensors:
                raise FormatError(f"{where}: alias {name!r} (role {role!r}) must name a tensor the checkpoint does not "
                                  f"store and point to one it stores (got {str(target)[:80]!r})")
            aliases[(role, name)] = target
    return aliases


def _parse_per_rank(obj: dict, tensors: dict, world: Any, where: str) -> set[tuple[str, str]]:
    per_rank: set[tuple[str, str]] = set()
    raw_pr = obj.get("per_rank") or {}
    if not isinstance(raw_pr, dict):
        raise FormatError(f"{where}: 'per_rank' must be an object")
    for role, names in raw_pr.items():
        if not _str_list(names):
            raise FormatError(f"{where}: per_rank of role {role!r} must be a list of tensor names")
        for name in names:
            t = tensors.get((role, name))
            if t is None or not t.shape or t.shape[0] < 1 or (type(world) is int and t.shape[0] != world):
                raise FormatError(f"{where}: per-rank tensor {name!r} (role {role!r}) must be a stored tensor with "
                                  f"one row per saving rank ({world})")
            per_rank.add((role, name))
    return per_rank


_BASE64 = re.compile(r"(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?")


def _check_state_values(obj, world, where: str, depth: int = 0, in_rank: bool = False) -> None:
    """Per-rank JSON values (``{"__unickpt_per_rank__": [...]}``) hold one value per saving
    rank; floats JSON cannot hold are ``{"__unickpt_float__": "inf" | "-inf" | "nan"}``
    alone; no other use of the reserved keys; nesting no deeper than saves write
    (:data:`~unickpt.names.MAX_DEPTH` and the two levels of a per-rank value, with room to
    spare), before the loader's recursive code walks it (a hostile manifest may nest as
    deep as the JSON parser goes)."""

    if depth > MAX_DEPTH + 8 and isinstance(obj, (dict, list)):
        raise FormatError(f"{where if len(where) < 160 else where[:120] + '...'}: nested deeper than {MAX_DEPTH + 8} "
                          "levels")
    if isinstance(obj, dict):
        if FLOAT_KEY in obj:
            v = obj[FLOAT_KEY]
            if len(obj) != 1 or not isinstance(v, str) or v not in FLOAT_NAMES:
                raise FormatError(f"{where}: the key {FLOAT_KEY!r} is reserved for {{{FLOAT_KEY!r}: 'inf' | '-inf' | "
                                  "'nan'}} alone")
            return
        if BYTES_KEY in obj:
            v = obj[BYTES_KEY]
            if len(obj) != 1 or not isinstance(v, str) or len(v) > (MAX_BYTES + 2) // 3 * 4 or not _BASE64.fullmatch(v):
                raise FormatError(f"{where}: the key {BYTES_KEY!r} is reserved for {{{BYTES_KEY!r}: 'base64 of at most "
                                  f"{MAX_BYTES} bytes'}} alone")
            return
        if RANK_VALUE_KEY in obj or (in_rank and PER_RANK_KEY in obj):
            raise FormatError(f"{where}: the key {RANK_VALUE_KEY if RANK_VALUE_KEY in obj else PER_RANK_KEY!r} is "
                              "reserved by unickpt")
        if PER_RANK_KEY in obj:
            v = obj[PER_RANK_KEY]
            if len(obj) != 1 or not isinstance(v, list) or (type(world) is int and len(v) != world):
                raise FormatError(f"{where}: a per-rank value must be {{{PER_RANK_KEY!r}: [one value per saving rank "
                                  f"({world})]}}")
            for i, x in enumerate(v):
                _check_state_values(x, world, f"{where}.rank{i}", depth + 1, True)
            return
        for k, x in obj.items():
            _check_state_values(x, world, f"{where}.{k}", depth + 1, in_rank)
    elif isinstance(obj, list):
        for i, x in enumerate(obj):
            _check_state_values(x, world, f"{where}.{i}", depth + 1, in_rank)


def _str_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _pos_float(v) -> bool:
    return type(v) in (int, float) and math.isfinite(v) and v > 0


_SAVED_BY = {"world_size": lambda v: type(v) is int and v >= 1, "nodes": _str_list, "strategy": lambda v: isinstance(v, dict),
             "unickpt_version": lambda v: isinstance(v, str), "torch_version": lambda v: isinstance(v, str)}
_COMPRESSION = {"quant": lambda v: v in (None, "O0", "O1", "O2"), "master": lambda v: v in ("full", "residual", "drop"),
                "zstd": lambda v: v is None or (type(v) is int and -131072 <= v <= 22), "eps": _pos_float,
                "block": lambda v: type(v) is int and 2 <= v <= MAX_BLOCK,
                "rounding": lambda v: v in ("stochastic", "nearest"),
                "max_generations": lambda v: v is None or (type(v) is int and v >= 0),
                "over_budget": lambda v: v in ("lossless", "refuse"),
                "lossy_generations": lambda v: type(v) is int and 0 <= v < 1 << 31,
                "lossless": lambda v: type(v) is bool}


def _typed_fields(obj: dict, checks: dict, where: str) -> None:
    """Free-form objects that tools read: known fields must have their type."""
    for k, ok in checks.items():
        if k in obj and not ok(obj[k]):
            raise FormatError(f"{where}: field {k!r} has an unexpected value {str(obj[k])[:60]!r}")
