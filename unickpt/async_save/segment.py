"""The staging segment of an asynchronous save: a named shared-memory file
(``/dev/shm/unickpt-stage-<pid>-<token>``, :mod:`unickpt.shm`) that the trainer creates
and copies its state into, and that its writer process maps by name and saves from.

The trainer allocates it once and reuses it, growing it when the state grows
(:func:`segment_bytes`: 10% headroom, whole pages); when CUDA is available it is registered
as pinned memory (``cudaHostRegister``), so device-to-host copies run at full speed. Its
pages are reserved at creation (``posix_fallocate``), so a full ``/dev/shm`` is a clear
:class:`~unickpt.errors.AsyncSaveError`, never a SIGBUS in the copy. Its life is the
kernel's lock (:mod:`unickpt.shm`): the creator holds it until :meth:`StagingSegment.close`,
and :func:`sweep_segments` removes the segments nobody holds.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from .. import shm
from ..errors import AsyncSaveError

if TYPE_CHECKING:
    from ..state import Entry

__all__ = ["SHM_DIR", "ALIGN", "StagingSegment", "new_segment", "segment_bytes", "staging_bytes", "sweep_segments"]

SHM_DIR = shm.SHM_DIR
ALIGN = 4096


def sweep_segments() -> list[str]:
    """Unlink staging segments (and node-read buffers) of this user that no live process
    holds (:func:`unickpt.shm.sweep`: by the kernel's lock, not by pid)."""
    return shm.sweep(SHM_DIR)


def new_segment(size: int) -> "StagingSegment":
    """A staging segment under a new name (:func:`unickpt.shm.new_name`; a name taken by
    anyone, a dead process of the same pid or another user, is never reused)."""
    for _ in range(7):
        try:
            return StagingSegment(shm.new_name("stage"), size, create=True)
        except FileExistsError:
            continue
    return StagingSegment(shm.new_name("stage"), size, create=True)


class StagingSegment(shm.SharedFile):
    """The staging segment (:class:`unickpt.shm.SharedFile`) named ``name`` in
    :data:`SHM_DIR`, mapped in this process: ``tensor`` its bytes. The creator holds the
    segment's lock until :meth:`close`; what it adds to a shared file is the pinning, and
    the error a full ``/dev/shm`` raises (:class:`~unickpt.errors.AsyncSaveError`)."""

    def __init__(self, name: str, size: int, create: bool) -> None:
        self.name = name
        self.pinned = False
        try:
            super().__init__(os.path.join(SHM_DIR, name), size, create=create)
        except shm.ReserveError as e:
            raise AsyncSaveError(
                f"cannot reserve {size} bytes of shared memory in {SHM_DIR} for the staging buffer "
                f"({e.strerror}); enlarge {SHM_DIR} or save synchronously"
            ) from e

    @property
    def tensor(self) -> torch.Tensor:
        """The segment's bytes (``torch.uint8``)."""
        return self.bytes

    def pin(self) -> None:
        if torch.cuda.is_available() and not self.pinned:
            rc = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.size, 0)
            self.pinned = int(rc) == 0 if not isinstance(rc, tuple) else int(rc[0]) == 0

    def close(self, unlink: bool = True, background: bool = False) -> None:
        if self.pinned and self.bytes is not None:
            try:
                torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            except Exception:
                pass
            self.pinned = False
        super().close(unlink, background)


def segment_bytes(size: int) -> int:
    """Bytes of the staging segment made for a layout of ``size`` bytes (10% headroom, whole pages)."""
    return max(ALIGN, -(-int(size * 1.1) // ALIGN) * ALIGN)


def staging_bytes(entries: list[Entry]) -> int:
    """The most shared memory a rank's staging takes for ``entries`` (a memory budget's share):
    the segment for their bytes with every entry's alignment at its widest (a page phase)."""
    size = sum(e.local.numel() * e.local.element_size() for e in entries) + len(entries) * (ALIGN - 1)
    return segment_bytes(-(-size // 64) * 64)
