"""Coded tensors (quantized moments, residual or dropped masters) read window by window and
decoded into the target (:func:`read_coded`); whole stored tensors for the offline tools
(:func:`read_whole`)."""

from __future__ import annotations

import numpy as np
import torch

from .. import codecs
from .._copy import as_bytes, copy_runs
from ..errors import ChecksumError, FormatError
from ..format import Hasher, torch_dtype
from ..io.files import Files, open_file
from ..layout import Layout, Runs
from ..manifest import Manifest, TensorEntry
from ..state import Entry
from .verify import StreamCheck


CODED_WINDOW = 1 << 22  # elements of a coded tensor decoded at once


def split_runs(runs: Runs, cap: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs cut into pieces of at most ``cap`` elements: (starts, lengths, local offsets)."""
    starts, lengths, local = runs.starts, runs.lengths, runs.local
    if len(lengths) == 0 or int(lengths.max()) <= cap:
        return starts, lengths, local
    reps = -(-lengths // cap)
    idx = np.repeat(np.arange(len(lengths)), reps)
    first = np.cumsum(reps) - reps
    k = np.arange(int(reps.sum())) - np.repeat(first, reps)
    s = starts[idx] + k * cap
    ln = np.minimum(cap, lengths[idx] - k * cap)
    lo = local[idx] + k * cap
    return s, ln, lo


def read_coded(e: Entry, st: TensorEntry, man: Manifest, files: "Files", verify
                ) -> tuple[list[tuple[str, str]], int]:
    """Decode this rank's runs of a coded tensor, window by window: the codes and scales (or
    low halves and model weights) of each window are read, checked as they stream, decoded.
    Returns the ``(file, tensor)`` whose bytes failed their checks (the model weight's own,
    for a master decoded from it) and the bytes checked."""
    local = e.local.detach()
    isz = local.element_size()
    direct = local.device.type == "cpu" and local.is_contiguous()
    out = local if direct else torch.empty(local.shape, dtype=local.dtype)
    dest = as_bytes(out)
    tag, coder = st.tag, st.coder
    model_name = coder.model_of(st.args)
    model = man.tensors[("model", model_name)] if model_name is not None else None
    exc = st.exceptions if coder.exceptions else None
    regions = [(p, man.files[st.file].data_start + part.begin, StreamCheck(part.checksums)) for p, part in st.parts.items()]
    if model is not None:
        regions.append(("model", man.files[model.file].data_start + model.begin, StreamCheck(model.checksums)))
    starts, lengths, locs = split_runs(e.layout.runs(), CODED_WINDOW)
    ends = starts + lengths
    scratch: dict[str, list[torch.Tensor]] = {}  # per region, two buffers reused across windows
    held: dict[str, tuple[int, int, torch.Tensor]] = {}  # per region: the last window's bytes
    windows = 0
    i, n = 0, len(starts)
    while i < n:
        lo = int(starts[i])
        j = max(i + 1, int(np.searchsorted(ends, lo + CODED_WINDOW, side="right")))
        hi = int(ends[j - 1])
        ranges = coder.byte_ranges(tag, lo, hi)
        if model is not None:
            misz = torch_dtype(model.dtype).itemsize
            ranges["model"] = (lo * misz, hi * misz)
        got = {}
        for p, base, check in regions:
            b, end = ranges[p]
            eb, ee = check.touch(b, end) if verify != "none" else (b, end)  # whole checksummed ranges
            bufs = scratch.setdefault(p, [torch.empty(0, dtype=torch.uint8)] * 2)
            slot = windows % 2  # ping-pong: the previous window's bytes stay intact
            if bufs[slot].numel() < ee - eb:
                bufs[slot] = torch.empty(ee - eb, dtype=torch.uint8)
            buf = bufs[slot][: ee - eb]
            fresh = eb
            prev = held.get(p)
            if prev is not None and prev[0] <= eb < prev[1]:  # bytes already read (and hashed): reuse them,
                k = min(prev[1], ee) - eb  # so what is decoded is what was verified
                buf[:k].copy_(prev[2][eb - prev[0] : eb - prev[0] + k])
                fresh = eb + k
            if ee > fresh:
                files.get(model.file if p == "model" else st.file).readinto(base + fresh, memoryview(buf[fresh - eb :].numpy()))
            if verify != "none":
                check.feed(eb, buf)
            held[p] = (eb, ee, buf)
            got[p] = buf[b - eb : end - eb]
        windows += 1
        mt = got.pop("model").view(torch_dtype(model.dtype)) if model is not None else None
        try:
            vals = codecs.decode_range(tag, got, lo, hi, mt, exc).to(local.dtype)
        except FormatError as e:
            if verify != "none" and any(not c.matched for _, _, c in regions):
                break  # damaged bytes (the window's ranges were hashed whole before the decode): a ChecksumError
            raise FormatError(f"{st.file}: tensor {st.role}/{st.name}: {e}") from None
        copy_runs(as_bytes(vals), starts[i:j] - lo, dest, locs[i:j], lengths[i:j], isz)
        i = j
    if not direct:
        local.copy_(out)
    failed = sorted({(model.file, model.name) if p == "model" else (st.file, st.name) for p, _, c in regions if not c.ok})
    return failed, sum(c.checked for _, _, c in regions)


def read_whole(storage, ckpt: str, man: Manifest, role: str, name: str, readers: dict) -> torch.Tensor:
    """One stored tensor, whole (coded tensors decoded), with every checksum range verified
    (offline tools). ``readers`` caches open files (headers checked once); the caller closes them."""
    st = man.tensors[(role, name)]
    model_name = st.coder.model_of(st.args)
    files = [st.file] + ([man.tensors[("model", model_name)].file] if model_name is not None else [])
    for f in files:
        if f not in readers:
            readers[f] = open_file(storage, ckpt, man, f)
    if st.coder.coded:
        x = torch.empty(st.shape, dtype=torch_dtype(st.dtype))
        shim = Files(storage, ckpt, man)
        shim.readers = readers
        failed, _ = read_coded(Entry(role, name, x, Layout.full(st.shape)), st, man, shim, "full")
        if failed:
            f, n = failed[0]
            what = (f"tensor {n!r} (role {role})" if f == st.file else
                    f"tensor {n!r} (role model, read to decode {name!r} of role {role})")
            raise ChecksumError(f"{ckpt}/{f}: {what}: stored bytes do not match their checksums", failed)
        return x
    r = readers[st.file]
    x = torch.empty(st.shape, dtype=torch_dtype(st.dtype))
    if st.nbytes:
        buf = x.reshape(-1).view(torch.uint8)
        r.readinto(man.files[st.file].data_start + st.begin, memoryview(buf.numpy()))
        for b, e, h in st.checksums:
            if Hasher.of(memoryview(buf[b:e].numpy())) != h:
                raise ChecksumError(
                    f"{ckpt}/{st.file}: tensor {name!r} (role {role}) bytes [{b}, {e}) do not match their checksum",
                    [(st.file, name)],
                )
    return x

