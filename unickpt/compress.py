"""Compression policy: which tensors a save stores coded, how writers encode them, how any
reader decodes any element range. The arithmetic lives in :mod:`unickpt.codecs`.

A save with :class:`Compression` stores:

* Adam moments (tensors of roles other than ``model``/``master`` whose dotted name has a
  component ``exp_avg`` or ``exp_avg_sq``) quantized (O1: 8 bits, O2: 4 bits): two parts
  per tensor in the same safetensors file, ``NAME::codes`` and ``NAME::scales``. Writers
  receive whole quantization groups (the routing plan aligns its buckets to groups) and
  encode them; no holder ever quantizes a partial group.
* Master weights (role ``master``) whose model weight of the same name is stored too:
  ``residual`` keeps the low 16 bits (part ``NAME::low16``, computed by the holders: it is
  elementwise) plus a list of exceptions in the manifest, ``drop`` keeps nothing and
  rebuilds the master from the model weight.

Every coded tensor keeps its logical dtype and shape in the manifest, with ``codec`` and its
arguments, so resharding loads decode exactly their slice.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass

import numpy as np
import torch

from . import codecs as _c
from .errors import FormatError, InvalidArgumentError, StateDictError
from .layout import Layout
from .state import Entry

__all__ = ["Compression", "QUANT_CODECS", "tag_for", "prepare", "encode_chunk", "parts_of", "stored_parts", "decode_range",
           "check_tag"]

_QUANT = {  # codec: (moment, bits, bytes of scales per group)
    "q8_sym": ("m", 8, 4), "q4_logm": ("m", 4, 4), "q8_logw": ("v", 8, 8), "q4_logw": ("v", 4, 8),
    "q4_sym": ("m", 4, 4), "q8_rinv": ("v", 8, 8), "q4_rinv": ("v", 4, 8),
}
QUANT_CODECS = tuple(_QUANT)
"""Moment codecs this unickpt decodes. Saves write ``q8_sym``/``q4_logm`` (first moment) and
``q8_logw``/``q4_logw`` (second); ``q4_sym`` and ``*_rinv`` are those of earlier checkpoints
(docs/compression.md, "Fidelity")."""
MASTER_CODECS = ("residual16", "from_model")
_FLOAT = ("F32", "BF16", "F16", "F64")
EXCEPTION_WARN = 1 / 4096  # residual exceptions beyond this fraction: the model is not bf16(master)
EXCEPTION_LIMIT = 1 / 1024  # beyond this on any rank: stored in full (ties alone are ~1/2^17; keeps manifests small)
MAX_GROUP = 1 << 48  # elements per quantization group a reader accepts (index arithmetic stays in int64)
MAX_BLOCK = 1 << 20  # largest O2 block (as Compression.block)


@dataclass(frozen=True)
class Compression:
    """What a save compresses.

    Args:
        quant: ``None``/``"O0"`` (moments stored as they are), ``"O1"`` (8 bits, one group per
            row), ``"O2"`` (4 bits, groups of ``block`` elements).
        master: ``"full"``, ``"residual"`` (bit-exact, 2 bytes/param next to a bf16 model
            weight) or ``"drop"`` (rebuilt from the model weight on load: lossy unless the
            model weight is fp32).
        zstd: zstd level (1-22) for optimizer and master files, or ``None``.
        eps: the optimizer's epsilon; ``sqrt(v) + eps`` (Adam's denominator) is what O1/O2
            quantize of the second moment.
        block: O2 group size (even, >= 2).
        rounding: of the second moment: ``"stochastic"`` (default: unbiased where Adam uses
            it, seeded by the step and the tensor's name, so a save is deterministic) or
            ``"nearest"`` (its errors of successive save/resume cycles can line up;
            docs/compression.md). The first moment is rounded to nearest.
        max_generations: the error budget: how many lossy save/resume cycles a state may go
            through (``None``: any number). A save of a state that has been through this many
            (``lossy_generations``) follows ``over_budget``.
        over_budget: ``"lossless"`` (the moments of that save are stored as they are, with a
            warning, and the count stops growing) or ``"refuse"`` (an
            :class:`~unickpt.errors.InvalidArgumentError` before anything is written).
    """

    quant: str | None = None
    master: str = "full"
    zstd: int | None = None
    eps: float = 1e-8
    block: int = 64
    rounding: str = "stochastic"
    max_generations: int | None = None
    over_budget: str = "lossless"

    def __post_init__(self) -> None:
        if self.quant == "O0":
            object.__setattr__(self, "quant", None)
        if self.quant not in (None, "O1", "O2"):
            raise InvalidArgumentError(f"quant must be None, 'O0', 'O1' or 'O2', got {self.quant!r}")
        if self.master not in ("full", "residual", "drop"):
            raise InvalidArgumentError(f"master must be 'full', 'residual' or 'drop', got {self.master!r}")
        if self.zstd is not None and (type(self.zstd) is not int or not 1 <= self.zstd <= 22):
            raise InvalidArgumentError(f"zstd must be None or a level 1..22, got {self.zstd!r}")
        if not (isinstance(self.eps, (int, float)) and math.isfinite(self.eps) and self.eps > 0):
            raise InvalidArgumentError(f"eps must be a finite number > 0, got {self.eps!r}")
        if type(self.block) is not int or not 2 <= self.block <= 1 << 20 or self.block % 2:
            raise InvalidArgumentError(f"block must be an even integer in 2..2^20, got {self.block!r}")
        if self.rounding not in ("stochastic", "nearest"):
            raise InvalidArgumentError(f"rounding must be 'stochastic' or 'nearest', got {self.rounding!r}")
        if self.max_generations is not None and (type(self.max_generations) is not int or self.max_generations < 0):
            raise InvalidArgumentError(f"max_generations must be None or an integer >= 0, got {self.max_generations!r}")
        if self.over_budget not in ("lossless", "refuse"):
            raise InvalidArgumentError(f"over_budget must be 'lossless' or 'refuse', got {self.over_budget!r}")

    def quant_for(self, lossy_generations: int) -> str | None:
        """The quantization a save of a state that has been through ``lossy_generations``
        lossy cycles uses under this budget: ``quant``, or None once the budget is spent
        (``over_budget="lossless"``); ``"refuse"`` raises."""
        if self.quant is None or self.max_generations is None or lossy_generations < self.max_generations:
            return self.quant
        if self.over_budget == "refuse":
            raise InvalidArgumentError(
                f"the error budget is spent: this state has been through {lossy_generations} lossy save/resume "
                f"cycle(s), max_generations={self.max_generations}; save it with quant=None (O0), raise the budget, "
                "or use over_budget='lossless'")
        return None

    @property
    def bits(self) -> int | None:
        return {None: None, "O1": 8, "O2": 4}[self.quant]

    @property
    def active(self) -> bool:
        return self.quant is not None or self.master != "full" or self.zstd is not None

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def coerce(value: "Compression | dict | None", **kw) -> "Compression":
        if isinstance(value, Compression):
            if any(v is not None for v in kw.values()):
                raise InvalidArgumentError("pass either compression=Compression(...) or quant/master/zstd, not both")
            return value
        if isinstance(value, dict):
            return Compression(**value)
        return Compression(**{k: v for k, v in kw.items() if v is not None})


def moment_kind(role: str, name: str) -> str | None:
    """``"m"`` for exp_avg, ``"v"`` for exp_avg_sq, else None (model/master never)."""
    if role in ("model", "master"):
        return None
    parts = name.split(".")
    if "exp_avg_sq" in parts:
        return "v"
    if "exp_avg" in parts:
        return "m"
    return None


def tag_for(role: str, name: str, dtype: str, shape: tuple[int, ...], comp: Compression) -> dict | None:
    """Codec tag of a moment tensor (the same on every rank and at every step: names, dtypes,
    shapes only, so a trainer's plans stay cached); :func:`save_args` adds what a save at a
    step records."""
    if comp.bits is None or dtype not in _FLOAT:
        return None
    kind = moment_kind(role, name)
    if kind is None:
        return None
    g = _c.group_size(tuple(shape), comp.bits, comp.block)
    if kind == "m":
        tag = {"codec": "q8_sym" if comp.bits == 8 else "q4_logm", "group": g}
        if comp.bits == 4:
            tag["ratio"] = _c.M_RATIO
    else:
        tag = {"codec": f"q{comp.bits}_logw", "group": g, "eps": float(comp.eps)}
    return tag


def save_args(tag: dict, role: str, name: str, comp: Compression, step: int | None) -> dict:
    """What a save at ``step`` adds to a quantized tensor's tag: the stochastic rounding's
    ``seed`` of the second moment (:func:`rounding_seed`)."""
    if comp.rounding == "stochastic" and tag["codec"].endswith("logw"):
        return {"seed": rounding_seed(role, name, step)}
    return {}


def rounding_seed(role: str, name: str, step: int | None) -> int:
    """The stochastic rounding's seed of a tensor at a step (63 bits): other at every step, so
    successive cycles' errors are independent; the same for the same save, so it is
    deterministic."""
    import xxhash

    text = f"{role}\0{name}\0{step if step is not None else ''}"
    return xxhash.xxh64_intdigest(text.encode("utf-8", "surrogatepass")) >> 1


def _bits(codec: str) -> int:
    return _QUANT[codec][1]


def check_tag(tag) -> str:
    """Validate a codec tag (``{"codec": ..., **codec_args}``, as read from a manifest) before
    it turns into decoding work; return its codec. Raises :class:`FormatError`."""
    if not isinstance(tag, dict):
        raise FormatError(f"codec tag must be an object, got {type(tag).__name__}")
    codec = tag.get("codec")
    if not isinstance(codec, str) or codec not in QUANT_CODECS + MASTER_CODECS:
        raise FormatError(f"unknown codec {codec!r} (this unickpt decodes {', '.join(QUANT_CODECS + MASTER_CODECS)})")
    if codec in QUANT_CODECS:
        g = tag.get("group")
        if type(g) is not int or not 1 <= g <= MAX_GROUP or (_bits(codec) == 4 and (g < 2 or g % 2 or g > MAX_BLOCK)):
            raise FormatError(f"codec {codec}: invalid group {g!r}")
        if _QUANT[codec][0] == "v":
            eps = tag.get("eps")
            if type(eps) not in (int, float) or not math.isfinite(eps) or eps <= 0:
                raise FormatError(f"codec {codec}: eps must be a finite number > 0, got {eps!r}")
        if codec == "q4_logm":
            r = tag.get("ratio")
            if type(r) not in (int, float) or not 1 < r <= 16:
                raise FormatError(f"codec {codec}: ratio must be a number in (1, 16], got {r!r}")
        seed = tag.get("seed", 0)
        if type(seed) is not int or not 0 <= seed < 1 << 63:
            raise FormatError(f"codec {codec}: seed must be an integer in [0, 2^63), got {seed!r}")
    elif not isinstance(tag.get("model", ""), str):
        raise FormatError(f"codec {codec}: 'model' must name a tensor, got {tag.get('model')!r}")
    return codec


def _check_shape(shape) -> None:
    if not isinstance(shape, (tuple, list)) or not all(type(s) is int and s >= 0 for s in shape):
        raise FormatError(f"shape must be non-negative integers, got {shape!r}")


def _check_range(lo, hi) -> None:
    if type(lo) is not int or type(hi) is not int or not 0 <= lo <= hi:
        raise FormatError(f"invalid element range [{lo!r}, {hi!r})")


def parts_of(tag: dict, shape: tuple[int, ...]) -> list[tuple[str, str, tuple[int, ...]]]:
    """Stored parts of a quantized tensor: ``(suffix, dtype, shape)``."""
    if check_tag(tag) not in QUANT_CODECS:
        raise FormatError(f"codec {tag['codec']} has no quantized parts")
    _check_shape(shape)
    n = math.prod(shape)
    codec, g = tag["codec"], tag["group"]
    ng = -(-n // g)
    bits = _bits(codec)
    codes = (n,) if bits == 8 else (-(-n // 2),)
    cdt = "I8" if codec == "q8_sym" else "U8"
    scales = (ng,) if _QUANT[codec][0] == "m" else (ng, 2)
    return [("codes", cdt, codes), ("scales", "F32", scales)]


def stored_parts(name: str, dtype: str, shape: tuple[int, ...], tag: dict | None) -> list[tuple[str, str, str, tuple[int, ...]]]:
    """``(part, safetensors key, dtype, shape)`` a file holds for a tensor with codec ``tag``
    (part ``""``: the tensor itself, stored as is)."""
    if tag is None:
        return [("", name, dtype, tuple(shape))]
    if tag["codec"] in QUANT_CODECS:
        return [(p, f"{name}::{p}", dt, sh) for p, dt, sh in parts_of(tag, tuple(shape))]
    if tag["codec"] == "residual16":
        return [("low16", f"{name}::low16", "I16", tuple(shape))]
    return []  # from_model: nothing stored


# -- save side ------------------------------------------------------------------------------------


def _model_offset(model: Layout, master: Layout) -> int | None:
    """Where the master piece's elements start inside the model piece's local tensor when the
    model piece holds them in the same order (same box, flat range inside); -1 when the model
    piece is the whole tensor (elements found through the master's runs); None otherwise."""
    if master.numel == 0:
        return 0
    if model.offsets == master.offsets and model.sizes == master.sizes:
        box = math.prod(master.sizes)
        mf = model.flat or (0, box)
        sf = master.flat or (0, box)
        if mf[0] <= sf[0] and sf[1] <= mf[1]:
            return sf[0] - mf[0]
    if model.is_full:
        return -1
    return None


def prepare(entries: list[Entry], comp: Compression, gather_json) -> tuple[list[Entry], dict, dict, dict]:
    """Apply the master policy locally. Returns ``(entries, tags, exceptions, dropped)``:
    residual masters replaced by their low 16 bits (int16, same layout), dropped masters
    removed; ``tags[key]`` the codec tag of each entry that has one; ``exceptions[key]`` =
    (global indices, fp32 bits) for residual masters (this rank's elements);
    ``dropped[key]`` = (dtype, shape, model name). ``gather_json(obj)`` all-gathers a JSON
    value over the group (eligibility must be agreed: every rank transforms the same set).
    """
    from .format import dtype_name

    tags: dict[tuple[str, str], dict] = {}
    bad: list[str] = []
    cand: dict[str, Entry] = {}
    models: dict[str, Entry] = {}
    error: BaseException | None = None
    try:  # nothing may skip the collectives below on one rank only: errors wait until after them
        for e in entries:
            t = tag_for(e.role, e.name, dtype_name(e.local.dtype), e.layout.shape, comp)
            if t is not None:
                tags[e.key] = t
        if comp.master != "full":
            models = {e.name: e for e in entries if e.role == "model"}
            for e in entries:
                if e.role != "master":
                    continue
                m = models.get(e.name)
                mdt = dtype_name(m.local.dtype) if m is not None else None
                edt = dtype_name(e.local.dtype)
                ok = (
                    m is not None
                    and m.layout.shape == e.layout.shape
                    and edt in _FLOAT
                    and (mdt == "BF16" and edt == "F32" if comp.master == "residual" else mdt in _FLOAT)
                    and _model_offset(m.layout, e.layout) is not None
                )
                (cand.__setitem__(e.name, e) if ok else bad.append(e.name))
    except Exception as ex:
        error = ex
    if comp.master == "full":
        if error is not None:
            raise error
        return entries, tags, {}, {}
    everyone = gather_json({"bad": bad, "cand": sorted(cand), "err": error is not None})
    if error is not None:
        raise error
    if any(x["err"] for x in everyone):  # every rank stops here, so later collectives stay paired
        raise StateDictError(f"master={comp.master!r}: another rank failed to inspect its state dict")
    refused = set().union(*(set(x["bad"]) for x in everyone))
    chosen = set().union(*(set(x["cand"]) for x in everyone)) - refused
    if refused:
        warnings.warn(
            f"master={comp.master!r} does not apply to {len(refused)} master tensor(s) (no model weight of the same "
            f"name, shape{' and bf16 dtype' if comp.master == 'residual' else ''} on the same rank), stored in full: "
            f"{sorted(refused)[:5]}",
            stacklevel=3,
        )
    out, exceptions, dropped = [], {}, {}
    if comp.master == "drop":
        differ = []  # masters of this rank that their model weight (same dtype, same piece) does not equal
        for e in entries:
            if e.role == "master" and e.name in chosen:
                dropped[e.key] = (dtype_name(e.local.dtype), list(e.layout.shape), e.name)
                m = models[e.name]
                if m.local.dtype == e.local.dtype and m.layout == e.layout and not torch.equal(m.local, e.local):
                    differ.append(e.name)
        # every rank must list every dropped tensor, also those it holds no piece of
        agreed = gather_json({"d": [[k[0], k[1], *v] for k, v in dropped.items()], "differ": differ})
        for x in agreed:
            for role, name, dt, shape, model in x["d"]:
                dropped[(role, name)] = (dt, shape, model)
        differ = sorted(set().union(*(set(x.get("differ") or ()) for x in agreed)))
        if differ:
            warnings.warn(
                f"master='drop': {len(differ)} master tensor(s) are not equal to their model weights of the same "
                f"dtype, and a load restores the model's values in their place: {differ[:5]} (master='full' or "
                "'residual' keeps them)", stacklevel=3)
        return [e for e in entries if e.key not in dropped], tags, {}, dropped
    # residual: split locally; a failure must not skip the collective below (peers would hang)
    split: dict[str, tuple] = {}
    error: BaseException | None = None
    try:
        for e in entries:
            if e.role == "master" and e.name in chosen and e.name in cand:
                split[e.name] = _residual_local(e, models[e.name])
    except Exception as ex:
        error = ex
    excess = sorted(n for n, (_, gi, _) in split.items() if len(gi) > max(16, cand[n].layout.numel * EXCEPTION_LIMIT))
    everyone = gather_json({"excess": excess})
    if error is not None:  # the last collective here: the saver's agreement pairs the rest
        raise error
    too_many = set().union(*(set(x["excess"]) for x in everyone))
    if too_many:
        warnings.warn(
            f"master='residual': {len(too_many)} master tensor(s) are not the bf16 rounding of their model weights "
            f"(more than 1/1024 of the elements would be exceptions), stored in full: {sorted(too_many)[:5]}",
            stacklevel=3,
        )
    for e in entries:
        if e.role != "master" or e.name not in chosen or e.name in too_many:
            out.append(e)
            continue
        low, idx, bits = split[e.name]  # chosen and held here: eligible here (else refused above)
        exceptions[e.key] = (idx, bits)
        out.append(Entry(e.role, e.name, low, e.layout, e.aliases, e.per_rank))
        tags[e.key] = {"codec": "residual16", "model": e.name}
    return out, tags, exceptions, dropped


def _residual_local(master: Entry, model: Entry) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """Low 16 bits of this rank's master piece (same shape and layout) and its exceptions,
    against the model weight the checkpoint stores for the same elements."""
    loc = master.local.detach().contiguous()
    flat = loc.reshape(-1)
    runs = master.layout.runs()
    src = model.local.detach().contiguous().reshape(-1)
    off = _model_offset(model.layout, master.layout)
    if off == -1 and len(runs) > 1:
        hb = torch.empty(flat.numel(), dtype=torch.bfloat16, device=src.device)
        for g, n, lo in zip(runs.starts.tolist(), runs.lengths.tolist(), runs.local.tolist()):
            hb[lo : lo + n] = src[g : g + n]
    elif off == -1:
        g0 = int(runs.starts[0]) if len(runs) else 0
        hb = src[g0 : g0 + flat.numel()]
    else:
        hb = src[off : off + flat.numel()]
    res = _c.split_master(flat, hb)
    low = res.low.view(loc.shape)
    li = res.exc_index.cpu().numpy()
    if len(li):  # local element -> global element, through the runs
        locals_ = runs.local
        k = np.searchsorted(locals_, li, side="right") - 1
        gi = runs.starts[k] + (li - locals_[k])
    else:
        gi = np.zeros(0, np.int64)
    return low, gi.astype(np.int64), res.exc_bits.cpu().numpy().astype(np.int32)


def encode_chunk(tag: dict, x: torch.Tensor, start: int, what: str = "", stats: list | None = None
                 ) -> list[tuple[str, int, torch.Tensor]]:
    """Encode elements ``[start, start+len(x))`` of a moment (``start`` on a group boundary,
    the chunk whole groups or the tensor's end): ``(part, byte offset in part, bytes)``.
    ``what``: the tensor, as errors name it. ``stats``: the chunk's quantization error is
    added to it (computed by the encoder from the codes it made, while the chunk is in
    cache; :func:`merge_error`, :func:`error_record`)."""
    codec, g = tag["codec"], tag["group"]
    bits = _bits(codec)
    if start % g:
        raise ValueError(f"chunk start {start} is not on a group boundary ({g})")
    x = x.reshape(-1).float()
    coff = start if bits == 8 else start // 2
    soff = (start // g) * _QUANT[codec][2]
    if codec == "q4_logm":
        codes, scales = _c.encode_mlog(x, g, tag["ratio"], what or "exp_avg", start, stats)
    elif _QUANT[codec][0] == "m":
        codes, scales = _c.encode_m(x, bits, g, what or "exp_avg", start, stats)
    elif codec.endswith("logw"):
        codes, lo, hi = _c.encode_w(x, bits, g, tag["eps"], what or "exp_avg_sq", start, tag.get("seed"), stats)
        scales = torch.stack([lo, hi], dim=1)
    else:  # (earlier checkpoints' second-moment code: offline rewrites of one)
        codes, lo, hi = _c.encode_v(x, bits, g, tag["eps"], what or "exp_avg_sq", start)
        scales = torch.stack([lo, hi], dim=1)
        if stats is not None:
            _c._tally(stats, _c.decode_v(codes, lo, hi, bits, g, tag["eps"], start, x.numel()), x)
    return [("codes", coff, codes.reshape(-1).view(torch.uint8)), ("scales", soff, scales.reshape(-1).view(torch.uint8))]


def merge_error(into: list, other: list) -> None:
    if not into:
        into.extend([0.0, 0.0, 0.0, 0.0, 0])
    into[0] += other[0]
    into[1] += other[1]
    into[2] = max(into[2], other[2])
    into[3] += other[3]
    into[4] += other[4]


def error_record(stats: list) -> dict:
    """What a manifest records of a tensor's quantization error: the relative L2 error (4
    significant digits; the 4th may depend on how the writer cut the tensor into chunks) and
    the max abs error (exact)."""
    sse, ss, mx, _, _ = stats
    return {"rel_l2": float(f"{math.sqrt(sse / ss):.4g}") if ss > 0 else 0.0, "max_abs": mx}


def chunk_elems(tag: dict, bucket_elems: int) -> int:
    """Elements per gathered chunk of a quantized tensor: whole groups, at least one."""
    g = tag["group"]
    return max(g, (bucket_elems // g) * g)


# -- load side --------------------------------------------------------------------------------


def byte_ranges(tag: dict, lo: int, hi: int) -> dict[str, tuple[int, int]]:
    """Byte ranges of each part needed to decode elements ``[lo, hi)``."""
    codec = check_tag(tag)
    _check_range(lo, hi)
    if codec == "from_model":
        return {}
    if codec == "residual16":
        return {"low16": (2 * lo, 2 * hi)}
    g = tag["group"]
    bits = _bits(codec)
    c = (lo, hi) if bits == 8 else (lo // 2, (hi + 1) // 2)
    w = _QUANT[codec][2]
    s = ((lo // g) * w, (-(-hi // g)) * w) if hi > lo else (0, 0)
    return {"codes": c, "scales": s}


def decode_range(tag: dict, parts: dict[str, torch.Tensor], lo: int, hi: int,
                 model: torch.Tensor | None = None, exceptions: tuple | None = None) -> torch.Tensor:
    """fp32 elements ``[lo, hi)`` from the bytes of :func:`byte_ranges` (and, for master
    codecs, the model weight's elements ``[lo, hi)``). Parts of other lengths than
    :func:`byte_ranges` says, or a missing model weight, raise :class:`FormatError`."""
    codec = tag.get("codec") if isinstance(tag, dict) else None
    for p, (b, e) in byte_ranges(tag, lo, hi).items():
        x = parts.get(p) if isinstance(parts, dict) else None
        if not isinstance(x, torch.Tensor) or x.numel() * x.element_size() != e - b:
            got = "missing" if not isinstance(x, torch.Tensor) else f"{x.numel() * x.element_size()} bytes"
            raise FormatError(f"codec {codec}: part {p!r} of elements [{lo}, {hi}) needs {e - b} bytes, {got}")
    if codec in MASTER_CODECS and (not isinstance(model, torch.Tensor) or model.numel() != hi - lo
                                   or (codec == "residual16" and model.element_size() != 2)):
        raise FormatError(f"codec {codec}: decoding elements [{lo}, {hi}) needs the model weight's {hi - lo} elements"
                          f"{' (16-bit)' if codec == 'residual16' else ''}")
    if codec == "from_model":
        return model.float()
    if codec == "residual16":
        low = parts["low16"].view(torch.int16)
        idx, bits = exceptions if exceptions is not None else (torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int32))
        return _c.merge_master(model.view(torch.bfloat16), low, idx, bits, start=lo)
    g = tag["group"]
    bits = _bits(codec)
    codes = parts["codes"]
    if codec == "q8_sym":
        codes = codes.view(torch.int8)
    if codec == "q4_logm" or codec.endswith("sym"):
        scale = parts["scales"].view(torch.float32)
        if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
            raise FormatError(f"codec {codec}: a group's scale (absmax) of elements [{lo}, {hi}) is negative or not "
                              "finite: no encoder writes one")
        if codec == "q4_logm":
            return _c.decode_mlog(codes, scale, g, tag["ratio"], lo, hi - lo)
        return _c.decode_m(codes, scale, bits, g, lo, hi - lo)
    sc = parts["scales"].view(torch.float32).view(-1, 2)
    # w = sqrt(v) + eps >= eps (in fp32; a hair of slack for the rounding of eps); r = 1/w > 0
    floor = float(torch.tensor(tag["eps"], dtype=torch.float32)) * (1 - 2 ** -20) if codec.endswith("logw") else 0.0
    if not bool(torch.isfinite(sc).all()) or bool((sc[:, 0] > sc[:, 1]).any()) or bool((sc[:, 0] < floor).any()) \
            or (floor == 0.0 and bool((sc[:, 0] <= 0).any())):
        raise FormatError(f"codec {codec}: a group's range [lo, hi] of elements [{lo}, {hi}) is not finite, inverted "
                          f"or below {'eps' if floor else 'zero'}: no encoder writes one")
    dec = _c.decode_w if codec.endswith("logw") else _c.decode_v
    return dec(codes, sc[:, 0], sc[:, 1], bits, g, tag["eps"], lo, hi - lo)
