"""fp32 master weights stored against the bf16 model weight the checkpoint holds anyway:
``residual16`` (the low 16 bits, bit-exact with exceptions) and ``from_model`` (nothing stored:
the master is the model weight, widened)."""

from __future__ import annotations

import math

import numpy as np
import torch

from ..errors import FormatError
from ..format import torch_dtype
from . import kernels as _k
from .base import Codec, check_range, register

__all__ = ["FromModel", "Residual16"]


class _FromTheModel(Codec):
    needs_model = True

    def check_tag(self, tag: dict) -> None:
        if not isinstance(tag.get("model", ""), str):
            raise FormatError(f"codec {self.name}: 'model' must name a tensor, got {tag.get('model')!r}")


@register
class Residual16(_FromTheModel):
    """The master's low 16 bits; the bf16 model weight supplies the high 16. Elements where
    the two do not give the master back (a model weight that is not the master's high half)
    are stored whole, as exceptions in the tensor's arguments."""

    name = "residual16"
    model_dtype = "BF16"
    exceptions = True

    def check_record(self, args: dict, dtype: str, shape: tuple[int, ...], w: str) -> dict[str, tuple[str, tuple]]:
        if dtype != "F32":
            raise FormatError(f"{w}: codec residual16 stores an F32 tensor, not {dtype}")
        n = math.prod(shape)
        exc = args.get("exceptions", [[], []])
        if not (isinstance(exc, list) and len(exc) == 2 and all(isinstance(x, list) for x in exc)
                and len(exc[0]) == len(exc[1]) and all(type(i) is int and 0 <= i < n for i in exc[0])
                and all(a < b for a, b in zip(exc[0], exc[0][1:]))
                and all(type(b) is int and -(1 << 31) <= b < (1 << 31) for b in exc[1])):
            raise FormatError(f"{w}: residual16 exceptions must be [[increasing indices < {n}], [int32 bits]] of equal length")
        return {"low16": ("I16", shape)}

    def parts(self, args: dict, shape: tuple[int, ...]) -> list[tuple[str, str, tuple[int, ...]]]:
        return [("low16", "I16", tuple(shape))]

    def byte_ranges(self, args: dict, lo: int, hi: int) -> dict[str, tuple[int, int]]:
        check_range(lo, hi)
        return {"low16": (2 * lo, 2 * hi)}

    def decode(self, args, parts, lo, hi, model=None, exceptions=None) -> torch.Tensor:
        low = parts["low16"].view(torch.int16)
        if exceptions is None:
            exceptions = (torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int32))
        return _k.merge_master(model.view(torch.bfloat16), low, *exceptions, start=lo)

    def range_starts(self, st, model) -> np.ndarray:
        low = {b // 2 for b, _, _ in st.parts["low16"].checksums}
        return np.array(sorted(low | {b // torch_dtype(model.dtype).itemsize for b, _, _ in model.checksums}),
                        dtype=np.int64)


@register
class FromModel(_FromTheModel):
    """Nothing stored: the master is rebuilt from the model weight (lossy unless it is fp32)."""

    name = "from_model"
    stores = False

    def check_record(self, args: dict, dtype: str, shape: tuple[int, ...], w: str) -> dict[str, tuple[str, tuple]]:
        return {}

    def byte_ranges(self, args: dict, lo: int, hi: int) -> dict[str, tuple[int, int]]:
        check_range(lo, hi)
        return {}

    def decode(self, args, parts, lo, hi, model=None, exceptions=None) -> torch.Tensor:
        return model.float()

    def range_starts(self, st, model) -> np.ndarray:
        per = torch_dtype(model.dtype).itemsize
        return np.array(sorted({b // per for b, _, _ in model.checksums}), dtype=np.int64)
