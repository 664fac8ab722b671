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

from .codecs import get
from .codecs import kernels as _k
from .codecs.master import Residual16
from .codecs.moments import MAX_BLOCK, saved_codec
from .errors import InvalidArgumentError, StateDictError
from .format import dtype_name
from .layout import Layout
from .state import Entry

__all__ = ["Compression", "error_record", "merge_error", "prepare", "save_args", "tag_for"]

_FLOAT = ("F32", "BF16", "F16", "F64")
EXCEPTION_WARN = 1 / 4096  # residual exceptions beyond this fraction: the model is not bf16(master)
EXCEPTION_LIMIT = 1 / 1024  # beyond this on any rank: stored in full (ties alone are ~1/2^17; keeps manifests small)


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
        lossless: byte-grouped entropy coding of every file, model files included (each
            tensor's bytes cut into planes, the exponent planes entropy-coded; bit-exact,
            ~1.49x on bf16 weights, ~1.2x on fp32 masters and moments; docs/compression.md).
            Stacks with ``quant`` and ``master``; replaces ``zstd`` (pass one of the two).
            Model files are then framed, not plain safetensors: ``unickpt export`` writes
            plain ones.
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
    lossless: bool = False
    eps: float = 1e-8
    block: int = _k.BLOCK
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
        if type(self.lossless) is not bool:
            raise InvalidArgumentError(f"lossless must be True or False, got {self.lossless!r}")
        if self.lossless and self.zstd is not None:
            raise InvalidArgumentError("lossless=True replaces zstd (it entropy-codes every file's byte planes): "
                                       "pass one of the two")
        if not (isinstance(self.eps, (int, float)) and 1.1754944e-38 <= self.eps <= 3.4028234e38):
            # (a float32 normal number: the second moment's grid starts at sqrt(v) + eps in float32; a
            # subnormal or zero eps puts codes off, an infinite one makes a checkpoint no load accepts)
            raise InvalidArgumentError(f"eps must be a number in [1.2e-38, 3.4e38] (a float32 normal number > 0), "
                                       f"got {self.eps!r}")
        if type(self.block) is not int or not 2 <= self.block <= MAX_BLOCK or self.block % 2:
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
        return self.quant is not None or self.master != "full" or self.zstd is not None or self.lossless

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
    return saved_codec(kind, comp.bits).tag(_k.group_size(tuple(shape), comp.bits, comp.block), float(comp.eps))


def save_args(tag: dict, role: str, name: str, comp: Compression, step: int | None) -> dict:
    """What a save at ``step`` adds to a quantized tensor's tag: the stochastic rounding's
    ``seed`` of the second moment (:func:`rounding_seed`)."""
    if comp.rounding == "stochastic" and get(tag["codec"]).seeded:
        return {"seed": rounding_seed(role, name, step)}
    return {}


def rounding_seed(role: str, name: str, step: int | None) -> int:
    """The stochastic rounding's seed of a tensor at a step (63 bits): other at every step, so
    successive cycles' errors are independent; the same for the same save, so it is
    deterministic."""
    import xxhash

    text = f"{role}\0{name}\0{step if step is not None else ''}"
    return xxhash.xxh64_intdigest(text.encode("utf-8", "surrogatepass")) >> 1


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
    tags: dict[tuple[str, str], dict] = {}
    cand: dict[str, Entry] = {}
    models: dict[str, Entry] = {}
    bad: list[str] = []
    error: BaseException | None = None
    try:  # nothing may skip the collectives below on one rank only: errors wait until after them
        tags = _moment_tags(entries, comp)
        if comp.master != "full":
            models, cand, bad = _master_candidates(entries, comp)
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
    if not chosen and not refused:  # never silently: the user asked for it
        warnings.warn(
            f"master={comp.master!r} applies to no tensor: the state has no role 'master' (a top-level key "
            "holding the fp32 master weights as a mapping keyed like the 'model' role's tensors); stored as given",
            stacklevel=4)
    if refused:
        warnings.warn(
            f"master={comp.master!r} does not apply to {len(refused)} master tensor(s) (no model weight of the same "
            f"name, shape{' and bf16 dtype' if comp.master == 'residual' else ''} on the same rank), stored in full: "
            f"{sorted(refused)[:5]}",
            stacklevel=3,
        )
    if comp.master == "drop":
        kept, dropped = _drop_masters(entries, models, chosen, gather_json)
        return kept, tags, {}, dropped
    out, exceptions = _residual_masters(entries, models, cand, chosen, tags, gather_json)
    return out, tags, exceptions, {}


def _moment_tags(entries: list[Entry], comp: Compression) -> dict[tuple[str, str], dict]:
    tags = {}
    for e in entries:
        t = tag_for(e.role, e.name, dtype_name(e.local.dtype), e.layout.shape, comp)
        if t is not None:
            tags[e.key] = t
    return tags


def _master_candidates(entries: list[Entry], comp: Compression) -> tuple[dict[str, Entry], dict[str, Entry], list[str]]:
    """This rank's model weights by name, the masters the policy can apply to here, and
    those it cannot (no model weight of the same name, shape, dtype and piece)."""
    models = {e.name: e for e in entries if e.role == "model"}
    cand: dict[str, Entry] = {}
    bad: list[str] = []
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
    return models, cand, bad


def _drop_masters(entries: list[Entry], models: dict[str, Entry], chosen: set[str], gather_json
                  ) -> tuple[list[Entry], dict]:
    """master="drop": the entries without the chosen masters, and every dropped tensor (every
    rank lists every one, also those it holds no piece of)."""
    dropped: dict = {}
    differ = []  # masters of this rank that their model weight (same dtype, same piece) does not equal
    for e in entries:
        if e.role == "master" and e.name in chosen:
            dropped[e.key] = (dtype_name(e.local.dtype), list(e.layout.shape), e.name)
            m = models[e.name]
            if m.local.dtype == e.local.dtype and m.layout == e.layout and not torch.equal(m.local, e.local):
                differ.append(e.name)
    agreed = gather_json({"d": [[k[0], k[1], *v] for k, v in dropped.items()], "differ": differ})
    for x in agreed:
        for role, name, dt, shape, model in x["d"]:
            dropped[(role, name)] = (dt, shape, model)
    differ = sorted(set().union(*(set(x.get("differ") or ()) for x in agreed)))
    if differ:
        warnings.warn(
            f"master='drop': {len(differ)} master tensor(s) are not equal to their model weights of the same "
            f"dtype, and a load restores the model's values in their place: {differ[:5]} (master='full' or "
            "'residual' keeps them)", stacklevel=4)
    return [e for e in entries if e.key not in dropped], dropped


def _residual_masters(entries: list[Entry], models: dict[str, Entry], cand: dict[str, Entry], chosen: set[str],
                      tags: dict, gather_json) -> tuple[list[Entry], dict]:
    """master="residual": the chosen masters split locally into their low 16 bits (tagged in
    ``tags``) and exceptions; a failure must not skip the collective (peers would hang)."""
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
    if error is not None:  # the last collective here: the save's agreement pairs the rest
        raise error
    too_many = set().union(*(set(x["excess"]) for x in everyone))
    if too_many:
        warnings.warn(
            f"master='residual': {len(too_many)} master tensor(s) are not the bf16 rounding of their model weights "
            f"(more than 1/1024 of the elements would be exceptions), stored in full: {sorted(too_many)[:5]}",
            stacklevel=4,
        )
    out, exceptions = [], {}
    for e in entries:
        if e.role != "master" or e.name not in chosen or e.name in too_many:
            out.append(e)
            continue
        low, idx, bits = split[e.name]  # chosen and held here: eligible here (else refused above)
        exceptions[e.key] = (idx, bits)
        out.append(Entry(e.role, e.name, low, e.layout, e.aliases, e.per_rank))
        tags[e.key] = {"codec": Residual16.name, "model": e.name}
    return out, exceptions


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
    res = _k.split_master(flat, hb)
    low = res.low.view(loc.shape)
    li = res.exc_index.cpu().numpy()
    if len(li):  # local element -> global element, through the runs
        locals_ = runs.local
        k = np.searchsorted(locals_, li, side="right") - 1
        gi = runs.starts[k] + (li - locals_[k])
    else:
        gi = np.zeros(0, np.int64)
    return low, gi.astype(np.int64), res.exc_bits.cpu().numpy().astype(np.int32)


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
