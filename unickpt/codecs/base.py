"""What a codec is (:class:`Codec`) and the one registry of them (:func:`register`,
:func:`get`). A codec turns a tensor's elements into stored parts and back, chunk by chunk,
so a reader decodes only the elements it needs. Every codec's name appears in this package
only: the rest of unickpt asks the codec object (``TensorEntry.coder``, :func:`of_tag`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from ..errors import FormatError
from ..format import torch_dtype

if TYPE_CHECKING:
    from ..manifest import TensorEntry

__all__ = ["Codec", "Raw", "get", "names", "of_tag", "register"]


class Codec:
    """A way a tensor is stored. Stateless: a tensor's arguments (its tag without ``codec``:
    group, eps, seed, the model tensor's name...) are passed to each call.

    Class attributes say what callers may rely on; methods take the tensor's ``args``. A new
    codec is one subclass and one :func:`register` call."""

    name: ClassVar[str]
    coded: ClassVar[bool] = True
    """False for ``raw`` only: the tensor's bytes stored as they are (checksummed directly)."""
    quantized: ClassVar[bool] = False
    """Lossy moment codes: encoded chunk by chunk at save (:meth:`encode`), counted as a lossy
    generation, with the error of their encoding recorded."""
    needs_model: ClassVar[bool] = False
    """Decoded against the model tensor ``args["model"]`` (masters): :meth:`model_of`."""
    model_dtype: ClassVar[str | None] = None
    """The dtype that model tensor must have (None: any)."""
    stores: ClassVar[bool] = True
    """Whether the tensor has bytes of its own in its file (a dropped master has none)."""
    exceptions: ClassVar[bool] = False
    """Carries exception lists in its args (residual masters), merged from every rank's report."""

    def model_of(self, args: dict) -> str | None:
        """The model tensor this one decodes from, or None."""
        return args.get("model") if self.needs_model else None

    def check_tag(self, tag: dict) -> None:
        """Validate a tag's arguments before they turn into decoding work (FormatError)."""

    def check_record(self, args: dict, dtype: str, shape: tuple[int, ...], w: str) -> dict[str, tuple[str, tuple]]:
        """A manifest's entry, checked strictly against the tensor's dtype and shape (``w``
        names it in errors): returns the parts it must list, ``{part: (dtype, shape)}``."""
        raise NotImplementedError(f"codec {self.name} has no manifest record")

    def parts(self, args: dict, shape: tuple[int, ...]) -> list[tuple[str, str, tuple[int, ...]]]:
        """Stored parts: ``(suffix, dtype, shape)``."""
        return []

    def byte_ranges(self, args: dict, lo: int, hi: int) -> dict[str, tuple[int, int]]:
        """Byte ranges of each part needed to decode elements ``[lo, hi)``."""
        return {}

    def encode(self, args: dict, x: torch.Tensor, start: int, what: str = "", stats: list | None = None
               ) -> list[tuple[str, int, torch.Tensor]]:
        """Elements ``[start, start+len(x))`` as ``(part, byte offset in part, bytes)``."""
        raise NotImplementedError(f"codec {self.name} is not encoded chunk by chunk")

    def decode(self, args: dict, parts: dict[str, torch.Tensor], lo: int, hi: int, model: torch.Tensor | None = None,
               exceptions: tuple | None = None) -> torch.Tensor:
        """fp32 elements ``[lo, hi)`` from the bytes :meth:`byte_ranges` names (checked)."""
        raise NotImplementedError(f"codec {self.name} does not decode")

    def range_starts(self, st: "TensorEntry", model: "TensorEntry | None") -> np.ndarray:
        """Element indices where a checksummed range of the tensor's primary region starts (a
        reader for a peer cuts its work only there, so it checks every range whole)."""
        raise NotImplementedError(f"codec {self.name}: no checksummed ranges")

    def __repr__(self) -> str:
        return f"<codec {self.name}>"


class Raw(Codec):
    """The tensor's bytes as they are."""

    name = "raw"
    coded = False

    def range_starts(self, st, model) -> np.ndarray:
        per = torch_dtype(st.dtype).itemsize
        return np.array(sorted({b // per for b, _, _ in st.checksums}), dtype=np.int64)


_REGISTRY: dict[str, Codec] = {}


def register(codec: type[Codec]) -> type[Codec]:
    """Add a codec (a class decorator); its name must be new."""
    if codec.name in _REGISTRY:
        raise ValueError(f"codec {codec.name!r} is registered already")
    _REGISTRY[codec.name] = codec()
    return codec


register(Raw)


def names(*, tags: bool = False) -> tuple[str, ...]:
    """Registered names, in registration order (``tags``: those a tag may name: not raw)."""
    return tuple(n for n, c in _REGISTRY.items() if c.coded or not tags)


def get(name: str) -> Codec:
    """The codec of a manifest entry's ``codec`` (checked when the manifest is parsed)."""
    return _REGISTRY[name]


def of_tag(tag: Any) -> Codec:
    """The codec a tag (``{"codec": ..., **args}``) names, its arguments checked; FormatError
    for anything else."""
    if not isinstance(tag, dict):
        raise FormatError(f"codec tag must be an object, got {type(tag).__name__}")
    name = tag.get("codec")
    codec = _REGISTRY.get(name) if isinstance(name, str) else None
    if codec is None or not codec.coded:
        raise FormatError(f"unknown codec {name!r} (this unickpt decodes {', '.join(names(tags=True))})")
    codec.check_tag(tag)
    return codec


def check_range(lo, hi) -> None:
    if type(lo) is not int or type(hi) is not int or not 0 <= lo <= hi:
        raise FormatError(f"invalid element range [{lo!r}, {hi!r})")


def check_shape(shape) -> None:
    if not isinstance(shape, (tuple, list)) or not all(type(s) is int and s >= 0 for s in shape):
        raise FormatError(f"shape must be non-negative integers, got {shape!r}")


def numel(shape) -> int:
    return math.prod(shape)
