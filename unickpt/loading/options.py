"""What a load is asked to do beyond the state and the path (:class:`LoadOptions`) and what it did
(:class:`LoadResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal, Mapping

from .._metrics import gbps
from ..errors import InvalidArgumentError
from ..transport import resolve_timeout


Verify = Literal["auto", "full", "none"]


@dataclass(frozen=True)
class LoadResult:
    path: str
    step: int | None
    extra: dict[str, Any]
    tensors: int
    bytes_read: int
    seconds: float
    verified: int
    missing: list[str] = field(default_factory=list)
    """Target values the checkpoint does not hold, left untouched (``missing="warn"``; the
    default raises instead): tensors as ``role/name``, JSON values as their dotted path."""
    phases: dict[str, float] = field(default_factory=dict)
    received: int = 0
    """Bytes other ranks read for this one and sent (node-local checkpoints)."""
    unexpected: list[str] = field(default_factory=list)
    """``role/name`` of checkpoint tensors under roles the target names that the target does
    not ask for (not loaded; ``unexpected="error"`` raises instead)."""
    skipped: list[str] = field(default_factory=list)
    """Values in both the target and the checkpoint that were not restored, with the reason
    (per-rank values saved on another world size)."""
    cast: list[str] = field(default_factory=list)
    """``role/name: STORED -> TARGET`` of each tensor converted on load (``cast=True``)."""
    lossy_generations: int = 0
    """Lossy save/resume cycles the restored values have been through (0: exact). Pass it to
    the next save of this state (``lossy_generations=``): the error budget
    (``Compression.max_generations``) counts them; docs/compression.md."""

    @property
    def gbps(self) -> float:
        return gbps(self.bytes_read, self.seconds)


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """The rarely used knobs of :func:`load` (one object, checked when built)."""

    verify: Verify = "auto"
    """``"auto"`` checks every checksummed range a rank reads entirely (every tensor it reads
    whole; in same-layout loads, every byte it reads); ``"full"`` also has the ranks share out
    and check every stored byte; ``"none"`` skips checks (an explicit opt-out)."""
    bucket_bytes: int = 256 << 20
    """Node-local checkpoints (``{node}`` in the path): pieces a rank's node does not hold are
    read by ranks that hold them and sent, at most this many bytes per reader and step."""
    timeout_s: float | None = None
    """Seconds a rank waits for the others in any one exchange before the load fails with
    :class:`~unickpt.errors.DistributedError` (None: ``UNICKPT_TIMEOUT_S``, else 600)."""
    storage_options: Mapping[str, Any] | None = field(default=None, repr=False)
    """For a URL path (``s3://``, ``memory://``, any fsspec URL): options of its file system
    (credentials, endpoint...; docs/storage.md). Never shown in reprs or logs."""
    avoid_local: tuple[str, ...] = ()
    """Node-local checkpoints: data files this rank's node must not read from its own
    directory (a copy found damaged): they are read by ranks of nodes that hold another copy
    and sent."""
    mapping: Any = field(default=None, repr=False)
    """A :class:`~unickpt.Mapping`: target names made of boxes of stored tensors (fused
    serving weights, stacked experts, renames; docs/serving.md), read and verified as any
    load reads, checked before a byte is read."""

    def __post_init__(self) -> None:
        if self.verify not in ("auto", "full", "none"):
            raise InvalidArgumentError(f"verify must be 'auto', 'full' or 'none', got {self.verify!r}")
        if type(self.bucket_bytes) is not int or self.bucket_bytes < 1:
            raise InvalidArgumentError(f"bucket_bytes must be a positive integer, got {self.bucket_bytes!r}")
        if self.timeout_s is not None:
            resolve_timeout(self.timeout_s)
        if self.storage_options is not None and not isinstance(self.storage_options, Mapping):
            raise InvalidArgumentError(f"storage_options must be a dict or None, got {self.storage_options!r}")
        if isinstance(self.avoid_local, str) or not all(isinstance(f, str) for f in self.avoid_local):
            raise InvalidArgumentError(f"avoid_local must be file names, got {self.avoid_local!r}")
        object.__setattr__(self, "avoid_local", tuple(self.avoid_local))
        if self.mapping is not None:
            from .. import mapping as _mapping

            if not isinstance(self.mapping, _mapping.Mapping):
                raise InvalidArgumentError(f"mapping must be a unickpt.Mapping or None, got {type(self.mapping).__name__}")


_LOAD_LEGACY = {f.name for f in fields(LoadOptions)}

