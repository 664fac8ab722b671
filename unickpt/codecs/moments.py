"""Adam's moments quantized (O1: 8 bits, one group per row; O2: 4 bits, blocks): the codecs
saves write (``q8_sym``, ``q4_logm`` for the first moment, ``q8_logw``, ``q4_logw`` for the
second) and those of earlier checkpoints that loads still decode (``q4_sym``, ``*_rinv``).
The arithmetic is in :mod:`.kernels`; docs/compression.md explains the choices."""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np
import torch

from ..errors import FormatError
from . import kernels as _k
from .base import Codec, check_range, check_shape, get, register

__all__ = ["MAX_BLOCK", "MAX_GROUP", "Quantized", "saved_codec"]

MAX_GROUP = 1 << 48  # elements per quantization group a reader accepts (index arithmetic stays in int64)
MAX_BLOCK = 1 << 20  # largest O2 block a reader accepts (bounds decoding scratch memory)
_FLOAT = ("F32", "BF16", "F16", "F64")


class Quantized(Codec):
    """Codes (``bits`` per element) and per-group scales (``scale_bytes`` per group)."""

    quantized = True
    moment: ClassVar[str]  # "m" (exp_avg) or "v" (exp_avg_sq)
    bits: ClassVar[int]
    scale_bytes: ClassVar[int]
    code_dtype: ClassVar[str] = "U8"
    seeded: ClassVar[bool] = False
    """Stochastic rounding, seeded per save (the save records its ``seed``)."""

    def tag(self, group: int, eps: float) -> dict:
        """The tag a save gives a moment quantized with this codec (step-independent: the
        save adds its rounding seed, :func:`unickpt.compress.save_args`)."""
        return {"codec": self.name, "group": group, **({"eps": eps} if self.moment == "v" else {})}

    def check_tag(self, tag: dict) -> None:
        name, g = self.name, tag.get("group")
        if type(g) is not int or not 1 <= g <= MAX_GROUP or (self.bits == 4 and (g < 2 or g % 2 or g > MAX_BLOCK)):
            raise FormatError(f"codec {name}: invalid group {g!r}")
        if self.moment == "v":
            eps = tag.get("eps")
            if type(eps) not in (int, float) or not math.isfinite(eps) or eps <= 0:
                raise FormatError(f"codec {name}: eps must be a finite number > 0, got {eps!r}")
        seed = tag.get("seed", 0)
        if type(seed) is not int or not 0 <= seed < 1 << 63:
            raise FormatError(f"codec {name}: seed must be an integer in [0, 2^63), got {seed!r}")

    def check_record(self, args: dict, dtype: str, shape: tuple[int, ...], w: str) -> dict[str, tuple[str, tuple]]:
        name, g = self.name, args.get("group")
        if self.bits == 8:
            ok = g == _k.group_size(shape, 8)  # one row (2048 for 1-D): fixed by the shape
        else:
            ok = type(g) is int and 2 <= g <= MAX_BLOCK and g % 2 == 0
        if type(g) is not int or not ok:
            need = _k.group_size(shape, 8) if self.bits == 8 else "even, 2.." + str(MAX_BLOCK)
            raise FormatError(f"{w}: codec {name} needs group {need} for shape {list(shape)}, got {g!r}")
        if self.moment == "v":
            eps = args.get("eps")
            if not (type(eps) is float and math.isfinite(eps) and eps > 0):
                raise FormatError(f"{w}: codec {name} needs eps > 0, got {eps!r}")
        self._check_extra(args, w)
        seed = args.get("seed", 0)
        if type(seed) is not int or not 0 <= seed < 1 << 63:
            raise FormatError(f"{w}: codec {name}: seed must be an integer in [0, 2^63), got {seed!r}")
        gen = args.get("generations", 1)
        if type(gen) is not int or not 0 <= gen < 1 << 31:
            raise FormatError(f"{w}: codec {name}: generations must be an integer in [0, 2^31), got {gen!r}")
        err = args.get("error", {})
        if not isinstance(err, dict) or set(err) - {"rel_l2", "max_abs", "bias"} or not all(
                type(v) in (int, float) and math.isfinite(v) and (k == "bias" or v >= 0) for k, v in err.items()):
            raise FormatError(f"{w}: codec {name}: error must hold finite numbers rel_l2 >= 0, max_abs >= 0, bias, "
                              f"got {err!r}")
        if dtype not in _FLOAT:
            raise FormatError(f"{w}: codec {name} stores a floating tensor, not {dtype}")
        return {p: (dt, sh) for p, dt, sh in self.parts({"codec": name, **args}, shape)}

    def _check_extra(self, args: dict, w: str) -> None:
        """This codec's own arguments in a manifest (beyond group, eps, seed and the record)."""

    def parts(self, args: dict, shape: tuple[int, ...]) -> list[tuple[str, str, tuple[int, ...]]]:
        self.check_tag(args)
        check_shape(shape)
        n = math.prod(shape)
        ng = -(-n // args["group"])
        codes = (n,) if self.bits == 8 else (-(-n // 2),)
        scales = (ng,) if self.moment == "m" else (ng, 2)
        return [("codes", self.code_dtype, codes), ("scales", "F32", scales)]

    def byte_ranges(self, args: dict, lo: int, hi: int) -> dict[str, tuple[int, int]]:
        check_range(lo, hi)
        g, w = args["group"], self.scale_bytes
        c = (lo, hi) if self.bits == 8 else (lo // 2, (hi + 1) // 2)
        s = ((lo // g) * w, (-(-hi // g)) * w) if hi > lo else (0, 0)
        return {"codes": c, "scales": s}

    def encode(self, args: dict, x: torch.Tensor, start: int, what: str = "", stats: list | None = None
               ) -> list[tuple[str, int, torch.Tensor]]:
        g = args["group"]
        if start % g:
            raise ValueError(f"chunk start {start} is not on a group boundary ({g})")
        x = x.reshape(-1).float()
        codes, scales = self._encode(args, x, start, what or ("exp_avg" if self.moment == "m" else "exp_avg_sq"), stats)
        coff = start if self.bits == 8 else start // 2
        soff = (start // g) * self.scale_bytes
        return [("codes", coff, codes.reshape(-1).view(torch.uint8)), ("scales", soff, scales.reshape(-1).view(torch.uint8))]

    def decode(self, args: dict, parts: dict[str, torch.Tensor], lo: int, hi: int, model=None, exceptions=None
               ) -> torch.Tensor:
        codes = parts["codes"]
        if self.code_dtype == "I8":
            codes = codes.view(torch.int8)
        return self._decode(args, codes, parts["scales"].view(torch.float32), lo, hi)

    def range_starts(self, st, model) -> np.ndarray:
        per = 1 if self.bits == 8 else 0.5
        return np.array(sorted({int(b / per) for b, _, _ in st.parts["codes"].checksums}), dtype=np.int64)


class _FirstMoment(Quantized):
    moment = "m"
    scale_bytes = 4

    #: the largest code magnitude a decoder multiplies the scale by (-128 for 8 bits, -8 for 4)
    top = 1.0

    def _scale(self, scale: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()) or bool(
                (scale > torch.finfo(torch.float32).max / self.top).any()):
            raise FormatError(f"codec {self.name}: a group's scale (absmax) of elements [{lo}, {hi}) is negative, not "
                              "finite, or so large that its codes decode past float32's range: no encoder writes one")
        return scale


class _SecondMoment(Quantized):
    moment = "v"
    scale_bytes = 8

    def _ranges(self, args: dict, scales: torch.Tensor, lo: int, hi: int, floor: float) -> torch.Tensor:
        sc = scales.view(-1, 2)
        ceiling = torch.finfo(torch.float32).max
        if floor:  # w = sqrt(v) + eps: at most sqrt(float32's largest) + eps (a hair of slack for rounding)
            ceiling = (math.sqrt(ceiling) + float(args["eps"])) * (1 + 2 ** -20)
        if not bool(torch.isfinite(sc).all()) or bool((sc[:, 0] > sc[:, 1]).any()) or bool((sc[:, 0] < floor).any()) \
                or (floor == 0.0 and bool((sc[:, 0] <= 0).any())) or bool((sc[:, 1] > ceiling).any()):
            raise FormatError(f"codec {self.name}: a group's range [lo, hi] of elements [{lo}, {hi}) is not finite, "
                              f"inverted or below {'eps' if floor else 'zero'}: no encoder writes one")
        return sc


class _Symmetric(_FirstMoment):
    def _encode(self, args, x, start, what, stats):
        return _k.encode_m(x, self.bits, args["group"], what, start, stats)

    def _decode(self, args, codes, scales, lo, hi):
        return _k.decode_m(codes, self._scale(scales, lo, hi), self.bits, args["group"], lo, hi - lo)


@register
class Q8Sym(_Symmetric):
    """O1's first moment: ``round(m / s)``, ``s = absmax / 127`` per row."""

    name, bits, code_dtype = "q8_sym", 8, "I8"
    top = 128.0


@register
class Q4LogM(_FirstMoment):
    """O2's first moment: sign and a log-spaced magnitude (ratio ``ratio`` between levels)."""

    name, bits = "q4_logm", 4

    def check_tag(self, tag: dict) -> None:
        super().check_tag(tag)
        r = tag.get("ratio")
        if type(r) not in (int, float) or not 1 < r <= 16:
            raise FormatError(f"codec {self.name}: ratio must be a number in (1, 16], got {r!r}")

    def tag(self, group: int, eps: float) -> dict:
        return {**super().tag(group, eps), "ratio": _k.M_RATIO}

    def _check_extra(self, args: dict, w: str) -> None:
        if not (type(args.get("ratio")) is float and 1 < args["ratio"] <= 16):
            raise FormatError(f"{w}: codec {self.name} needs a ratio in (1, 16], got {args.get('ratio')!r}")

    def _encode(self, args, x, start, what, stats):
        return _k.encode_mlog(x, args["group"], args["ratio"], what, start, stats)

    def _decode(self, args, codes, scales, lo, hi):
        return _k.decode_mlog(codes, self._scale(scales, lo, hi), args["group"], args["ratio"], lo, hi - lo)


class _LogW(_SecondMoment):
    seeded = True

    def _encode(self, args, x, start, what, stats):
        codes, lo, hi = _k.encode_w(x, self.bits, args["group"], args["eps"], what, start, args.get("seed"), stats)
        return codes, torch.stack([lo, hi], dim=1)

    def _decode(self, args, codes, scales, lo, hi):
        # w = sqrt(v) + eps >= eps (in fp32; a hair of slack for the rounding of eps)
        floor = float(torch.tensor(args["eps"], dtype=torch.float32)) * (1 - 2 ** -20)
        sc = self._ranges(args, scales, lo, hi, floor)
        return _k.decode_w(codes, sc[:, 0], sc[:, 1], self.bits, args["group"], args["eps"], lo, hi - lo)


@register
class Q8LogW(_LogW):
    """O1's second moment: ``w = sqrt(v) + eps`` on a log scale, stochastic rounding."""

    name, bits = "q8_logw", 8


@register
class Q4LogW(_LogW):
    """O2's second moment: as :class:`Q8LogW` with 16 levels per block."""

    name, bits = "q4_logw", 4


@register
class Q4Sym(_Symmetric):
    """Earlier checkpoints' O2 first moment (symmetric, 4 bits)."""

    name, bits = "q4_sym", 4
    top = 8.0


class _RInv(_SecondMoment):
    """Earlier checkpoints' second moment (``r = 1/w``; offline rewrites of one still encode it)."""

    def _encode(self, args, x, start, what, stats):
        codes, lo, hi = _k.encode_v(x, self.bits, args["group"], args["eps"], what, start)
        if stats is not None:
            _k._tally(stats, _k.decode_v(codes, lo, hi, self.bits, args["group"], args["eps"], start, x.numel()), x)
        return codes, torch.stack([lo, hi], dim=1)

    def _decode(self, args, codes, scales, lo, hi):
        sc = self._ranges(args, scales, lo, hi, 0.0)
        return _k.decode_v(codes, sc[:, 0], sc[:, 1], self.bits, args["group"], args["eps"], lo, hi - lo)


@register
class Q8RInv(_RInv):
    name, bits = "q8_rinv", 8


@register
class Q4RInv(_RInv):
    name, bits = "q4_rinv", 4


_SAVED = {("m", 8): Q8Sym, ("m", 4): Q4LogM, ("v", 8): Q8LogW, ("v", 4): Q4LogW}


def saved_codec(moment: str, bits: int) -> Quantized:
    """The codec saves write for a moment (``"m"``/``"v"``) at ``bits`` (O1: 8, O2: 4)."""
    return get(_SAVED[(moment, bits)].name)
