"""The trainer's copy of its state into the staging segment: where each entry sits in it
(:func:`place`) and the copy itself (:func:`copy_into`).

With ``background_staging`` the copy streams: every ~:data:`STAGE_CHUNK` bytes it tells the
writer how far it has got, and the writer, which has the save's command already, writes
what has arrived while the rest is copied."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from dataclasses import dataclass
from typing import Callable

import torch

from .._metrics import log
from ..format import dtype_name
from ..state import Entry
from .protocol import StagedEntry
from .segment import ALIGN, StagingSegment

__all__ = ["STAGE_CHUNK", "Staged", "place", "ready_events", "copy_into"]

STAGE_CHUNK = 32 << 20  # the trainer tells its writer how far the copy has got every ~this many bytes


@dataclass
class Staged:
    """The entries of one save as they sit in the segment (:func:`place`)."""

    entries: list[StagedEntry]
    size: int
    signature: str  # what the entries are, without where they sit (see place)
    # per CUDA device of the state: an event on the caller's current stream at the save (see ready_events)
    ready: dict = dataclasses.field(default_factory=dict)


def ready_events(entries: list[Entry]) -> dict:
    """An event recorded, in the caller's thread, on the current stream of each device that
    holds a staged tensor: the copies wait for the work queued before the save (the step
    that produced the state) and for nothing the caller queues after it."""
    out: dict = {}
    for e in entries:
        dev = e.local.device
        if dev.type == "cuda" and dev not in out:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(dev))
            out[dev] = ev
    return out


def place(entries: list[Entry], known: tuple[str, list[int | None]] | None) -> Staged:
    """Where each entry goes in the segment. Entries are 64-byte aligned, except those the
    writer's plan of the previous save of the same entries gave a page phase (``known``:
    that save's signature and the phase of each entry): they sit at that offset within a
    page, the one their bytes have in their file, so the writer's O_DIRECT writes take them
    straight from the segment (the plan is the same as long as the entries are: the
    writers' plan cache). A phase that no longer fits costs only the copy it would have
    saved: the writer checks every write's alignment itself."""
    rows = [StagedEntry(e.role, e.name, dtype_name(e.local.dtype), e.layout, 0,
                        e.local.numel() * e.local.element_size(), tuple(e.aliases), e.per_rank) for e in entries]
    signature = json.dumps([r.to_wire() for r in rows])
    phases = known[1] if known is not None and known[0] == signature else None
    pos = 0
    for i, row in enumerate(rows):
        phase = phases[i] if phases is not None else None
        if not (type(phase) is int and 0 <= phase < ALIGN and phase % entries[i].local.element_size() == 0):
            phase = None
        pos += (phase - pos) % ALIGN if phase is not None else -pos % 64
        row.offset = pos
        pos += row.nbytes
    return Staged(rows, -(-pos // 64) * 64, signature)


class _CopyStreams:
    """The CUDA streams of one copy: per device, the checkpointer's high-priority stream
    (``held``, made on first use), waiting for that device's event of :func:`ready_events`."""

    def __init__(self, held: dict, ready: dict) -> None:
        self._held, self._ready, self._used = held, ready, {}

    def get(self, dev):
        s = self._used.get(dev)
        if s is None:
            s = self._held.get(dev)
            if s is None:  # high priority: the pool NCCL and most user code draw from is the other one
                s = self._held[dev] = torch.cuda.Stream(dev, priority=-1)
            s.wait_event(self._ready[dev])  # ready_events saw every entry's device
            self._used[dev] = s
        return s

    def sync(self) -> None:
        """Wait for the copies queued so far (an event recorded after them, not the whole stream)."""
        for s in self._used.values():
            ev = torch.cuda.Event()
            ev.record(s)
            ev.synchronize()


def copy_into(seg: StagingSegment, entries: list[Entry], staged: Staged, held_streams: dict,
              tell: Callable[[int], None] | None = None) -> None:
    """Copy the entries into the segment in segment order; every ~:data:`STAGE_CHUNK` bytes
    (large tensors in blocks of elements, or of rows when not contiguous), ``tell(end)``:
    the segment is filled up to byte ``end`` (device copies synchronized first).

    Device tensors are copied on a high-priority stream held per device in ``held_streams``
    (the checkpointer's), after the event of :func:`ready_events`: a background copy
    overlaps the caller's next kernels (on the legacy default stream it would queue behind
    them and delay them). Waiting for the copy waits on an event recorded after its copies,
    not on the whole stream (PyTorch hands out pool streams in turn, so other code may queue
    on the same one). ``entries`` holds every source until the copies are complete, so
    nothing the caller frees meanwhile is reused early; a copy that fails part way is still
    waited for before the error leaves (the segment may be unmapped next)."""
    streams = _CopyStreams(held_streams, staged.ready)
    told = 0
    try:
        for e, row in zip(entries, staged.entries):
            if row.nbytes:
                told = _copy_entry(seg, e, row, streams, tell, told)
        streams.sync()
    except BaseException:
        try:  # no copy may still land in the segment once the error has left
            streams.sync()
        except Exception as err:  # the first error is the one raised
            log.warning("waiting for the device copies of a failed staging: %s", err)
        raise


def _copy_entry(seg: StagingSegment, e: Entry, row: StagedEntry, streams: _CopyStreams, tell, told: int) -> int:
    """Copy one entry to its place (:func:`copy_into`); returns the last byte told."""
    off, n = row.offset, row.nbytes
    dst = seg.tensor[off : off + n].view(e.local.dtype).view(e.local.shape)
    src = e.local.detach()
    if src.is_contiguous():  # blocks of elements: a tensor of few long rows (1 x N) streams too
        dst, src = dst.view(-1), src.view(-1)
    s = streams.get(src.device) if src.device.type == "cuda" else None
    rows = src.shape[0] if src.dim() else 1
    step = rows if tell is None or src.dim() == 0 else max(1, STAGE_CHUNK * rows // n)
    with torch.cuda.stream(s) if s is not None else contextlib.nullcontext():
        for a in range(0, rows, step):
            d, x = (dst, src) if step >= rows else (dst[a : a + step], src[a : a + step])
            d.copy_(x, non_blocking=s is not None and seg.pinned)
            end = off + (n if step >= rows else min(rows, a + step) * (n // rows))
            if tell is not None and end - told >= STAGE_CHUNK:
                streams.sync()
                tell(end)
                told = end
    return told
