"""The fused reference pass of a verified load: what one rank's reads cost at the CPU floor.

Per rank, one thread, for every stored tensor its targets need: the checksummed ranges the
target's runs touch (whole: a load cannot verify part of a range), read with ``os.preadv``
in chunks of :data:`CHUNK` bytes into one reused buffer, each checksummed range of the
chunk hashed (xxh3-64) while the chunk is in the cache, then the needed bytes copied into
the target (strided copies, :func:`unickpt._copy.copy_window`). No planning, no threads,
no agreement between ranks: the work a load cannot avoid on the bytes it must read alone.
Loads are compared with it on the same bytes in the same job (``bench/reshard_load.py``,
``bench/memory_tier.py``).
"""

from __future__ import annotations

import os
import resource
import time

import numpy as np
import torch
import xxhash

from unickpt._copy import Windows, copy_window
from unickpt.loading import read_manifest
from unickpt.noderead import bounds, touched
from unickpt.state import flatten

CHUNK = 4 << 20


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def plan(ckpt: str, state_dict: dict) -> list[tuple]:
    """``(file path, file offset of the tensor's bytes, [(begin, end, hex)] touched, Windows,
    dest bytes, element size)`` for each tensor target of ``state_dict`` (as :func:`unickpt.load`
    takes it: ShardedTensors, tensors), in file order."""
    ckpt, man = read_manifest(ckpt)
    out = []
    entries, _ = flatten(state_dict)
    for ent in sorted(entries, key=lambda e: (man.tensors[e.key].file, man.tensors[e.key].begin)):
        st = man.tensors[ent.key]
        isz = ent.local.element_size()
        runs = ent.layout.runs()
        if not len(runs):
            continue
        keep = np.flatnonzero(touched(bounds(st), runs.starts * isz, (runs.starts + runs.lengths) * isz))
        ranges = [st.checksums[i] for i in keep.tolist()]
        out.append((os.path.join(ckpt, st.file), man.files[st.file].data_start + st.begin, ranges,
                    Windows(runs.starts, runs.lengths, runs.local), ent.local.reshape(-1).view(torch.uint8), isz))
    return out


def run_checked(jobs: list[tuple]) -> dict:
    """:func:`run` after a barrier of the job's ranks; a range that does not match fails the bench."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
    got = run(jobs)
    if got["bad"]:
        raise AssertionError(f"reference pass: {got['bad']} checksum ranges differ")
    return got


def run(jobs: list[tuple]) -> dict:
    """The pass over ``jobs`` (:func:`plan`): seconds, CPU seconds, bytes read, ranges whose
    checksum did not match (must be 0)."""
    buf = torch.empty(CHUNK, dtype=torch.uint8)
    mv = memoryview(buf.numpy())
    fds: dict[str, int] = {}
    nread = bad = 0
    c0, t0 = _cpu(), time.perf_counter()
    try:
        for path, base, ranges, windows, dest, isz in jobs:
            fd = fds.get(path)
            if fd is None:
                fd = fds[path] = os.open(path, os.O_RDONLY)
            k = 0
            while k < len(ranges):  # a chunk: consecutive ranges up to CHUNK bytes
                lo = ranges[k][0]
                j = k
                while j + 1 < len(ranges) and ranges[j + 1][0] == ranges[j][1] and ranges[j + 1][1] - lo <= CHUNK:
                    j += 1
                hi = ranges[j][1]
                if hi - lo > buf.numel():  # one range larger than a chunk (format 1: one per tensor)
                    buf = torch.empty(hi - lo, dtype=torch.uint8)
                    mv = memoryview(buf.numpy())
                n = os.preadv(fd, [mv[: hi - lo]], base + lo)
                if n != hi - lo:
                    raise OSError(f"{path}: short read")
                nread += n
                for b, e, hx in ranges[k : j + 1]:
                    if xxhash.xxh3_64_hexdigest(mv[b - lo : e - lo]) != hx:
                        bad += 1
                copy_window(buf, lo // isz, hi // isz, windows, dest, isz)
                k = j + 1
    finally:
        for fd in fds.values():
            os.close(fd)
    return {"s": time.perf_counter() - t0, "cpu_s": _cpu() - c0, "bytes_read": nread, "bad": bad}
