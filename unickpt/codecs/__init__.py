"""Codecs: how a tensor is stored, as objects in one registry (:mod:`.base`).

* :mod:`.base`: the :class:`Codec` protocol and the registry (``raw``);
* :mod:`.moments`: Adam's moments quantized (O1, O2 and earlier checkpoints' codes);
* :mod:`.master`: master weights against the model weight (``residual16``, ``from_model``);
* :mod:`.kernels`: the arithmetic (pure torch, no I/O, no communication).

The functions here take a codec *tag* (``{"codec": name, **args}``, as the plan and the
manifest carry it), check it once (:func:`of_tag`) and call its codec. A new codec is one
class and one :func:`register` line; nothing outside this package compares codec names.
"""

from __future__ import annotations

import torch

from ..errors import FormatError
from .base import Codec, Raw, get, names, of_tag, register
# importing a codec's module registers it (moments first: names() lists them in this order)
from .moments import MAX_BLOCK, MAX_GROUP, Quantized, saved_codec  # isort: skip
from .master import FromModel, Residual16  # isort: skip

__all__ = ["Codec", "FromModel", "MAX_BLOCK", "MAX_GROUP", "Quantized", "Raw", "Residual16", "byte_ranges", "chunk_elems",
           "decode_range", "encode_chunk", "get", "names", "of_tag", "parts_of", "register", "saved_codec", "stored_parts"]


def parts_of(tag: dict, shape: tuple[int, ...]) -> list[tuple[str, str, tuple[int, ...]]]:
    """Stored parts of a quantized tensor: ``(suffix, dtype, shape)``."""
    codec = of_tag(tag)
    if not codec.quantized:
        raise FormatError(f"codec {codec.name} has no quantized parts")
    return codec.parts(tag, tuple(shape))


def stored_parts(name: str, dtype: str, shape: tuple[int, ...], tag: dict | None
                 ) -> list[tuple[str, str, str, tuple[int, ...]]]:
    """``(part, safetensors key, dtype, shape)`` a file holds for a tensor with codec ``tag``
    (part ``""``: the tensor itself, stored as is; None: no codec)."""
    if tag is None:
        return [("", name, dtype, tuple(shape))]
    return [(p, f"{name}::{p}", dt, sh) for p, dt, sh in of_tag(tag).parts(tag, tuple(shape))]


def encode_chunk(tag: dict, x: torch.Tensor, start: int, what: str = "", stats: list | None = None
                 ) -> list[tuple[str, int, torch.Tensor]]:
    """Encode elements ``[start, start+len(x))`` of a quantized tensor (``start`` on a group
    boundary, the chunk whole groups or the tensor's end): ``(part, byte offset in part,
    bytes)``. ``what``: the tensor, as errors name it. ``stats``: the chunk's quantization
    error is added to it (computed by the encoder from the codes it made, while the chunk is
    in cache; :func:`unickpt.compress.merge_error`, :func:`unickpt.compress.error_record`)."""
    return of_tag(tag).encode(tag, x, start, what, stats)  # (the tag checked, as decode_range checks it)


def chunk_elems(tag: dict, bucket_elems: int) -> int:
    """Elements per gathered chunk of a quantized tensor: whole groups, at least one."""
    g = tag["group"]
    return max(g, (bucket_elems // g) * g)


def byte_ranges(tag: dict, lo: int, hi: int) -> dict[str, tuple[int, int]]:
    """Byte ranges of each part needed to decode elements ``[lo, hi)``."""
    return of_tag(tag).byte_ranges(tag, lo, hi)


def decode_range(tag: dict, parts: dict[str, torch.Tensor], lo: int, hi: int,
                 model: torch.Tensor | None = None, exceptions: tuple | None = None) -> torch.Tensor:
    """fp32 elements ``[lo, hi)`` from the bytes of :func:`byte_ranges` (and, for master
    codecs, the model weight's elements ``[lo, hi)``). Parts of other lengths than
    :func:`byte_ranges` says, or a missing model weight, raise :class:`FormatError`."""
    name = tag.get("codec") if isinstance(tag, dict) else None
    codec = of_tag(tag)
    if not (type(lo) is int and type(hi) is int and 0 <= lo <= hi < 1 << 62):
        raise FormatError(f"codec {name}: elements [{lo!r}, {hi!r}) are not a range inside [0, 2^62)")
    for p, (b, e) in codec.byte_ranges(tag, lo, hi).items():
        x = parts.get(p) if isinstance(parts, dict) else None
        if not isinstance(x, torch.Tensor) or x.numel() * x.element_size() != e - b:
            got = "missing" if not isinstance(x, torch.Tensor) else f"{x.numel() * x.element_size()} bytes"
            raise FormatError(f"codec {name}: part {p!r} of elements [{lo}, {hi}) needs {e - b} bytes, {got}")
    if codec.needs_model and (not isinstance(model, torch.Tensor) or model.numel() != hi - lo
                              or (codec.model_dtype == "BF16" and model.element_size() != 2)):
        raise FormatError(f"codec {name}: decoding elements [{lo}, {hi}) needs the model weight's {hi - lo} elements"
                          f"{' (16-bit)' if codec.model_dtype == 'BF16' else ''}")
    return codec.decode(tag, parts, lo, hi, model, exceptions)
